"""The replication socket: a ``replication=database`` connection read by our own
asyncio code, its COPY_BOTH stream handed out as frames.

libpq would read a 100 MB message into its buffer and copy it out in two C calls
holding the GIL (~150 ms with the event loop stalled), and keep its buffer at the
largest message's size (decision 44). Here the socket's reads arrive in
``data_received`` (at most what one read returned, ~256 KiB) and
:class:`BackendMessages` cuts messages out of them without copying whole ones: a
message inside one read is a ``memoryview`` of it, a longer one the list of its
pieces (coalesced to at least 64 KiB, cut to at most :data:`CHUNK_BYTES`). A frame
is only joined when the caller asks for it whole; ``read_frame(pieces_over=N)``
hands a larger one out as :class:`FramePieces` instead.

Complete frames wait in a queue of bounded size: reading from the socket pauses
above 8 MiB of them and resumes once the reader took them down to 2 MiB (a frame
in progress is read whole, up to Postgres' 1 GB limit). Writing is
``transport.write`` with a wait for ``resume_writing`` when the transport's
buffer is over its limit. Every wait is bounded.

Connecting is ``conninfo``'s (the options) and ``pgwire``'s (TLS, authentication).
When the server ends the stream (``pg_terminate_backend``, shutdown, an error) the
next read raises
:class:`ReplicationStreamEnded` carrying the SQLSTATE of its ErrorResponse, e.g.
``57P01`` (admin shutdown: another process took the slot over).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Self, TypeAlias, cast, overload

from app.flow_gate import HighLowGate
from app.sources.base import ChangeSourceError
from app.sources.postgres import pgwire
from app.sources.postgres.conninfo import (
    CONNECT_TIMEOUT_S,
    ConnectError,
    ConnParams,
    Keepalives,
    parse_conninfo,
)
from app.sources.postgres.pgoutput import format_lsn

__all__ = [
    "CHUNK_BYTES",
    "BackendMessages",
    "FramePieces",
    "ReplicationConnection",
    "ReplicationStreamEnded",
    "StartReplicationError",
]

log = logging.getLogger(__name__)

SEND_TIMEOUT_S: Final = 30.0
START_TIMEOUT_S: Final = 30.0
# close() waits this long for the transport to report itself gone.
CLOSE_WAIT_S: Final = 2.0

# A frame handed out in pieces is cut into chunks of at most this many bytes; all
# but its last hold at least _MIN_CHUNK_BYTES (so the frame's headers are in the first).
CHUNK_BYTES: Final = 1 << 20
_MIN_CHUNK_BYTES: Final = 64 << 10
# Complete messages waiting for the reader: the socket is not read above the high
# mark, and is read again at the low one.
_HIGH_WATER_BYTES: Final = 8 << 20
_LOW_WATER_BYTES: Final = 2 << 20
# At most this much is read in one turn of the event loop (see _ReadGate).
_READ_BYTES_PER_TURN: Final = 1 << 20
# Postgres builds a message in a buffer of at most 1 GB: a CopyData frame may be
# that long. An error or a notice carries at most a few KiB of text; any other
# message this connection reads (startup, authentication, parameters, the COPY
# start and end) is tiny: libpq takes such a message over 30,000 bytes for a sign
# that the stream is lost. A hostile server must not make us hold a gigabyte for one.
_MAX_MESSAGE_BYTES: Final = 1 << 30
_MAX_NOTICE_BYTES: Final = 1 << 20
_MAX_CONTROL_BYTES: Final = 30_000
_HEADER: Final = struct.Struct("!BI")

_COPY_DATA: Final = ord("d")
_ERROR: Final = ord("E")
_NOTICE: Final = ord("N")
_PARAMETER: Final = ord("S")
_COPY_BOTH: Final = ord("W")
_READY: Final = ord("Z")
_STREAM_END: Final = frozenset({ord("c"), ord("C"), _READY})

# A message's body: a view of the read that held all of it, or its pieces.
Payload: TypeAlias = memoryview | list[bytes]


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


@dataclass(frozen=True, slots=True)
class FramePieces:
    """A CopyData frame too large to hand out whole: its bytes in order, as read.

    Each chunk holds at most :data:`CHUNK_BYTES`, every one but the last at least
    64 KiB. ``len()`` is the frame's size, as for a whole frame."""

    chunks: tuple[bytes, ...]
    size: int

    def __len__(self) -> int:
        return self.size


