"""The replication socket: our own reader of the COPY_BOTH stream.

Most tests stream from the real server (a scratch database with one published
table and a pgoutput slot each); the reader's byte handling and flow control are
also checked on their own (sans-I/O, or over a socket pair), where a test must
choose how the bytes arrive.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from app.sources.postgres import connection as connection_module
from app.sources.postgres.connection import (
    CHUNK_BYTES,
    BackendMessages,
    FramePieces,
    ProtocolViolation,
    ReplicationConnection,
    ReplicationStreamEnded,
    StartReplicationError,
)
from app.sources.postgres.conninfo import ConnectError
from app.sources.postgres.pgoutput import (
    Begin,
    Commit,
    Insert,
    PgOutputMessage,
    Relation,
    XLogData,
    decode_message,
    parse_copy_data,
    parse_lsn,
    standby_status_update,
)
from tests import waiting
from tests.sources.postgres.tls_certs import make_certs

MIN_CHUNK_BYTES = 64 << 10


# -- the reader's bytes (sans-I/O) ----------------------------------------------------


def backend_message(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("!I", len(body) + 4) + body


def fed(reads: list[bytes]) -> list[tuple[int, bytes, int]]:
    reader = BackendMessages()
    for data in reads:
        reader.feed(data)
    out = []
    while (m := reader.pop()) is not None:
        kind, payload, size = m
        body = payload.tobytes() if isinstance(payload, memoryview) else b"".join(payload)
        out.append((kind, body, size))
    assert reader.queued_bytes == 0
    return out


def test_messages_come_out_whole_however_the_reads_cut_them() -> None:
    stream = (
        backend_message(b"d", b"w" + bytes(range(200)))
        + backend_message(b"N", b"Mhello\x00\x00")
        + backend_message(b"d", b"")
        + backend_message(b"d", b"k" * 70_000)
    )
    expected = [
        (ord("d"), b"w" + bytes(range(200)), 201),
        (ord("N"), b"Mhello\x00\x00", 8),
        (ord("d"), b"", 0),
        (ord("d"), b"k" * 70_000, 70_000),
    ]
    assert fed([stream]) == expected
    assert fed([stream[i : i + 1] for i in range(len(stream))]) == expected
    for cut in (1, 3, 5, 6, 210, 230, 1000):
        assert fed([stream[:cut], stream[cut:]]) == expected


def test_a_large_message_is_kept_as_the_reads_it_came_in() -> None:
    body = os.urandom(3 << 20)
    stream = backend_message(b"w", b"") + backend_message(b"d", body) + backend_message(b"d", b"k")
    reads = [stream[i : i + (256 << 10)] for i in range(0, len(stream), 256 << 10)]
    reader = BackendMessages()
    for data in reads:
        reader.feed(data)
    reader.pop()
    m = reader.pop()
    assert m is not None
    kind, payload, size = m
    assert (kind, size) == (ord("d"), len(body))
    assert isinstance(payload, list)
    assert b"".join(payload) == body
    # The reads that lay wholly inside it are its chunks, not copies of them.
    assert sum(any(chunk is data for data in reads) for chunk in payload) == len(reads) - 2
    assert reader.pop() is not None


def test_small_reads_are_gathered_into_chunks_of_at_least_64_kib() -> None:
    body = os.urandom(1 << 20)
    stream = backend_message(b"d", body)
    reader = BackendMessages()
    for i in range(0, len(stream), 1000):  # a slow network: 1,000 bytes a read
        reader.feed(stream[i : i + 1000])
    m = reader.pop()
    assert m is not None
    assert isinstance(m[1], list)
    assert b"".join(m[1]) == body
    assert all(MIN_CHUNK_BYTES <= len(c) <= CHUNK_BYTES for c in m[1][:-1])


def test_a_read_larger_than_a_chunk_is_cut() -> None:
    body = os.urandom(3 * CHUNK_BYTES + 5)
    stream = backend_message(b"d", body)
    reader = BackendMessages()
    reader.feed(stream[:100])
    reader.feed(stream[100:])  # one 3 MiB read, as TLS could hand over
    m = reader.pop()
    assert m is not None
    assert isinstance(m[1], list)
    assert b"".join(m[1]) == body
    assert [len(c) for c in m[1]][:3] == [CHUNK_BYTES] * 3


def test_a_length_no_message_can_have_is_a_protocol_violation() -> None:
    with pytest.raises(ProtocolViolation, match="invalid message length 2"):
        BackendMessages().feed(b"d\x00\x00\x00\x02")
    with pytest.raises(ProtocolViolation, match="invalid message length"):
        BackendMessages().feed(b"d\x7f\xff\xff\xff")


# -- flow control -----------------------------------------------------------------


class RecordingTransport(asyncio.Transport):
    """A transport that only records whether it is read."""

    def __init__(self) -> None:
        super().__init__()
        self._reading = True
        self.aborted = False

    def is_reading(self) -> bool:
        return self._reading

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        self._reading = True

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True


def wire_on(transport: asyncio.Transport) -> connection_module._Wire:
    wire = connection_module._Wire()
    wire.connection_made(transport)
    return wire


async def test_the_socket_is_not_read_while_8_mib_of_frames_wait() -> None:
    transport = RecordingTransport()
    wire = wire_on(transport)
    frame = backend_message(b"d", b"w" * 100_000)
    taken = 0
    for _ in range(84):  # 8.4 MB: over the high mark
        wire.data_received(frame)
        await asyncio.sleep(0)  # a turn of the loop per read, as a socket gives them
    assert not transport.is_reading()
    while wire.messages.queued_bytes > 2 << 20:
        assert wire.pop() is not None
        taken += 1
        assert not transport.is_reading() or wire.messages.queued_bytes <= 2 << 20
    assert transport.is_reading()
    assert taken == 84 - 20


async def test_a_frame_in_progress_is_read_on_but_not_all_in_one_turn_of_the_loop() -> None:
    transport = RecordingTransport()
    wire = wire_on(transport)
    stream = backend_message(b"d", bytes(20 << 20))  # 20 MiB: over the high mark
    reads = [stream[i : i + (256 << 10)] for i in range(0, len(stream), 256 << 10)]
    paused_turns = 0
    for data in reads:
        if not transport.is_reading():
            paused_turns += 1
            await asyncio.sleep(0)  # the next turn reads again
            assert transport.is_reading()
        wire.data_received(data)
    # About one pause a MiB (uvloop would read 8 MiB in a turn), never one for good.
    assert paused_turns >= 15
    assert wire.pop() is not None


# -- waiting ----------------------------------------------------------------------


@asynccontextmanager
async def socket_pair_connection() -> AsyncIterator[tuple[ReplicationConnection, socket.socket]]:
    """A connection over one end of a socket pair; the test writes the other."""
    ours, peer = socket.socketpair()
    wire = connection_module._Wire()
    await asyncio.get_running_loop().create_connection(lambda: wire, sock=ours)
    conn = ReplicationConnection(wire, backend_pid=0)
    try:
        yield conn, peer
    finally:
        await conn.close()
        peer.close()


async def test_a_cancel_that_comes_as_a_frame_arrives_is_not_lost() -> None:
    # The pump is cancelled right when data arrives: the wake-up and the cancel land
    # in the same turn of the loop. asyncio.wait_for on Python 3.11 returned the
    # result then, and the cancelled pump read on into a full buffer.
    async with socket_pair_connection() as (conn, peer):
        wire = conn._wire  # white box: the race is between its waiter and a cancel

        async def read_on() -> None:  # what the pump does
            while True:
                await conn.read_frame(30)

        task = asyncio.create_task(read_on())
        try:
            await waiting.eventually(lambda: conn.reading, "the pump waits for the server")
            [fut] = wire.waiters
            fut.add_done_callback(lambda _f: task.cancel())  # right after the wake-up
            peer.send(backend_message(b"d", b"k" * 18))
            done, _ = await asyncio.wait({task}, timeout=5)
            assert done == {task}, "the cancel was lost: the reader went on waiting"
            assert task.cancelled()
            assert not wire.waiters
        finally:
            task.cancel()


async def test_a_read_times_out_with_none_and_then_returns_what_came() -> None:
    async with socket_pair_connection() as (conn, peer):
        assert await conn.read_frame(0.05) is None
        peer.send(backend_message(b"d", b"k123"))
        frame = await conn.read_frame(5)
        assert isinstance(frame, memoryview)
        assert frame.tobytes() == b"k123"


async def test_closing_wakes_a_waiting_read_at_once() -> None:
    async with socket_pair_connection() as (conn, _peer):
        reading = asyncio.create_task(conn.read_frame(30))
        await waiting.eventually(lambda: conn.reading, "the read waits for the server")
        started = time.monotonic()
        await conn.close()
        assert await asyncio.wait_for(reading, 5) is None
        assert time.monotonic() - started < 2
        assert conn.closed
        with pytest.raises(ReplicationStreamEnded, match="was closed"):
            await conn.read_frame(1)
        with pytest.raises(ReplicationStreamEnded, match="was closed"):
            await conn.send_frame(b"r")
        await conn.close()  # again: nothing happens


async def test_losing_the_connection_ends_the_stream_after_what_came_before() -> None:
    async with socket_pair_connection() as (conn, peer):
        peer.send(backend_message(b"d", b"k1"))
        peer.close()
        frame = await conn.read_frame(5)
        assert frame is not None
        assert bytes(frame) == b"k1"
        with pytest.raises(ReplicationStreamEnded, match="replication connection lost") as info:
            await conn.read_frame(5)
        assert info.value.sqlstate is None


# -- against the server ---------------------------------------------------------------


@dataclass(frozen=True)
class Upstream:
    url: str
    slot: str


@pytest.fixture
async def upstream(db_url: str) -> Upstream:
    """A published table and a pgoutput slot in a scratch database."""
    slot = f"cs_conn_{uuid.uuid4().hex[:12]}"
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        await c.execute("CREATE TABLE items (id int8 PRIMARY KEY, v text)")
        await c.execute("CREATE PUBLICATION pub FOR TABLE items")
        await c.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    return Upstream(db_url, slot)


async def execute(url: str, *statements: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
        for s in statements:
            await c.execute(s.encode())


async def slot_value(url: str, slot: str, column: str) -> object:
    async with await psycopg.AsyncConnection.connect(url) as c:
        cur = await c.execute(
            f"SELECT {column} FROM pg_replication_slots WHERE slot_name = %s".encode(), (slot,)
        )
        row = await cur.fetchone()
        assert row is not None
        return row[0]


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Until ``check()`` is true: Postgres changes its state on its own time."""
    await waiting.eventually(check, what, 10, poll_s=0.02)


