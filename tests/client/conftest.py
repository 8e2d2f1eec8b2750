"""Fixtures for the client tests: the real server on loopback, and raw stub servers.

The real server comes from tests/server/conftest.py (uvicorn + the app + a
MemoryChangeSource). Stub websocket servers are used only where the real one
cannot be made to misbehave (silence, pings without messages, garbage frames,
replaying an already-sent transaction) and record what the client sent.
``command``/``in_terminal`` run the ``changestreamer`` command itself, its stdout a
pipe or a pseudo-terminal.
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from app.client import ChangeStreamerClient
from tests.server.conftest import REPLICA_VERSION, Server, free_port, start_server
from tests.waiting import eventually

__all__ = [
    "REPLICA_VERSION",
    "Server",
    "StubServer",
    "command",
    "command_env",
    "free_port",
    "in_terminal",
    "start_server",
    "stub_server",
    "txn",
    "wait_until",
]

TIMEOUT = 10
CLI = [sys.executable, "-m", "app.cli"]
REPO = Path(__file__).resolve().parents[2]


def command_env() -> dict[str, str]:
    """The environment for the command: no ZERO_* settings, a colour terminal type."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERO_")}
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS", "LINES", "TTY_COMPATIBLE"):
        env.pop(name, None)
    env.update(PYTHONPATH=str(REPO), TERM="xterm-256color")
    return env


def command(*args: str) -> subprocess.CompletedProcess[str]:
    """``changestreamer ARGS`` with stdout and stderr pipes (blocking: run in a thread)."""
    return subprocess.run(
        [*CLI, *args], env=command_env(), capture_output=True, text=True, timeout=60
    )


def in_terminal(*args: str) -> tuple[int, str, str]:
    """``changestreamer ARGS`` with stdout a 120-column pseudo-terminal (blocking: run in a
    thread): its exit status, what it wrote to the terminal, and its stderr."""
    terminal, child_side = pty.openpty()
    fcntl.ioctl(child_side, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [*CLI, *args], env=command_env(), stdout=child_side, stderr=subprocess.PIPE
    )
    os.close(child_side)
    shown = bytearray()
    try:
        while True:
            try:
                data = os.read(terminal, 65536)
            except OSError:  # EIO: the child's side is closed, the command is done
                break
            if not data:
                break
            shown += data
    finally:
        os.close(terminal)
        _, err = proc.communicate(timeout=60)
    return proc.returncode, shown.decode(), err.decode()


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
    await eventually(predicate, what)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    async for s in start_server(tmp_path):
        yield s


@pytest.fixture
async def backup_server(tmp_path: Path) -> AsyncIterator[Server]:
    # No start-up delay: reservations are confirmed only by the change log's owner,
    # and a reservation does not end the delay.
    async for s in start_server(tmp_path, backup_url="file:///backups/r", startup_delay_s=0):
        s.service.backups.set_coverage_target("01")  # the replica's position at start
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
