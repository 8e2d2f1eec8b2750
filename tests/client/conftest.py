"""Fixtures for the client tests: the real server on loopback, and raw stub servers.

The real server comes from tests/server/conftest.py (uvicorn + the app + a
MemoryChangeSource). Stub websocket servers are used only where the real one
cannot be made to misbehave (silence, pings without messages, garbage frames,
replaying an already-sent transaction) and record what the client sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from app.client import ChangeStreamerClient
from tests.server.conftest import REPLICA_VERSION, Server, free_port, start_server

__all__ = [
    "REPLICA_VERSION",
    "Server",
    "StubServer",
    "free_port",
    "start_server",
    "stub_server",
    "txn",
    "wait_until",
]

TIMEOUT = 10


def txn(w: str, n: int = 1, table: str = "issues") -> list[list[Any]]:
    """A transaction of ``n`` inserts committed at watermark ``w``."""
    rows = [
        [
            "data",
            {
                "tag": "insert",
                "relation": {"schema": "public", "name": table, "rowKey": {"columns": ["id"]}},
                "new": {"id": f"{w}-{i}", "title": f"t{i}"},
            },
        ]
        for i in range(n)
    ]
    return [
        ["begin", {"tag": "begin"}, {"commitWatermark": w}],
        *rows,
        ["commit", {"tag": "commit"}, {"watermark": w}],
    ]


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Polls ``predicate`` (every 10 ms, up to 10 s); fails with ``what`` otherwise."""
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    async for s in start_server(tmp_path):
        yield s


@pytest.fixture
async def backup_server(tmp_path: Path) -> AsyncIterator[Server]:
    async for s in start_server(tmp_path, backup_url="file:///backups/r"):
        yield s


@pytest.fixture
def client(server: Server) -> ChangeStreamerClient:
    return ChangeStreamerClient(server.url)


Handler = Callable[[ServerConnection, "StubServer"], Awaitable[None]]


@dataclass
class StubServer:
    """A raw websocket server; ``paths`` and ``received`` record every connection."""

    url: str
    paths: list[str] = field(default_factory=list)
    received: list[list[str | bytes]] = field(default_factory=list)


@asynccontextmanager
async def stub_server(handler: Handler, **options: Any) -> AsyncIterator[StubServer]:
    """Serves ``handler`` on 127.0.0.1: ``async with stub_server(handler) as stub``."""
    port = free_port()
    stub = StubServer(f"ws://127.0.0.1:{port}")

    async def handle(ws: ServerConnection) -> None:
        stub.paths.append(ws.request.path if ws.request is not None else "")
        await handler(ws, stub)

    options.setdefault("ping_interval", None)
    async with serve(handle, "127.0.0.1", port, **options):
        yield stub