@asynccontextmanager
async def streaming(up: Upstream) -> AsyncIterator[ReplicationConnection]:
    """Replication from the slot's confirmed position (a previous stream's holder
    lets go of the slot a moment after its socket closed)."""
    conn = await ReplicationConnection.connect(up.url)
    try:

        async def started() -> bool:
            try:
                await conn.start_replication(up.slot, 0, ["pub"])
                return True
            except StartReplicationError as e:
                if e.sqlstate != "55006":  # only "the slot is active" waits
                    raise
                return False

        await eventually(started, "the slot to be free for streaming")
        yield conn
    finally:
        await conn.close()


async def transaction(
    conn: ReplicationConnection, pieces_over: int | None = None
) -> list[bytes | FramePieces]:
    """The XLogData frames of the next transaction (keepalives skipped)."""
    frames: list[bytes | FramePieces] = []
    for _ in range(1000):
        frame = await conn.read_frame(10, pieces_over=pieces_over)
        assert frame is not None, "no frame within 10 s"
        if isinstance(frame, FramePieces):
            frames.append(frame)
            continue
        copy = parse_copy_data(frame)
        if isinstance(copy, XLogData):
            frames.append(bytes(frame))
            if isinstance(decode_message(copy.payload), Commit):
                return frames
    raise AssertionError("no commit in 1000 frames")