class ProtocolViolation(Exception):
    """The server sent something that is not a protocol message."""


class BackendMessages:
    """Backend messages cut out of the byte stream as it arrives (sans-I/O).

    ``feed`` each read; ``pop`` the complete messages in order as (type, body, size).
    The work per ``feed`` is bounded by the read's size, whatever the messages'."""

    def __init__(self) -> None:
        self._queue: deque[tuple[int, Payload, int]] = deque()
        self.queued_bytes = 0
        self._head = b""  # a message header split between reads
        self._kind = -1  # the message in progress (-1: none)
        self._size = 0
        self._left = 0  # its bytes still to come
        self._chunks: list[bytes] = []
        self._pending: list[bytes] = []  # pieces not yet _MIN_CHUNK_BYTES together
        self._pending_bytes = 0

    def feed(self, data: bytes) -> bool:
        """Takes one read; True when it completed at least one message."""
        view = memoryview(data)
        n = len(data)
        pos = 0
        completed = False
        while pos < n:
            if self._kind < 0:
                if self._head or n - pos < _HEADER.size:
                    need = _HEADER.size - len(self._head)
                    self._head += data[pos : pos + need]
                    pos += need
                    if len(self._head) < _HEADER.size:
                        break
                    kind, length = _HEADER.unpack(self._head)
                    self._head = b""
                else:
                    kind, length = _HEADER.unpack_from(data, pos)
                    pos += _HEADER.size
                size = length - 4
                limit = _MAX_MESSAGE_BYTES if kind == _COPY_DATA else _max_size(kind)
                if not 0 <= size <= limit:  # (no call for the stream's own frames)
                    raise ProtocolViolation(f"invalid message length {length} (type {kind:#x})")
                if n - pos >= size:  # the whole message is in this read
                    self._push(kind, view[pos : pos + size], size)
                    pos += size
                    completed = True
                    continue
                self._kind, self._size, self._left = kind, size, size
            take = min(self._left, n - pos)
            self._add(data if take == n else bytes(view[pos : pos + take]))
            pos += take
            self._left -= take
            if self._left == 0:
                self._flush(last=True)
                chunks, self._chunks = self._chunks, []
                self._push(
                    self._kind, memoryview(chunks[0]) if len(chunks) == 1 else chunks, self._size
                )
                self._kind = -1
                completed = True
        return completed

    def pop(self) -> tuple[int, Payload, int] | None:
        if not self._queue:
            return None
        message = self._queue.popleft()
        self.queued_bytes -= message[2]
        return message

    def _push(self, kind: int, payload: Payload, size: int) -> None:
        self._queue.append((kind, payload, size))
        self.queued_bytes += size

    def _add(self, piece: bytes) -> None:
        self._pending.append(piece)
        self._pending_bytes += len(piece)
        if self._pending_bytes >= _MIN_CHUNK_BYTES:
            self._flush(last=False)

    def _flush(self, *, last: bool) -> None:
        pending = self._pending
        if not pending:
            return
        whole = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        self._pending_bytes = 0
        start = 0
        if len(whole) > CHUNK_BYTES:  # only a read larger than a chunk
            view = memoryview(whole)
            while len(whole) - start > CHUNK_BYTES:
                self._chunks.append(bytes(view[start : start + CHUNK_BYTES]))
                start += CHUNK_BYTES
            whole = bytes(view[start:])
        if last or len(whole) >= _MIN_CHUNK_BYTES:
            self._chunks.append(whole)
        else:
            self._pending.append(whole)
            self._pending_bytes = len(whole)


