"""The app owns the service: start-up delay, and the server stops with the streamer."""

from __future__ import annotations

import asyncio
from pathlib import Path

from app.server.app import create_app
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


async def test_the_stream_waits_for_the_startup_delay_without_subscribers(tmp_path: Path) -> None:
    db, source, service = await new_service(tmp_path, task_id="t")
    app = create_app(db, service, startup_delay_s=2.0)
    async with serve(app) as url:
        assert (await http_get(url + "/ready")).status == 503
        assert source.start_calls == []
        await asyncio.wait_for(source.wait_for_stream(), 10)  # after the delay

        async def ready() -> bool:
            return (await http_get(url + "/ready")).status == 200

        await eventually(ready, "/ready to answer 200", 5, poll_s=0.05)
        assert (await http_get(url + "/ready")).status == 200


async def test_with_backups_ready_waits_for_a_covering_backup(tmp_path: Path) -> None:
    db, source, service = await new_service(tmp_path, task_id="t", backup_url="file:///backups/r")
    app = create_app(db, service, startup_delay_s=0)
    async with serve(app) as url:
        await asyncio.wait_for(source.wait_for_stream(), 10)
        reply = await http_get(url + "/ready")
        assert reply.status == 503
        assert reply.json() == {
            "ready": False,
            "reason": "waiting for a backup that covers the replica at 01",
        }
        service.backups.track(REPLICA_VERSION)
        assert (await http_get(url + "/ready")).status == 200


async def test_no_route_list_is_served_without_a_password(tmp_path: Path) -> None:
    db, _source, service = await new_service(tmp_path, task_id="t")
    app = create_app(db, service, startup_delay_s=3600)
    async with serve(app) as url:
        statuses = [(await http_get(url + path)).status for path in ("/openapi.json", "/docs")]
    assert statuses == [404, 404]