def but_send_time(frame: bytes | FramePieces) -> bytes:
    """An XLogData frame without the time it was sent (its bytes 17-24)."""
    whole = b"".join(frame.chunks) if isinstance(frame, FramePieces) else frame
    return whole[:17] + whole[25:]


def decoded(frame: bytes | FramePieces) -> PgOutputMessage:
    whole = b"".join(frame.chunks) if isinstance(frame, FramePieces) else frame
    xlog = parse_copy_data(whole)
    assert isinstance(xlog, XLogData)
    return decode_message(xlog.payload)


async def test_rows_arrive_as_xlogdata_frames(upstream: Upstream) -> None:
    async with streaming(upstream) as conn:
        assert conn.backend_pid > 0
        await execute(upstream.url, "INSERT INTO items VALUES (1, 'a'), (2, 'b')")
        messages = [decoded(f) for f in await transaction(conn)]
    assert [type(m) for m in messages] == [Begin, Relation, Insert, Insert, Commit]
    assert [m.new[1] for m in messages if isinstance(m, Insert)] == ["a", "b"]


async def test_a_frame_over_pieces_over_comes_in_pieces_that_join_to_the_whole_frame(
    upstream: Upstream,
) -> None:
    await a_frame_in_pieces_joins_to_the_whole_frame(upstream)