def _max_size(kind: int) -> int:
    if kind == _COPY_DATA:
        return _MAX_MESSAGE_BYTES
    return _MAX_NOTICE_BYTES if kind in (_ERROR, _NOTICE) else _MAX_CONTROL_BYTES


def _joined(payload: Payload) -> bytes:
    return payload.tobytes() if isinstance(payload, memoryview) else b"".join(payload)


class _ReadGate:
    """Whether the socket is read. Not while the complete messages waiting for the
    reader are over the high mark (until it took them down to the low one), and
    not for the rest of a turn of the loop after another ``_READ_BYTES_PER_TURN``
    came in: uvloop reads up to 32 times (8 MiB) in one turn, which for a frame
    in progress would be ~8 ms with nothing else running."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._full = HighLowGate(_HIGH_WATER_BYTES, _LOW_WATER_BYTES)
        self._turn_over = False
        self._turn_bytes = 0
        self._paused = False

    def on_read(self, size: int, queued_bytes: int) -> None:
        self._turn_bytes += size
        if self._turn_bytes >= _READ_BYTES_PER_TURN and not self._turn_over:
            self._turn_over = True
            asyncio.get_running_loop().call_soon(self._next_turn)
        self._full.rise(queued_bytes)
        self._apply()

    def on_taken(self, queued_bytes: int) -> None:
        if self._full.fall(queued_bytes):
            self._apply()

    def _next_turn(self) -> None:
        self._turn_over = False
        self._turn_bytes = 0
        self._apply()

    def _apply(self) -> None:
        paused = self._full.closed or self._turn_over
        transport = self.transport
        if paused == self._paused or transport is None or transport.is_closing():
            return
        self._paused = paused
        if paused:
            transport.pause_reading()
        else:
            transport.resume_reading()


class _Wire(asyncio.Protocol):
    """The socket's side: reads into :class:`BackendMessages` (paused above the high
    mark), writes, and wakes whoever waits for either."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.messages = BackendMessages()
        self.lost: str | None = None  # why the connection is gone, once it is
        self.waiters: set[asyncio.Future[None]] = set()
        self.write_paused = False
        self._gate = _ReadGate()
        self._gone = asyncio.Event()
        self._ssl_answer: asyncio.Future[bytes] | None = None

    # -- asyncio.Protocol -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.use(cast(asyncio.Transport, transport))  # uvloop's: not a subclass

    def data_received(self, data: bytes) -> None:
        if self._ssl_answer is not None:
            data = self._answer_ssl_request(self._ssl_answer, data)
        try:
            completed = self.messages.feed(data)
        except ProtocolViolation as e:
            self.lost = str(e)
            self.abort()
            return
        self._gate.on_read(len(data), self.messages.queued_bytes)
        if completed:
            self.wake()

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = "the server closed the connection" if exc is None else str(exc) or repr(exc)
        if self._ssl_answer is not None and not self._ssl_answer.done():
            self._ssl_answer.set_exception(ConnectionError(self.lost))
        self._gone.set()
        self.wake()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.wake()

    # -- for the connection ---------------------------------------------------

    def pop(self) -> tuple[int, Payload, int] | None:
        message = self.messages.pop()
        if message is not None:
            self._gate.on_taken(self.messages.queued_bytes)
        return message

    async def next_message(self) -> tuple[int, bytes]:
        """The next message whole (startup and commands; the caller bounds the wait)."""
        while True:
            message = self.pop()
            if message is not None:
                return message[0], _joined(message[1])
            if self.lost is not None:
                raise ConnectionError(self.lost)
            await self.wait(None)

    async def wait(self, timeout_s: float | None) -> bool:
        """Until a message, the loss of the connection, :meth:`wake` or ``timeout_s``
        (then False)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.add(fut)
        try:
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that comes
            # while ``fut`` has just completed (data arrived as the service closed
            # the pump after a failed stream). The pump then read on into a full
            # buffer that nothing would take, and the service waited on it forever:
            # the disk_full fault's stall (docs/reliability.md).
            async with asyncio.timeout(timeout_s):
                await fut
            return True
        except TimeoutError:
            return False
        finally:
            self.waiters.discard(fut)

    def wake(self) -> None:
        for fut in self.waiters:
            if not fut.done():
                fut.set_result(None)

    def write(self, data: bytes) -> None:
        transport = self._transport()
        if self.lost is not None or transport.is_closing():
            raise ConnectionError(self.lost or "the connection is closing")
        transport.write(data)

    async def ask_for_tls(self) -> bytes:
        """Sends SSLRequest; the server's one-byte answer (S or N)."""
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._ssl_answer = fut
        self.write(pgwire.SSL_REQUEST)
        return await fut

    def use(self, transport: asyncio.Transport) -> None:
        """Reads and writes through ``transport`` now (TLS over the first one)."""
        self.transport = self._gate.transport = transport

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self.wake()

    async def close(self) -> None:
        """Says goodbye (Terminate) when it can go at once, drops the connection and
        waits for the transport to report it gone."""
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if transport.get_write_buffer_size() == 0:
                transport.write(pgwire.TERMINATE)
            transport.abort()
        self.wake()
        if transport is not None:
            async with asyncio.timeout(CLOSE_WAIT_S):
                await self._gone.wait()

    def _answer_ssl_request(self, fut: asyncio.Future[bytes], data: bytes) -> bytes:
        self._ssl_answer = None
        answer, rest = data[:1], data[1:]
        if answer == b"S" and rest:
            # CVE-2021-23222: bytes injected before the handshake must not be read.
            if not fut.done():
                fut.set_exception(
                    ConnectError(None, "received unencrypted data after the SSL response")
                )
            return b""
        if not fut.done():
            fut.set_result(answer)
        return rest

    def _transport(self) -> asyncio.Transport:
        assert self.transport is not None
        return self.transport


