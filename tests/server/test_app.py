"""The app runs the node's lifecycle (app/runtime/lifecycle.py) beside the server: the
coverage gate, the start-up delay and what ends it, the takeover, retiring, /ready."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from app.runtime.lifecycle import NodeLifecycle, NodeState
from app.server.admin_auth import AdminAuth
from app.server.app import create_app
from app.storage import OwnershipLostError, Replication
from tests.waiting import eventually

from .conftest import REPLICA_VERSION, new_service
from .http import http_get, serve
from .test_admin import basic


async def test_the_server_is_told_to_stop_when_the_streamer_stops(tmp_path: Path) -> None:
    db, source, service = await new_service(tmp_path, task_id="t")
    exited = asyncio.Event()
    app = create_app(db, service, lifecycle=NodeLifecycle(on_exit=exited.set, startup_delay_s=0))
    async with serve(app) as url:
        stream = await asyncio.wait_for(source.wait_for_stream(), 10)  # delay 0: started
        assert (await http_get(url + "/ready")).json() == {"ready": True}
        # A protocol violation from upstream is unrecoverable: the streamer stops.
        stream.push(
            [
                "data",
                {
                    "tag": "insert",
                    "relation": {"schema": "public", "name": "t", "rowKey": {"columns": ["id"]}},
                    "new": {"id": 1},
                },
            ]
        )
        await asyncio.wait_for(exited.wait(), 10)
        reply = await http_get(url + "/ready")
        assert reply.status == 503
        # Anonymous callers learn the state, not the error (the log and /statz have it).
        assert reply.json() == {
            "ready": False,
            "reason": "failed: the change streamer stopped with an error",
        }


async def test_a_streamer_that_stops_before_the_takeover_stops_the_server(tmp_path: Path) -> None:
    # The replica follower says the log cannot bring the replica forward while the
    # node waits for its backup: the service stops, and so must the server.
    db, _source, service = await new_service(tmp_path, task_id="t", backup_url="file:///b/r")
    exited = asyncio.Event()
    app = create_app(db, service, lifecycle=NodeLifecycle(startup_delay_s=0, on_exit=exited.set))
    async with serve(app):
        await service.stop(RuntimeError("the replica must be re-synced"))
        await asyncio.wait_for(exited.wait(), 10)


async def test_the_stream_waits_for_the_startup_delay_and_is_ready_meanwhile(
    tmp_path: Path,
) -> None:
    # Ready before it takes the change log over, as zero is: the routing layer must
    # know this node by the time the old owner lets go.
    db, source, service = await new_service(tmp_path, task_id="t")
    lifecycle = NodeLifecycle(startup_delay_s=2.0)
    app = create_app(db, service, lifecycle=lifecycle)
    async with serve(app) as url:
        assert (await http_get(url + "/ready")).json() == {"ready": True}
        assert source.start_calls == []
        assert not service.owning.is_set()
        assert lifecycle.state is NodeState.DELAYED
        await asyncio.wait_for(source.wait_for_stream(), 10)  # after the delay
        assert service.owning.is_set()
        assert (await http_get(url + "/ready")).status == 200
        await eventually(lambda: lifecycle.state is NodeState.OWNER, "the owner state")
        assert lifecycle.takeover_cause == "the start-up delay"


async def _upgrade(url: str, path: str) -> None:
    """Opens the websocket and reads what the server sends first (or its close)."""
    async with connect(url.replace("http://", "ws://") + path, open_timeout=10) as ws:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ws.recv(), 10)


async def test_only_an_accepted_serving_subscriber_ends_the_start_up_delay(
    tmp_path: Path,
) -> None:
    # Anyone who reaches the port can upgrade: a wrong replica version, a backup-mode
    # subscriber or a reservation must not make this node take the log over early.
    db, source, service = await new_service(tmp_path, task_id="t", backup_url="file:///b/r")
    service.backups.set_coverage_target(REPLICA_VERSION)
    service.backups.track(REPLICA_VERSION)
    lifecycle = NodeLifecycle(startup_delay_s=3600)
    app = create_app(db, service, lifecycle=lifecycle)
    query = "?id=x&replicaVersion={v}&watermark=01&mode={m}"
    async with serve(app) as url:
        await eventually(lambda: lifecycle.state is NodeState.DELAYED, "the delay")
        await _upgrade(url, "/replication/v6/changes" + query.format(v="00", m="serving"))
        await _upgrade(url, "/replication/v6/changes" + query.format(v="02", m="serving"))
        await _upgrade(url, "/replication/v6/changes" + query.format(v="01", m="backup"))
        await _upgrade(url, "/replication/v6/snapshot?taskID=restorer")
        assert not service.serving_started.is_set()
        assert lifecycle.state is NodeState.DELAYED
        assert source.start_calls == []
        accepted = asyncio.create_task(
            _upgrade(url, "/replication/v6/changes" + query.format(v="01", m="serving"))
        )
        await asyncio.wait_for(source.wait_for_stream(), 10)
        await eventually(lambda: lifecycle.state is NodeState.OWNER, "the takeover")
        assert lifecycle.takeover_cause == "a serving subscriber"
        accepted.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await accepted


async def test_with_backups_the_takeover_and_ready_wait_for_a_covering_backup(
    tmp_path: Path,
) -> None:
    db, source, service = await new_service(tmp_path, task_id="t", backup_url="file:///backups/r")
    lifecycle = NodeLifecycle(startup_delay_s=0)
    app = create_app(db, service, lifecycle=lifecycle)
    async with serve(app) as url:
        reply = await http_get(url + "/ready")
        assert reply.status == 503
        assert reply.json() == {
            "ready": False,
            "reason": "following: the backup monitor is reading the replica's position",
        }
        service.backups.track(REPLICA_VERSION)  # no target yet: the gate stays shut
        assert (await http_get(url + "/ready")).status == 503
        service.backups.set_coverage_target("02")  # what the monitor read of the replica
        await eventually(lambda: lifecycle.state is NodeState.GATED, "the gate")
        assert (await http_get(url + "/ready")).json() == {
            "ready": False,
            "reason": "gated: waiting for a backup that covers the replica at 02",
        }
        assert source.start_calls == []  # the gate holds the takeover too
        assert not service.owning.is_set()
        service.backups.track("01")  # older than the replica: still closed
        assert (await http_get(url + "/ready")).status == 503
        service.backups.track("02")
        await asyncio.wait_for(source.wait_for_stream(), 10)
        assert service.owning.is_set()
        assert (await http_get(url + "/ready")).status == 200


async def test_when_the_replica_cannot_be_read_the_first_backup_opens_the_gate(
    tmp_path: Path,
) -> None:
    db, source, service = await new_service(tmp_path, task_id="t", backup_url="file:///backups/r")
    service.backups.set_coverage_target(None)  # what the monitor says then
    app = create_app(db, service)
    async with serve(app) as url:
        assert (await http_get(url + "/ready")).json() == {
            "ready": False,
            "reason": "gated: waiting for the first backup of the replica",
        }
        service.backups.track("00")
        await asyncio.wait_for(source.wait_for_stream(), 10)
        assert (await http_get(url + "/ready")).status == 200


async def test_a_node_whose_log_is_taken_over_retires_and_stays_up(tmp_path: Path) -> None:
    db, source, service = await new_service(tmp_path, task_id="old")
    exited = asyncio.Event()
    retired: list[OwnershipLostError] = []
    children_ended = asyncio.Event()

    async def follower_closed() -> None:  # a child that ends with the service
        await service.stopped.wait()
        children_ended.set()

    lifecycle = NodeLifecycle(startup_delay_s=0, on_exit=exited.set, on_retired=retired.append)
    lifecycle.attach(service, children=(follower_closed,))
    auth = AdminAuth("secret", None, development=False)
    app = create_app(db, service, lifecycle=lifecycle, auth=auth)
    async with serve(app) as url:
        stream = await asyncio.wait_for(source.wait_for_stream(), 10)
        # Another node takes the change log over; this one notices at its next write.
        await Replication(db).assume_ownership("new", "127.0.0.1:9")
        stream.push(["begin", {"tag": "begin"}, {"commitWatermark": "02"}])
        stream.push(["commit", {"tag": "commit"}, {"watermark": "02"}])
        await eventually(lambda: bool(retired), "the node to retire")
        assert lifecycle.state is NodeState.RETIRED
        assert children_ended.is_set()  # before it said it retired
        reply = await http_get(url + "/ready")
        assert reply.status == 503
        # The state, not the new owner's address: that is for /statz, behind a password.
        assert reply.json() == {
            "ready": False,
            "reason": "retired: another node owns the change log",
        }
        assert retired[0].owner == "new"
        statz = url + "/statz?group=node&format=json"
        node = (await http_get(statz, {"Authorization": basic("secret")})).json()
        assert node["node"]["state"] == "retired"
        assert (node["node"]["owner"], node["node"]["ownerAddress"]) == ("new", "127.0.0.1:9")
        states = [t["state"] for t in node["node"]["transitions"]]
        assert states == ["restoring", "following", "delayed", "owner", "retiring", "retired"]
        assert (await http_get(url + "/")).status == 200  # alive: nothing restarts it
        assert not exited.is_set()  # the server was not told to stop
        # A subscriber that still comes here is refused before the upgrade, and tries
        # again (in discover mode: at the new owner).
        ws = url.replace("http://", "ws://")
        query = "?id=s&taskID=t&mode=serving&replicaVersion=01&watermark=01"
        for path in ("/replication/v6/changes" + query, "/replication/v6/snapshot?taskID=t"):
            with pytest.raises(InvalidStatus) as refused:
                async with connect(ws + path, open_timeout=10):
                    pass
            assert refused.value.response.status_code == 503
        assert not service.running
        # Nothing of the commit after the takeover was stored by the old owner.
        assert await Replication(db).last_watermark_from_log() == REPLICA_VERSION


async def test_a_node_that_starts_retired_answers_probes_and_serves_nothing(
    tmp_path: Path,
) -> None:
    db, _source, _service = await new_service(tmp_path, task_id="t")
    app = create_app(db, lifecycle=NodeLifecycle.retired_at_start("b", "127.0.0.1:9"))
    async with serve(app) as url:
        assert (await http_get(url + "/")).status == 200
        reply = await http_get(url + "/ready")
        assert reply.status == 503
        assert reply.json() == {
            "ready": False,
            "reason": "retired: another node owns the change log",
        }
        changes = await http_get(url + "/replication/v6/changes?id=x&taskID=t&mode=serving")
        assert changes.status == 404


async def test_no_route_list_is_served_without_a_password(tmp_path: Path) -> None:
    db, _source, service = await new_service(tmp_path, task_id="t")
    app = create_app(db, service, lifecycle=NodeLifecycle(startup_delay_s=3600))
    async with serve(app) as url:
        statuses = [(await http_get(url + path)).status for path in ("/openapi.json", "/docs")]
    assert statuses == [404, 404]
