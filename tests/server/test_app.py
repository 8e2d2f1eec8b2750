"""The app owns the service: start-up delay, and the server stops with the streamer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from app.server.app import create_app
from app.storage import OwnershipLostError, Replication
from tests.waiting import eventually

from .conftest import REPLICA_VERSION, new_service
from .http import http_get, serve


async def test_the_server_is_told_to_stop_when_the_streamer_stops(tmp_path: Path) -> None:
    db, source, service = await new_service(tmp_path, task_id="t")
    exited = asyncio.Event()
    app = create_app(db, service, startup_delay_s=0, on_service_exit=exited.set)
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
        assert reply.json() == {"ready": False, "reason": "the change streamer is not running"}


async def test_the_stream_waits_for_the_startup_delay_and_is_ready_meanwhile(
    tmp_path: Path,
) -> None:
    # Ready before it takes the change log over, as zero is: the routing layer must
    # know this node by the time the old owner lets go.
    db, source, service = await new_service(tmp_path, task_id="t")
    app = create_app(db, service, startup_delay_s=2.0)
    async with serve(app) as url:
        assert (await http_get(url + "/ready")).json() == {"ready": True}
        assert source.start_calls == []
        assert not service.owning.is_set()
        await asyncio.wait_for(source.wait_for_stream(), 10)  # after the delay
        assert service.owning.is_set()
        assert (await http_get(url + "/ready")).status == 200


async def test_with_backups_the_takeover_and_ready_wait_for_a_covering_backup(
    tmp_path: Path,
) -> None:
    db, source, service = await new_service(tmp_path, task_id="t", backup_url="file:///backups/r")
    app = create_app(db, service, startup_delay_s=0)
    async with serve(app) as url:
        reply = await http_get(url + "/ready")
        assert reply.status == 503
        assert reply.json() == {
            "ready": False,
            "reason": "waiting for a backup that covers the replica at 01",
        }
        assert source.start_calls == []  # the gate holds the takeover too
        assert not service.owning.is_set()
        service.backups.track("00")  # older than the replica: still closed
        assert (await http_get(url + "/ready")).status == 503
        service.backups.track(REPLICA_VERSION)
        await asyncio.wait_for(source.wait_for_stream(), 10)
        assert service.owning.is_set()
        assert (await http_get(url + "/ready")).status == 200


async def test_when_the_replica_cannot_be_read_the_first_backup_opens_the_gate(
    tmp_path: Path,
) -> None:
    db, source, service = await new_service(tmp_path, task_id="t", backup_url="file:///backups/r")
    service.backups.set_coverage_target(None)  # what the monitor says then
    app = create_app(db, service, startup_delay_s=0)
    async with serve(app) as url:
        assert (await http_get(url + "/ready")).json() == {
            "ready": False,
            "reason": "waiting for the first backup of the replica",
        }
        service.backups.track("00")
        await asyncio.wait_for(source.wait_for_stream(), 10)
        assert (await http_get(url + "/ready")).status == 200


async def test_a_node_whose_log_is_taken_over_retires_and_stays_up(tmp_path: Path) -> None:
    db, source, service = await new_service(tmp_path, task_id="old")
    exited = asyncio.Event()
    retired: list[OwnershipLostError] = []
    app = create_app(
        db, service, startup_delay_s=0, on_service_exit=exited.set, on_retired=retired.append
    )
    async with serve(app) as url:
        stream = await asyncio.wait_for(source.wait_for_stream(), 10)
        # Another node takes the change log over; this one notices at its next write.
        await Replication(db).assume_ownership("new", "127.0.0.1:9")
        stream.push(["begin", {"tag": "begin"}, {"commitWatermark": "02"}])
        stream.push(["commit", {"tag": "commit"}, {"watermark": "02"}])
        await eventually(lambda: bool(retired), "the node to retire")
        reply = await http_get(url + "/ready")
        assert reply.status == 503
        assert reply.json() == {
            "ready": False,
            "reason": "retired: the change log is owned by new",
        }
        assert retired[0].owner == "new"
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
    app = create_app(db, retired="retired: the change log is owned by b")
    async with serve(app) as url:
        assert (await http_get(url + "/")).status == 200
        reply = await http_get(url + "/ready")
        assert reply.status == 503
        assert reply.json() == {"ready": False, "reason": "retired: the change log is owned by b"}
        changes = await http_get(url + "/replication/v6/changes?id=x&taskID=t&mode=serving")
        assert changes.status == 404


async def test_no_route_list_is_served_without_a_password(tmp_path: Path) -> None:
    db, _source, service = await new_service(tmp_path, task_id="t")
    app = create_app(db, service, startup_delay_s=3600)
    async with serve(app) as url:
        statuses = [(await http_get(url + path)).status for path in ("/openapi.json", "/docs")]
    assert statuses == [404, 404]
