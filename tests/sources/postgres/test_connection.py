"""The replication socket's wait: a cancel is never lost (Python 3.11's wait_for)."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

from app.sources.postgres.connection import ReplicationConnection


def waiting_on(sock: socket.socket) -> ReplicationConnection:
    """A ReplicationConnection reduced to what ``_wait_io`` uses: the socket's fd."""
    conn = ReplicationConnection.__new__(ReplicationConnection)
    conn._pg = SimpleNamespace(socket=sock.fileno())  # type: ignore[assignment]
    conn._closed = False
    conn._waiters = set()
    return conn


async def test_a_cancel_that_comes_as_the_socket_turns_readable_is_not_lost() -> None:
    # The pump is cancelled right when data arrives: the readiness callback and the
    # cancel land in the same turn of the loop. asyncio.wait_for on Python 3.11
    # returned the result then, and the cancelled pump read on into a full buffer.
    ours, peer = socket.socketpair()
    ours.setblocking(False)

    async def read_on() -> None:  # what the pump does: wait, read, wait again
        while True:
            if await conn._wait_io(readable=True, timeout_s=30):
                ours.recv(100)

    try:
        conn = waiting_on(ours)
        task = asyncio.create_task(read_on())
        for _ in range(100):
            if conn._waiters:
                break
            await asyncio.sleep(0)
        [fut] = conn._waiters
        fut.add_done_callback(lambda _f: task.cancel())  # right after readiness
        peer.send(b"x")
        done, _ = await asyncio.wait({task}, timeout=5)
        assert done == {task}, "the cancel was lost: the reader went on waiting"
        assert task.cancelled()
        assert not conn._waiters
    finally:
        task.cancel()
        ours.close()
        peer.close()


async def test_readable_and_timeout_still_answer() -> None:
    ours, peer = socket.socketpair()
    try:
        conn = waiting_on(ours)
        assert await conn._wait_io(readable=True, timeout_s=0.05) is False  # nothing came
        peer.send(b"x")
        assert await conn._wait_io(readable=True, timeout_s=5) is True
    finally:
        ours.close()
        peer.close()
