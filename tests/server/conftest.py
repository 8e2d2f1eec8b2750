"""A real server on loopback: uvicorn + the app + the service over a SQLite log."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from app.runtime.lifecycle import NodeLifecycle
from app.server.admin_auth import AdminAuth
from app.server.app import create_app
from app.server.http_protocol import GuardedHttpProtocol
from app.server.transport import MAX_CLIENT_FRAME_BYTES
from app.server.ws_protocol import LivenessProtocol
from app.storage import (
    ChangeDb,
    Shard,
    create_change_db,
    parse_change_db_url,
)
from app.streamer.service import ChangeStreamerService, StreamerOptions
from tests.change_dbs import migrated
from tests.memory_source import MemoryChangeSource
from tests.waiting import eventually

REPLICA_VERSION = "01"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    source: MemoryChangeSource
    service: ChangeStreamerService
    http: uvicorn.Server

    def connections(self) -> int:
        """Open client connections (a websocket's ends when its socket is closed)."""
        return len(self.http.server_state.connections)


async def new_service(
    tmp_path: Path, *, task_id: str = "server-test", **options: Any
) -> tuple[ChangeDb, MemoryChangeSource, ChangeStreamerService]:
    """A service over a fresh, migrated SQLite log at the replica version, fed by a
    scripted source (quick reconnects)."""
    db = create_change_db(parse_change_db_url(str(tmp_path / "cdc.db")), Shard())
    await migrated(db, replica_version=REPLICA_VERSION)
    source = MemoryChangeSource()
    service = ChangeStreamerService(
        db=db,
        source=source,
        task_id=task_id,
        address=None,
        replica_version=REPLICA_VERSION,
        durable_watermark=REPLICA_VERSION,
        options=StreamerOptions(backoff_initial_s=0.01, backoff_max_s=0.05, **options),
    )
    return db, source, service


async def start_server(
    tmp_path: Path,
    *,
    max_pending: int = 256,
    handshake_timeout_s: float = 10.0,
    handshakes_per_s: float = 50.0,
    auth: AdminAuth | None = None,
    per_message_deflate: bool = False,
    startup_delay_s: float = 3600,
    **options: Any,
) -> AsyncGenerator[Server, None]:
    """The service behind uvicorn with the protocols (and their bounds) `serve` uses
    (``per_message_deflate``: uvicorn's option, off in `serve`)."""
    db, source, service = await new_service(tmp_path, task_id="server-test", **options)
    port = free_port()
    http = GuardedHttpProtocol.with_limits(max_pending, handshake_timeout_s, handshakes_per_s)
    app = create_app(
        db,
        service,
        lifecycle=NodeLifecycle(startup_delay_s=startup_delay_s),
        connection_limits=http.limits,
        auth=auth,
    )
    # The websocket protocol `changestreamer serve` uses.
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        ws_per_message_deflate=per_message_deflate,
        ws_max_size=MAX_CLIENT_FRAME_BYTES,  # as serve has it
        ws=LivenessProtocol.with_queue_limit(64 * 1024),
        http=http,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started, "uvicorn to start", 20)
    try:
        yield Server(f"ws://127.0.0.1:{port}", source, service, server)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    async for s in start_server(tmp_path):
        yield s
