"""Connection limits on a real server: request sizes, pending handshakes, subscribers.

Each refusal is an answer the client receives at once (a status line, or a 1002
close with the reason), while the subscribers already streaming keep streaming.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.logging import AccessFormatter
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from app.protocol.lexi import to_lexi
from app.server.admission import HandshakeAdmission
from app.server.app import create_app
from app.server.http_protocol import GuardedHttpProtocol
from app.server.log_lines import LineLimit
from app.server.transport import MAX_CLIENT_FRAME_BYTES
from app.server.ws_protocol import LivenessProtocol

from ..waiting import eventually
from .conftest import Server, free_port, new_service, start_server
from .test_replication_ws import QUERY, txn
from .test_robustness import follow
from .test_ws_control_bounds import raw_upgrade, read_frame

BASE = "/replication/v6/changes?replicaVersion=01&watermark=01"


async def raw_request(server: Server, head: bytes) -> bytes:
    """Sends ``head`` on a new connection; everything the server answers until it
    closes (fails if that takes 10 s: a refusal must not leave the client waiting)."""
    host, port = server.url.removeprefix("ws://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def upgrade(path: str, extra_headers: str = "") -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra_headers}\r\n"
    ).encode()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    async for s in start_server(tmp_path):
        yield s


async def test_an_over_long_request_line_is_414_for_plain_and_upgrade_requests(
    server: Server,
) -> None:
    plain = await raw_request(server, b"GET /?" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    ws = await raw_request(server, upgrade(f"{BASE}&id={'a' * 9000}"))
    for answer in (plain, ws):
        assert answer.startswith(b"HTTP/1.1 414 "), answer[:100]


async def test_over_large_request_heads_are_431(server: Server) -> None:
    big = "".join(f"X-Pad-{i}: {'v' * 100}\r\n" for i in range(200))  # ~22 KiB
    plain = await raw_request(server, f"GET / HTTP/1.1\r\nHost: x\r\n{big}\r\n".encode())
    # Under 16 KiB in all, but more headers than websockets takes (128): its own
    # refusal, which uvicorn left unsent.
    many = "".join(f"X-{i}: v\r\n" for i in range(150))
    ws = await raw_request(server, upgrade(f"{BASE}&id=x", many))
    for answer in (plain, ws):
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]


async def test_pending_handshakes_are_bounded_and_time_out_while_streams_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.server.http_protocol")
    async for server in start_server(tmp_path, max_pending=5, handshake_timeout_s=1.0):
        host, port = server.url.removeprefix("ws://").split(":")
        async with connect(f"{server.url}{BASE}&id=steady") as steady:
            await steady.recv()
            await steady.send('{"ack":1}')
            # Five connections that never send a request take every pending place.
            silent = [await asyncio.open_connection(host, int(port)) for _ in range(5)]
            protocol = cast(type[GuardedHttpProtocol], server.http.config.http_protocol_class)
            limits = protocol.limits
            await eventually(
                lambda: limits.pending == 5,  # noqa: B023 (awaited here)
                "5 pending connections",
            )
            assert limits.pending == 5
            refused = await raw_request(server, b"")
            assert refused.startswith(b"HTTP/1.1 503 ")
            assert "more than 5 connections are opening" in caplog.text
            # The stream meanwhile:
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
            stream.push_all(txn("02", 5))
            assert await follow(steady, "02") == ["02"]
            # Past the timeout each silent one is answered 408 and closed...
            answers = [await asyncio.wait_for(r.read(), 10) for r, _ in silent]
            assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers)
            for _, w in silent:
                w.close()
            # ...and new connections are served again.
            async with connect(f"{server.url}{BASE}&id=late") as late:
                assert "status" in str(await asyncio.wait_for(late.recv(), 10))
            stream.push_all(txn(to_lexi(3), 1))
            assert await follow(steady, to_lexi(3)) == [to_lexi(3)]


async def open_socket(url: str) -> ClientConnection:
    return await connect(url, open_timeout=10)


def admission_of(server: Server) -> HandshakeAdmission:
    protocol = cast(type[GuardedHttpProtocol], server.http.config.http_protocol_class)
    return protocol.limits.admission


async def until_waiting(admission: HandshakeAdmission, n: int) -> None:
    await eventually(lambda: admission.waiting == n, f"{n} handshakes waiting")


async def test_a_handshake_beyond_the_rate_waits_its_turn_while_streams_go_on(
    tmp_path: Path,
) -> None:
    # Half a handshake a second, bursts of one: the steady subscriber takes the only
    # token, so the next handshake waits ~2 s for its turn.
    async for server in start_server(tmp_path, handshakes_per_s=0.5):
        admission = admission_of(server)
        async with connect(f"{server.url}{BASE}&id=steady") as steady:
            await steady.recv()
            await steady.send('{"ack":1}')
            late = asyncio.create_task(open_socket(f"{server.url}{BASE}&id=late"))
            await until_waiting(admission, 1)
            assert not late.done()
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
            stream.push_all(txn("02", 5))
            assert await follow(steady, "02") == ["02"]
            async with await late as ws:  # admitted when the token came
                assert "status" in str(await asyncio.wait_for(ws.recv(), 10))
            assert admission.waiting == 0
            assert admission.held_total == 1


async def test_handshakes_that_cannot_wait_get_503_with_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.server.http_protocol")
    async for server in start_server(
        tmp_path, max_pending=1, handshake_timeout_s=1.0, handshakes_per_s=0.1
    ):
        admission = admission_of(server)
        async with connect(f"{server.url}{BASE}&id=steady") as steady:
            await steady.recv()  # took the only token for the next 10 s
            held = asyncio.create_task(raw_request(server, upgrade(f"{BASE}&id=held")))
            await until_waiting(admission, 1)
            # One may wait (max_pending): the next is refused at once...
            full = await raw_request(server, upgrade(f"{BASE}&id=third"))
            assert full.startswith(b"HTTP/1.1 503 "), full[:100]
            assert b"more than 1 websocket handshakes are waiting" in full
            # ...and the one waiting is refused once it waited the handshake timeout.
            timed_out = await held
            assert timed_out.startswith(b"HTTP/1.1 503 "), timed_out[:100]
            assert b"no websocket handshake slot within 1 s" in timed_out
            assert admission.waiting == 0
        # One log line for the first 503; the second is counted for the summary.
        assert caplog.text.count("refused a connection from") == 1
        metrics = (await raw_request(server, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")).decode()
        assert 'changestreamer_connections_refused_total{status="503"} 2.0' in metrics
        # The statuses nothing was refused with yet are there at 0 (a rate() sees the first).
        for status in (408, 414, 431):
            assert f'changestreamer_connections_refused_total{{status="{status}"}} 0.0' in metrics
        assert "changestreamer_handshakes_held_total 1.0" in metrics
        assert "changestreamer_handshakes_waiting 0.0" in metrics


async def test_subscribers_beyond_the_limit_are_refused_with_the_reason(tmp_path: Path) -> None:
    async for server in start_server(tmp_path, max_subscribers=2):
        async with connect(f"{server.url}{BASE}&id=a") as a:
            async with connect(f"{server.url}{BASE}&id=b") as b:
                await a.recv()
                await b.recv()
                async with connect(f"{server.url}{BASE}&id=c") as c:
                    with pytest.raises(ConnectionClosed) as e:
                        await asyncio.wait_for(c.recv(), 10)
                assert e.value.rcvd is not None
                assert e.value.rcvd.code == 1002
                assert "serves at most 2 subscribers" in e.value.rcvd.reason
            await eventually(  # b's channel closes as its socket does
                lambda: len(server.service.forwarder.active) == 1,  # noqa: B023 (awaited here)
                "b's channel to close",
            )
            async with connect(f"{server.url}{BASE}&id=d") as d:
                assert "status" in str(await asyncio.wait_for(d.recv(), 10))


# A frame header may announce up to 2**63 bytes; this one announces 150 MiB, against
# the server's 64 KiB (MAX_CLIENT_FRAME_BYTES).
HUGE = 150 * 1024 * 1024


async def stream_huge_frame(writer: asyncio.StreamWriter) -> int:
    """Writes a masked text frame header announcing ``HUGE`` bytes, then the payload,
    1 MiB a write, until the server drops the connection; returns how much of the
    payload the connection took (the kernel's socket buffers included)."""
    writer.write(struct.pack("!BBQ", 0x81, 0x80 | 127, HUGE) + os.urandom(4))
    chunk = bytes(1 << 20)
    taken = 0
    try:
        while taken < HUGE:
            writer.write(chunk)
            await writer.drain()
            taken += len(chunk)
    except ConnectionError:
        pass
    return taken


def websocket_protocols(server: Server) -> list[LivenessProtocol]:
    return [c for c in server.http.server_state.connections if isinstance(c, LivenessProtocol)]


async def test_a_frame_over_the_limit_is_refused_at_its_header_unread(server: Server) -> None:
    reader, writer = await raw_upgrade(server, f"/replication/v6/changes?{QUERY}")
    try:
        opcode, _ = await read_frame(reader)  # the status message
        assert opcode == 1
        [protocol] = websocket_protocols(server)
        taken = await asyncio.wait_for(stream_huge_frame(writer), 30)
    finally:
        writer.close()
    # The server read no further than the read that held the header: the rest of
    # the payload did not fit in the sockets' buffers (a few MiB) before it was dropped...
    assert taken < HUGE // 4, f"{taken >> 20} MiB of the payload were taken"
    # ...and kept nothing of what that read held past the header (websockets' parser
    # buffer: bytes received and not yet parsed).
    assert not protocol.conn.reader.buffer
    await eventually(lambda: server.connections() == 0, "the connection gone")


@dataclass
class GatedServer:
    """A server whose websocket handshakes wait, before the app sees them, until
    ``release`` is set (``entered`` is set when one does)."""

    port: int
    entered: asyncio.Event
    release: asyncio.Event
    http: uvicorn.Server


@asynccontextmanager
async def gated_server(tmp_path: Path) -> AsyncIterator[GatedServer]:
    db, _, service = await new_service(tmp_path)
    app = create_app(db, service)
    entered, release = asyncio.Event(), asyncio.Event()

    async def gated(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            entered.set()
            await release.wait()
        await app(scope, receive, send)

    port = free_port()
    config = uvicorn.Config(
        gated,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        ws_max_size=MAX_CLIENT_FRAME_BYTES,
        ws=LivenessProtocol.with_queue_limit(64 * 1024),
    )
    http = uvicorn.Server(config)
    serving = asyncio.create_task(http.serve())
    await eventually(lambda: http.started, "uvicorn to start", 20)
    try:
        yield GatedServer(port, entered, release, http)
    finally:
        release.set()
        http.should_exit = True
        await asyncio.wait_for(serving, 20)


async def test_a_frame_over_the_limit_during_the_handshake_is_refused_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with gated_server(tmp_path) as gated:
        _, writer = await asyncio.open_connection("127.0.0.1", gated.port)
        try:
            writer.write(upgrade(f"/replication/v6/changes?{QUERY}"))
            await asyncio.wait_for(gated.entered.wait(), 10)
            # The upgrade is parsed, not answered: the frame comes mid-handshake.
            taken = await asyncio.wait_for(stream_huge_frame(writer), 30)
        finally:
            writer.close()
        assert taken < HUGE // 4, f"{taken >> 20} MiB of the payload were taken"
        await eventually(lambda: not gated.http.server_state.connections, "the connection gone")
        gated.release.set()
        await eventually(lambda: not gated.http.server_state.tasks, "the app to end")
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert bad == [], [r.getMessage() for r in bad]


def test_long_request_paths_are_cut_in_access_lines() -> None:
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "GET", "/?" + "a" * 5000, "1.1", 200),
        None,
    )
    assert LineLimit(512).filter(record)
    line = AccessFormatter(fmt="%(message)s", use_colors=False).format(record)
    assert len(line) < 700
    assert line.endswith('... (4490 more characters) HTTP/1.1" 200')