class ReplicationConnection:
    """A ``replication=database`` connection that streams CopyData frames."""

    def __init__(self, wire: _Wire, backend_pid: int) -> None:
        self._wire = wire
        self._backend_pid = backend_pid
        self._closed = False
        self._ended: ReplicationStreamEnded | None = None
        self._interrupted = False

    @classmethod
    async def connect(cls, conninfo: str, *, timeout_s: float = CONNECT_TIMEOUT_S) -> Self:
        """Tries each host in turn (and for ``sslmode=allow``, plain then TLS), each
        attempt within ``connect_timeout`` (else ``timeout_s``): a host that takes
        the whole wait leaves the next one its own."""
        params = parse_conninfo(conninfo)
        per_attempt_s = params.connect_timeout_s or timeout_s
        failures: list[str] = []
        sqlstate: str | None = None
        for host, port in params.hosts:
            unix = host.startswith("/")
            where = (
                f'on socket "{os.path.join(host, f".s.PGSQL.{port}")}"'
                if unix
                else f'at "{host}", port {port}'
            )
            attempts = [False] if unix or params.sslmode == "disable" else [True]
            if params.sslmode == "allow" and not unix:
                attempts = [False, True]
            for tls in attempts:
                try:
                    async with asyncio.timeout(per_attempt_s):
                        wire, pid = await _open(params, host, port, tls=tls)
                    return cls(wire, pid)
                except TimeoutError:
                    reason = f"timeout expired after {per_attempt_s:g} s"
                    failures.append(f"connection to server {where} failed: {reason}")
                except (OSError, ConnectError) as e:
                    sqlstate = getattr(e, "sqlstate", None)
                    failures.append(f"connection to server {where} failed: {e or repr(e)}")
        raise ConnectError(sqlstate, "; ".join(failures))

    @property
    def backend_pid(self) -> int:
        return self._backend_pid

    async def start_replication(
        self, slot: str, start_lsn: int, publications: Sequence[str]
    ) -> None:
        """Enters COPY_BOTH; frames follow. pgoutput proto 1 with logical messages."""
        # The replication grammar takes single-quoted option values; publication
        # names are validated identifiers, but quote them anyway.
        names = ",".join(publications).replace("'", "''")
        slot_name = '"' + slot.replace('"', '""') + '"'
        query = (
            f"START_REPLICATION SLOT {slot_name} LOGICAL {format_lsn(start_lsn)} "
            f"(proto_version '1', publication_names '{names}', messages 'true')"
        )
        error: dict[str, str] | None = None
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                self._wire.write(pgwire.message(b"Q", query.encode() + b"\x00"))
                while True:
                    kind, body = await self._wire.next_message()
                    if kind == _COPY_BOTH and error is None:
                        return
                    if kind == _ERROR:
                        error = pgwire.error_fields(body)
                    elif kind == _READY:  # after an error: the connection can be used again
                        break
                    elif kind == _NOTICE:
                        log.info("Postgres: %s", pgwire.describe(pgwire.error_fields(body)))
        except TimeoutError:
            raise StartReplicationError(
                None, f"START_REPLICATION: no answer within {START_TIMEOUT_S:g} s"
            ) from None
        except ConnectionError as e:
            raise StartReplicationError(None, f"replication connection lost: {e}") from e
        if error is None:
            raise StartReplicationError(None, "START_REPLICATION did not stream")
        raise StartReplicationError(error.get("C"), error.get("M", "START_REPLICATION failed"))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def reading(self) -> bool:
        """Whether a read is waiting for the server (a test's condition too)."""
        return bool(self._wire.waiters)

    def has_frame(self) -> bool:
        """Whether a complete message is waiting to be read (the upstream is ahead of us)."""
        return bool(self._wire.messages.queued_bytes) or self._wire.lost is not None

    def interrupt(self) -> None:
        """Makes a ``read_frame`` waiting for data return None now, so its caller can
        do other work (interleave a backfill) without waiting out its timeout."""
        self._interrupted = True
        self._wire.wake()

    @overload
    async def read_frame(self, timeout_s: float) -> memoryview | None: ...

    @overload
    async def read_frame(
        self, timeout_s: float, *, pieces_over: int | None
    ) -> memoryview | FramePieces | None: ...

    async def read_frame(
        self, timeout_s: float, *, pieces_over: int | None = None
    ) -> memoryview | FramePieces | None:
        """The next frame, or None when nothing arrived within ``timeout_s``. A frame
        longer than ``pieces_over`` bytes comes as :class:`FramePieces`; any other
        whole (joined only if it arrived over several reads)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        wire = self._wire
        while True:
            if self._closed:
                raise ReplicationStreamEnded(None, "the replication connection was closed")
            if self._ended is not None:
                raise self._ended
            message = wire.pop()
            if message is not None:
                kind, payload, size = message
                if kind == _COPY_DATA:
                    return _frame(payload, size, pieces_over)
                self._ended = self._on_message(kind, payload)
                continue
            if wire.lost is not None:
                self._ended = ReplicationStreamEnded(
                    None, f"replication connection lost: {wire.lost}"
                )
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            await wire.wait(remaining)
            if self.closed:  # close() woke us (an attribute read here, after the await)
                return None
            if self._interrupted:
                self._interrupted = False
                return None

    async def send_frame(self, frame: bytes, *, timeout_s: float = SEND_TIMEOUT_S) -> None:
        """Writes one CopyData frame (a standby status update); waits while the
        transport's buffer is over its limit."""
        if self._closed:
            raise ReplicationStreamEnded(None, "the replication connection was closed")
        wire = self._wire
        try:
            wire.write(pgwire.message(b"d", frame))
        except ConnectionError as e:
            raise ReplicationStreamEnded(None, f"replication connection lost: {e}") from e
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while wire.write_paused:
            if self.closed:
                raise ReplicationStreamEnded(None, "the replication connection was closed")
            if wire.lost is not None:
                raise ReplicationStreamEnded(None, f"replication connection lost: {wire.lost}")
            remaining = deadline - loop.time()
            if remaining <= 0 or not await wire.wait(remaining):
                raise ReplicationStreamEnded(None, "replication connection: send timed out")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # close() on a COPY_BOTH connection just drops the socket; the server ends
        # the walsender, which releases the slot.
        try:
            await self._wire.close()
        except TimeoutError:
            log.warning("the replication socket did not report itself closed")

    def _on_message(self, kind: int, payload: Payload) -> ReplicationStreamEnded | None:
        """A message other than CopyData in the stream: the end of it, or None."""
        if kind == _ERROR:
            fields = pgwire.error_fields(_joined(payload))
            return ReplicationStreamEnded(
                fields.get("C"), fields.get("M", "replication stream failed")
            )
        if kind in _STREAM_END:
            return ReplicationStreamEnded(None, "the server ended the replication stream")
        if kind == _NOTICE:
            log.info("Postgres: %s", pgwire.describe(pgwire.error_fields(_joined(payload))))
        elif kind == _PARAMETER:
            log.debug("Postgres parameter: %r", _joined(payload))
        return None