def test_a_frame_in_pieces_on_uvloop(upstream: Upstream) -> None:
    """``serve`` runs on uvloop, whose transports read up to 32 times a turn."""
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(a_frame_in_pieces_joins_to_the_whole_frame(upstream))


async def a_frame_in_pieces_joins_to_the_whole_frame(upstream: Upstream) -> None:
    value = os.urandom(1_500_000).hex()  # 3 MB of text
    await execute(upstream.url, f"INSERT INTO items VALUES (1, '{value}')")
    async with streaming(upstream) as conn:
        in_pieces = await transaction(conn, pieces_over=1 << 20)
    # The slot did not move (nothing was confirmed): the same frames come again.
    async with streaming(upstream) as conn:
        whole = await transaction(conn)

    assert [type(f) for f in in_pieces] == [bytes, bytes, FramePieces, bytes]
    assert [but_send_time(f) for f in in_pieces] == [but_send_time(f) for f in whole]
    pieces = in_pieces[2]
    assert isinstance(pieces, FramePieces)
    assert len(pieces) == pieces.size == len(whole[2]) > 3_000_000
    assert all(len(chunk) <= CHUNK_BYTES for chunk in pieces.chunks)
    assert all(len(chunk) >= MIN_CHUNK_BYTES for chunk in pieces.chunks[:-1])
    insert = decoded(pieces)
    assert isinstance(insert, Insert)
    assert insert.new[1] == value


async def test_a_standby_status_update_moves_the_slot(upstream: Upstream) -> None:
    async with streaming(upstream) as conn:
        await execute(upstream.url, "INSERT INTO items VALUES (1, 'a')")
        commit = decoded((await transaction(conn))[-1])
        assert isinstance(commit, Commit)

        async def confirmed_lsn() -> int:
            lsn = await slot_value(upstream.url, upstream.slot, "confirmed_flush_lsn")
            return parse_lsn(str(lsn))

        assert await confirmed_lsn() < commit.end_lsn
        now_us = time.time_ns() // 1000
        await conn.send_frame(standby_status_update(commit.end_lsn, now_unix_us=now_us))

        async def confirmed() -> bool:
            return await confirmed_lsn() >= commit.end_lsn

        await eventually(confirmed, "the slot confirmed the commit")


async def test_terminating_the_walsender_ends_the_stream_with_57p01(upstream: Upstream) -> None:
    async with streaming(upstream) as conn:
        await execute(upstream.url, f"SELECT pg_terminate_backend({conn.backend_pid})")
        with pytest.raises(ReplicationStreamEnded) as info:
            for _ in range(100):
                await conn.read_frame(10)
        assert info.value.sqlstate == "57P01"
        assert "terminating connection due to administrator command" in str(info.value)
        with pytest.raises(ReplicationStreamEnded) as again:
            await conn.read_frame(1)
        assert again.value is info.value


