"""The replication socket: one psycopg connection in COPY_BOTH mode, as frames.

psycopg 3 has no replication API, but since 3.3 ``START_REPLICATION`` on a
``replication="database"`` connection leaves the connection in COPY_BOTH and the
libpq wrapper (``conn.pgconn``) reads and writes CopyData frames
(spec/source.md §5.8). This module hides that behind two calls, ``read_frame`` and
``send_frame``, so the rest of the source never sees the driver and another one
(psycopg2's ``LogicalReplicationConnection``) could be swapped in.

Reading is non-blocking: ``get_copy_data(1)`` hands out frames libpq has buffered;
when there is none we wait for the socket to become readable (``loop.add_reader``),
let libpq ``consume_input`` and try again. Writing is ``put_copy_data`` + ``flush``
with a wait for writability when the kernel buffer is full. Every wait is bounded.

When the server ends the stream (``pg_terminate_backend``, shutdown, an error) the
next read raises :class:`ReplicationStreamEnded` carrying the SQLSTATE of the final
result, e.g. ``57P01`` (admin shutdown: another process took the slot over).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final, Self

import psycopg
from psycopg import pq
from psycopg import sql as pgsql

from app.sources.base import ChangeSourceError
from app.sources.postgres.pgoutput import format_lsn

__all__ = ["ReplicationConnection", "ReplicationStreamEnded", "StartReplicationError"]

CONNECT_TIMEOUT_S: Final = 30.0
SEND_TIMEOUT_S: Final = 30.0


class ReplicationStreamEnded(ChangeSourceError):
    """The server ended the COPY stream; ``sqlstate`` says why (None: a clean end)."""

    def __init__(self, sqlstate: str | None, message: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class StartReplicationError(ChangeSourceError):
    """START_REPLICATION failed (slot missing 42704, in use 55006, invalidated 55000...)."""

    def __init__(self, sqlstate: str | None, message: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class ReplicationConnection:
    """A ``replication=database`` connection that streams CopyData frames."""

    def __init__(self, conn: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
        self._conn = conn
        self._pg = conn.pgconn
        self._streaming = False
        self._closed = False
        # Pending socket waits (a reader and a writer), so close() can end them at
        # once: closing the socket does not wake a selector waiting on it.
        self._waiters: set[asyncio.Future[None]] = set()

    @classmethod
    async def connect(cls, conninfo: str, *, timeout_s: float = CONNECT_TIMEOUT_S) -> Self:
        conn = await asyncio.wait_for(
            psycopg.AsyncConnection.connect(conninfo, autocommit=True, replication="database"),
            timeout_s,
        )
        return cls(conn)

    @property
    def backend_pid(self) -> int:
        return self._pg.backend_pid

    async def start_replication(
        self, slot: str, start_lsn: int, publications: Sequence[str]
    ) -> None:
        """Enters COPY_BOTH; frames follow. pgoutput proto 1 with logical messages."""
        # The replication grammar takes single-quoted option values; publication
        # names are validated identifiers, but quote them anyway.
        names = ",".join(publications).replace("'", "''")
        query = pgsql.SQL(
            "START_REPLICATION SLOT {} LOGICAL {} "
            "(proto_version '1', publication_names '{}', messages 'true')"
        ).format(pgsql.Identifier(slot), pgsql.SQL(format_lsn(start_lsn)), pgsql.SQL(names))
        try:
            cur = await self._conn.execute(query)
        except psycopg.Error as e:
            raise StartReplicationError(e.sqlstate, str(e).strip()) from e
        result = cur.pgresult
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            status = None if result is None else result.status
            raise StartReplicationError(None, f"START_REPLICATION did not stream (status {status})")
        self._streaming = True

    @property
    def closed(self) -> bool:
        return self._closed

    async def read_frame(self, timeout_s: float) -> memoryview | None:
        """The next frame, or None when nothing arrived within ``timeout_s``: a view
        of the copy libpq made of it (not copied again; it is freed with the view)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if self._closed:
                raise ReplicationStreamEnded(None, "the replication connection was closed")
            n, data = self._pg.get_copy_data(1)
            if n > 0:
                return data
            if n < 0:
                raise self._ended()
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return None
            if not await self._wait_io(readable=True, timeout_s=remaining):
                if self.closed:  # (an attribute read here, after the await)
                    return None
                # Nothing woke us: read what the socket holds anyway, so a missed
                # wake-up costs one poll interval, not the stream.
                try:
                    self._pg.consume_input()
                except psycopg.Error as e:
                    raise ReplicationStreamEnded(None, f"replication connection lost: {e}") from e
                n, data = self._pg.get_copy_data(1)
                if n > 0:
                    return data
                if n < 0:
                    raise self._ended()
                return None
            try:
                self._pg.consume_input()
            except psycopg.Error as e:
                raise ReplicationStreamEnded(None, f"replication connection lost: {e}") from e

    async def send_frame(self, frame: bytes, *, timeout_s: float = SEND_TIMEOUT_S) -> None:
        """Writes one CopyData frame (a standby status update) and flushes it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self._closed:
            raise ReplicationStreamEnded(None, "the replication connection was closed")
        try:
            while self._pg.put_copy_data(frame) == 0:
                if not await self._wait_io(readable=False, timeout_s=deadline - loop.time()):
                    raise ReplicationStreamEnded(None, "replication connection: send timed out")
            while self._pg.flush() == 1:
                if not await self._wait_io(readable=False, timeout_s=deadline - loop.time()):
                    raise ReplicationStreamEnded(None, "replication connection: flush timed out")
        except psycopg.Error as e:
            raise ReplicationStreamEnded(None, f"replication connection lost: {e}") from e

    async def close(self) -> None:
        self._streaming = False
        self._closed = True
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        if not self._conn.closed:
            # Unregister the socket from the loop *before* it is closed: a waiter
            # woken above would only unregister it after the close, and the loop
            # (uvloop) must not be left watching a closed descriptor whose number
            # the next connection may get.
            loop = asyncio.get_running_loop()
            fd = self._pg.socket
            loop.remove_reader(fd)
            loop.remove_writer(fd)
            # close() on a COPY_BOTH connection just drops the socket; the server
            # ends the walsender, which releases the slot.
            await self._conn.close()

    def _ended(self) -> ReplicationStreamEnded:
        self._streaming = False
        result = self._pg.get_result()
        if result is None or result.status == pq.ExecStatus.COMMAND_OK:
            return ReplicationStreamEnded(None, "the server ended the replication stream")
        sqlstate = result.error_field(pq.DiagnosticField.SQLSTATE)
        message = result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY)
        return ReplicationStreamEnded(
            sqlstate.decode() if sqlstate else None,
            (message or b"replication stream failed").decode(errors="replace"),
        )

    async def _wait_io(self, *, readable: bool, timeout_s: float) -> bool:
        if timeout_s <= 0:
            return False
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.add(fut)

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        fd = self._pg.socket
        if readable:
            loop.add_reader(fd, ready)
        else:
            loop.add_writer(fd, ready)
        try:
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that comes
            # while ``fut`` has just completed (the socket became readable as the
            # service closed the pump after a failed stream). The pump then read on
            # into a full buffer that nothing would take, and the service waited on
            # it forever: the disk_full fault's stall (docs/reliability.md).
            async with asyncio.timeout(timeout_s):
                await fut
            return not self._closed
        except TimeoutError:
            return False
        finally:
            self._waiters.discard(fut)
            if not self._closed:  # close() unregistered it already
                if readable:
                    loop.remove_reader(fd)
                else:
                    loop.remove_writer(fd)