def _frame(payload: Payload, size: int, pieces_over: int | None) -> memoryview | FramePieces:
    if pieces_over is None or size <= pieces_over:
        return payload if isinstance(payload, memoryview) else memoryview(b"".join(payload))
    if isinstance(payload, list):
        return FramePieces(tuple(payload), size)
    # One read held all of it: at most a read's size, cut into chunks.
    chunks = tuple(bytes(payload[i : i + CHUNK_BYTES]) for i in range(0, size, CHUNK_BYTES))
    return FramePieces(chunks, size)


async def _open(params: ConnParams, host: str, port: int, *, tls: bool) -> tuple[_Wire, int]:
    """One connection to one host, through startup: the wire and the backend's pid."""
    loop = asyncio.get_running_loop()
    wire = _Wire()
    if host.startswith("/"):
        await loop.create_unix_connection(lambda: wire, os.path.join(host, f".s.PGSQL.{port}"))
    else:
        await loop.create_connection(lambda: wire, host, port)
    try:
        session: pgwire.TlsSession | None = None
        if not host.startswith("/"):
            _set_keepalives(wire._transport(), params.keepalives)
        if tls:
            answer = await wire.ask_for_tls()
            if answer == b"S":
                context = pgwire.ssl_context(params)
                transport = await loop.start_tls(
                    wire._transport(), wire, context, server_hostname=host
                )
                assert transport is not None
                wire.use(transport)
                session = _session(transport, context)
            elif params.sslmode not in ("prefer", "allow"):
                raise ConnectError(None, "server does not support SSL, but SSL was required")
        startup = pgwire.Startup(params, host, port, tls=session)
        wire.write(startup.message())
        while not startup.ready:
            kind, body = await wire.next_message()
            answer = await startup.receive(kind, body)
            if answer:
                wire.write(answer)
        return wire, startup.backend_pid
    except BaseException:
        wire.abort()
        raise


def _session(transport: asyncio.Transport, context: ssl.SSLContext) -> pgwire.TlsSession:
    ssl_object = transport.get_extra_info("ssl_object")
    certificate = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    return pgwire.TlsSession(
        verified=context.verify_mode != ssl.CERT_NONE,
        end_point=pgwire.server_end_point(certificate) if certificate else None,
    )


def _set_keepalives(transport: asyncio.Transport, keepalives: Keepalives) -> None:
    """TCP keepalives as libpq sets them (on by default): a server that vanished
    without a FIN (a host gone, a NAT that forgot us) is noticed, not waited for."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, int(keepalives.enabled))
    options = [
        (getattr(socket, "TCP_KEEPIDLE", None), keepalives.idle_s),
        (getattr(socket, "TCP_KEEPINTVL", None), keepalives.interval_s),
        (getattr(socket, "TCP_KEEPCNT", None), keepalives.count),
    ]
    if keepalives.enabled:
        for option, value in options:
            if option is not None:  # Linux has all three; other systems may not
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if user_timeout is not None and keepalives.user_timeout_ms is not None:
        sock.setsockopt(socket.IPPROTO_TCP, user_timeout, max(keepalives.user_timeout_ms, 0))