async def test_a_missing_slot_and_a_slot_in_use_are_refused_with_their_sqlstates(
    upstream: Upstream,
) -> None:
    conn = await ReplicationConnection.connect(upstream.url)
    try:
        with pytest.raises(StartReplicationError, match='"cs_no_such_slot" does not exist') as info:
            await conn.start_replication("cs_no_such_slot", 0, ["pub"])
        assert info.value.sqlstate == "42704"
        async with streaming(upstream):
            with pytest.raises(StartReplicationError, match="is active for PID") as busy:
                await conn.start_replication(upstream.slot, 0, ["pub"])
            assert busy.value.sqlstate == "55006"

        async def inactive() -> bool:
            return await slot_value(upstream.url, upstream.slot, "active") is False

        await eventually(inactive, "the other stream let go of the slot")
        # After a refusal the same connection can start replication (source._start retries).
        await conn.start_replication(upstream.slot, 0, ["pub"])
        await execute(upstream.url, "INSERT INTO items VALUES (1, 'a')")
        assert len(await transaction(conn)) == 4
    finally:
        await conn.close()


# -- connecting ---------------------------------------------------------------------


async def test_a_server_that_refuses_the_login_says_why_in_one_line(db_url: str) -> None:
    with pytest.raises(ConnectError) as info:
        await ReplicationConnection.connect(make_conninfo(db_url, dbname="cs_no_such_database"))
    assert str(info.value).endswith('FATAL: database "cs_no_such_database" does not exist')
    assert "\n" not in str(info.value)
    assert info.value.sqlstate == "3D000"


def first_then_the_real_server(db_url: str, port: int) -> str:
    """``db_url`` with two hosts: 127.0.0.1 at ``port`` first, then the real server."""
    params = conninfo_to_dict(db_url)
    return make_conninfo(
        db_url, host=f"127.0.0.1,{params['host']}", port=f"{port},{params['port']}"
    )


async def test_an_unreachable_host_is_one_line_and_the_next_host_is_tried(db_url: str) -> None:
    port = unused_port()
    with pytest.raises(
        ConnectError, match=rf'^connection to server at "127.0.0.1", port {port} failed'
    ):
        await ReplicationConnection.connect(f"host=127.0.0.1 port={port} user=postgres")
    conninfo = first_then_the_real_server(db_url, port)
    conn = await ReplicationConnection.connect(conninfo)
    await conn.close()


async def test_a_connect_that_takes_too_long_gives_up(db_url: str) -> None:
    listener = socket.socket()  # accepts nothing, answers nothing
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        port = listener.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(ConnectError, match=f'at "127.0.0.1", port {port} failed: timeout'):
            await ReplicationConnection.connect(f"host=127.0.0.1 port={port}", timeout_s=0.3)
        assert time.monotonic() - started < 5
    finally:
        listener.close()


# -- connecting to a server that misbehaves (a fake one on loopback) -------------


class Inbox:
    """What the client sent the fake server after its startup message, in order."""

    def __init__(self) -> None:
        self.received: list[bytes] = []
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    def put(self, message: bytes | None) -> None:
        if message is not None:
            self.received.append(message)
        self._queue.put_nowait(message)

    async def next(self) -> bytes | None:
        """The client's next message; None once it left."""
        return await self._queue.get()

    async def until_gone(self) -> None:
        while await self.next() is not None:
            pass


Script = Callable[[Inbox, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def fake_server(
    script: Script, tls: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[int, list[bytes]]]:
    """A TCP server on loopback that answers SSLRequest (with TLS when given a
    context, else N), reads the startup message, then runs ``script``; yields its
    port and every message the client sent (``startup``, then type byte and body)."""
    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        inbox = Inbox()
        inbox.received = received
        try:
            length, code = struct.unpack("!II", await reader.readexactly(8))
            if code == 80877103:  # SSLRequest
                writer.write(b"S" if tls is not None else b"N")
                await writer.drain()
                if tls is not None:
                    await writer.start_tls(tls)
                length, code = struct.unpack("!II", await reader.readexactly(8))
            await reader.readexactly(length - 8)
            received.append(b"startup")

            async def record() -> None:
                try:
                    while True:
                        kind, n = struct.unpack("!cI", await reader.readexactly(5))
                        inbox.put(kind + await reader.readexactly(n - 4))
                except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
                    inbox.put(None)

            recorder = asyncio.ensure_future(record())
            try:
                await script(inbox, writer)
                await writer.drain()
                await asyncio.wait([recorder], timeout=10)
            finally:
                recorder.cancel()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], received
    finally:
        server.close()
        await server.wait_closed()


def auth(code: int, data: bytes = b"") -> bytes:
    return backend_message(b"R", struct.pack("!I", code) + data)


def asks(*messages: bytes) -> Script:
    """A script that sends each of ``messages`` once the client answered the one
    before (the first at once)."""

    async def script(inbox: Inbox, w: asyncio.StreamWriter) -> None:
        for i, m in enumerate(messages):
            if i and await inbox.next() is None:
                return
            w.write(m)
            await w.drain()

    return script


AUTH_OK = backend_message(b"R", struct.pack("!I", 0))
READY = AUTH_OK + backend_message(b"K", struct.pack("!II", 77, 1)) + backend_message(b"Z", b"I")


async def test_a_malformed_startup_message_fails_that_host_and_the_next_is_tried(
    db_url: str,
) -> None:
    async def garbage(_i: Inbox, w: asyncio.StreamWriter) -> None:
        w.write(backend_message(b"R", b"\x00"))  # an authentication request with no code

    async with fake_server(garbage) as (port, _):
        with pytest.raises(ConnectError, match="malformed 'R' message from the server"):
            await ReplicationConnection.connect(f"host=127.0.0.1 port={port} user=x")
        conninfo = first_then_the_real_server(db_url, port)
        conn = await ReplicationConnection.connect(conninfo)
        await conn.close()


async def test_each_host_has_its_own_connect_timeout(db_url: str) -> None:
    async def silent(inbox: Inbox, _w: asyncio.StreamWriter) -> None:
        await inbox.until_gone()  # says nothing, until the client leaves

    async with fake_server(silent) as (port, _):
        conninfo = first_then_the_real_server(db_url, port)
        # The first host takes the whole wait; the second still gets one of its own.
        conn = await ReplicationConnection.connect(conninfo, timeout_s=0.5)
        await conn.close()


async def test_an_oversized_control_message_is_refused_before_its_body_arrives() -> None:
    async def huge(_i: Inbox, w: asyncio.StreamWriter) -> None:
        # A ParameterStatus "of 100 MB": only its header is ever sent.
        w.write(b"S" + struct.pack("!I", 100 << 20))

    async with fake_server(huge) as (port, _):
        with pytest.raises(ConnectError, match=r"invalid message length 104857600 \(type 0x53\)"):
            await ReplicationConnection.connect(f"host=127.0.0.1 port={port} user=x", timeout_s=5)


def test_only_copy_data_may_be_long() -> None:
    body = b"x" * 40_000
    assert fed([backend_message(b"d", body)]) == [(ord("d"), body, len(body))]
    assert fed([backend_message(b"E", b"M" + body + b"\x00\x00")])[0][2] == len(body) + 3
    for kind in (b"S", b"R", b"K", b"Z", b"W"):
        with pytest.raises(ProtocolViolation, match="invalid message length"):
            fed([backend_message(kind, body)])
    with pytest.raises(ProtocolViolation, match="invalid message length"):
        fed([backend_message(b"N", b"x" * (2 << 20))])


async def test_sslrootcert_system_never_falls_back_to_plaintext() -> None:
    """A server (or whoever answers in its place) that says "no TLS" gets nothing."""

    async def ask_in_the_clear(_i: Inbox, w: asyncio.StreamWriter) -> None:
        w.write(backend_message(b"R", struct.pack("!I", 3)))

    async with fake_server(ask_in_the_clear) as (port, received):
        with pytest.raises(ConnectError, match="server does not support SSL, but SSL was required"):
            await ReplicationConnection.connect(
                f"host=127.0.0.1 port={port} user=x password=secret sslrootcert=system"
            )
        assert received == []  # not even the startup message


async def test_tcp_keepalives_are_set_on_the_socket() -> None:
    async def ready(_i: Inbox, w: asyncio.StreamWriter) -> None:
        w.write(READY)

    async with fake_server(ready) as (port, _):
        conn = await ReplicationConnection.connect(
            f"host=127.0.0.1 port={port} user=x keepalives_idle=7 keepalives_interval=3 "
            "keepalives_count=4 tcp_user_timeout=9000"
        )
        try:
            sock = conn._wire._transport().get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 7
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 3
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 4
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 9000
            assert conn.backend_pid == 77
        finally:
            await conn.close()
        conn = await ReplicationConnection.connect(f"host=127.0.0.1 port={port}")
        try:  # on by default, a dead peer noticed in about 2 minutes, not the system's 2 hours
            sock = conn._wire._transport().get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 60
        finally:
            await conn.close()
        conn = await ReplicationConnection.connect(f"host=127.0.0.1 port={port} keepalives=0")
        try:
            sock = conn._wire._transport().get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        finally:
            await conn.close()


async def test_a_server_that_skips_authentication_is_refused_by_require_auth() -> None:
    async def trust(_i: Inbox, w: asyncio.StreamWriter) -> None:
        w.write(READY)

    async with fake_server(trust) as (port, received):
        with pytest.raises(ConnectError, match="server did not complete authentication"):
            await ReplicationConnection.connect(
                f"host=127.0.0.1 port={port} user=x password=secret require_auth=scram-sha-256"
            )
        assert all(b"secret" not in m for m in received)


SCRAM_ONLY = auth(10, b"SCRAM-SHA-256\x00\x00")


def server_first(iterations: int) -> bytes:
    return auth(11, f"r=NONCE+server,s=c2FsdA==,i={iterations}".encode())


def no_clear_password(received: list[bytes], password: bytes = b"secret") -> bool:
    """No PasswordMessage carried the password as it is (SCRAM never sends it)."""
    return all(not (m.startswith(b"p") and password in m) for m in received)


async def test_a_cleartext_request_after_scram_began_gets_no_password() -> None:
    # The SCRAM nonce is the client's: a cleartext request follows the initial response.
    async with fake_server(asks(SCRAM_ONLY, auth(3))) as (port, received):
        with pytest.raises(ConnectError, match="cleartext password after scram-sha-256"):
            await ReplicationConnection.connect(f"host=127.0.0.1 port={port} password=secret")
        assert any(m.startswith(b"pSCRAM-SHA-256") for m in received)
        assert no_clear_password(received)
    async with fake_server(asks(SCRAM_ONLY, auth(5, b"salt"))) as (port, received):
        with pytest.raises(ConnectError, match="hashed password after scram-sha-256"):
            await ReplicationConnection.connect(f"host=127.0.0.1 port={port} password=secret")
        assert not any(m.startswith(b"pmd5") for m in received)


async def test_a_server_asking_for_a_huge_scram_iteration_count_is_refused_at_once() -> None:
    async def huge(inbox: Inbox, w: asyncio.StreamWriter) -> None:
        w.write(SCRAM_ONLY)
        first = await inbox.next()
        assert first is not None
        nonce = first.split(b"r=")[1].decode()
        w.write(auth(11, f"r={nonce}server,s=c2FsdA==,i=2147483647".encode()))

    async with fake_server(huge) as (port, received):
        with pytest.raises(ConnectError, match="asks for 2,147,483,647 iterations"):
            await ReplicationConnection.connect(
                f"host=127.0.0.1 port={port} password=secret", timeout_s=10
            )
        assert no_clear_password(received)


async def test_require_auth_and_channel_binding_keep_the_password_from_a_server_that_asks() -> None:
    for conninfo, refusal in (
        ("require_auth=scram-sha-256", "server requested a cleartext password"),
        ("require_auth=!password", "server requested a cleartext password"),
        ("channel_binding=require sslmode=prefer", "channel binding required"),
    ):
        async with fake_server(asks(auth(3))) as (port, received):
            with pytest.raises(ConnectError, match=refusal):
                await ReplicationConnection.connect(
                    f"host=127.0.0.1 port={port} password=secret {conninfo}"
                )
            assert received == [b"startup"], conninfo


@pytest.fixture(scope="module")
def server_tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, str]:
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    if certs is None:
        pytest.skip("no openssl to make a test CA")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs / "server.crt", certs / "server.key")
    return context, str(certs / "ca.crt")


async def test_over_tls_a_server_that_drops_scram_plus_is_refused_or_sees_the_downgrade(
    server_tls: tuple[ssl.SSLContext, str],
) -> None:
    context, ca = server_tls
    async with fake_server(asks(SCRAM_ONLY), tls=context) as (port, received):
        with pytest.raises(ConnectError, match="server did not offer an authentication method"):
            await ReplicationConnection.connect(
                f"host=127.0.0.1 port={port} password=x sslmode=require channel_binding=require"
            )
        assert received == [b"startup"]
    async with fake_server(asks(SCRAM_ONLY), tls=context) as (port, received):
        with pytest.raises(ConnectError):  # the fake says nothing more
            await ReplicationConnection.connect(
                f"host=127.0.0.1 port={port} password=x sslmode=verify-full sslrootcert={ca}",
                timeout_s=1,
            )
        # "y": the client could have bound the channel; a real server that offered
        # SCRAM-SHA-256-PLUS would see that someone took it off the list.
        assert any(m.startswith(b"pSCRAM-SHA-256\x00") and b"y,,n=," in m for m in received)


async def test_over_verified_tls_a_cleartext_password_is_sent(
    server_tls: tuple[ssl.SSLContext, str],
) -> None:
    context, ca = server_tls
    async with fake_server(asks(auth(3), READY), tls=context) as (port, received):
        conn = await ReplicationConnection.connect(
            f"host=localhost port={port} password=secret sslmode=verify-full sslrootcert={ca} "
            "require_auth=password"
        )
        await conn.close()
        assert b"psecret\x00" in received


async def test_a_unix_socket_directory_connects(upstream: Upstream) -> None:
    params = conninfo_to_dict(upstream.url)
    socket_dir = "/var/run/postgresql"
    if not os.path.exists(f"{socket_dir}/.s.PGSQL.{params['port']}"):
        pytest.skip(f"no Postgres socket in {socket_dir} for port {params['port']}")
    conn = await ReplicationConnection.connect(make_conninfo(upstream.url, host=socket_dir))
    try:
        await conn.start_replication(upstream.slot, 0, ["pub"])
        await execute(upstream.url, "INSERT INTO items VALUES (1, 'a')")
        assert len(await transaction(conn)) == 4
    finally:
        await conn.close()


async def server_ssl(url: str) -> bool:
    async with await psycopg.AsyncConnection.connect(url) as c:
        cur = await c.execute("SHOW ssl")
        row = await cur.fetchone()
        return row is not None and row[0] == "on"


async def test_sslmode_against_the_local_server(db_url: str) -> None:
    """TLS itself is tested against a private server with certificates
    (test_pgwire); here: what the shared server does with each mode."""
    for mode in ("disable", "prefer", "allow"):
        conn = await ReplicationConnection.connect(make_conninfo(db_url, sslmode=mode))
        await conn.close()
    if not await server_ssl(db_url):
        with pytest.raises(ConnectError, match="server does not support SSL, but SSL was required"):
            await ReplicationConnection.connect(make_conninfo(db_url, sslmode="require"))
        pytest.skip("the local server has ssl=off: sslmode=require cannot connect to it")
    conn = await ReplicationConnection.connect(make_conninfo(db_url, sslmode="require"))
    await conn.close()


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
