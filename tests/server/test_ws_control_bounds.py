"""Control frames are bounded like data: a ping flood is closed, its pongs never pile
up, and nothing a client sends logs a traceback."""

from __future__ import annotations

import asyncio
import base64
import logging
import os

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from app.protocol.lexi import to_lexi
from app.server import ws_protocol

from ..waiting import eventually
from .conftest import Server
from .test_replication_ws import QUERY, txn
from .test_robustness import follow

QUEUE_LIMIT = 64 * 1024  # conftest.start_server's LivenessProtocol.with_queue_limit


def masked(opcode: int, payload: bytes) -> bytes:
    """One FIN client frame, masked as RFC 6455 requires (payload < 126 bytes)."""
    assert len(payload) < 126
    mask = os.urandom(4)
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + body


async def raw_upgrade(
    server: Server, path: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A websocket upgrade written by hand; returns the streams after the 101."""
    port = int(server.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        (
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One unmasked server frame: (opcode, payload)."""
    b0, b1 = await asyncio.wait_for(reader.readexactly(2), 10)
    size = b1 & 0x7F
    if size == 126:
        size = int.from_bytes(await reader.readexactly(2), "big")
    elif size == 127:
        size = int.from_bytes(await reader.readexactly(8), "big")
    return b0 & 0x0F, await asyncio.wait_for(reader.readexactly(size), 10)


def write_buffers(server: Server) -> list[int]:
    """Bytes buffered for each open websocket's socket, server side."""
    return [
        c.transport.get_write_buffer_size()
        for c in server.http.server_state.connections
        if isinstance(c, ws_protocol.LivenessProtocol) and not c.transport.is_closing()
    ]


async def http_get_root(server: Server) -> bytes:
    port = int(server.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_a_ping_flood_that_does_not_read_is_closed_its_pongs_bounded_others_served(
    server: Server,
) -> None:
    path = f"/replication/v6/changes?{QUERY}"
    async with connect(f"{server.url}{path.replace('-1', '-healthy')}") as healthy:
        await healthy.recv()
        await healthy.send('{"ack":1}')
        reader, writer = await raw_upgrade(server, path)
        opcode, _ = await read_frame(reader)  # the status message
        assert opcode == 1
        writer.write(masked(1, b'{"ack":1}'))
        stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
        for n in range(2, 52):
            stream.push_all(txn(to_lexi(n)))
        # The flood: 125-byte pings, never reading what comes back. Without a bound,
        # every one is answered with a pong queued for a socket nobody reads.
        ping = masked(9, b"p" * 125)
        most_buffered = 0
        closed = False
        for _ in range(400):  # up to 400 x 500 pings (25 MB)
            try:
                writer.write(ping * 500)
                await asyncio.wait_for(writer.drain(), 10)
            except (ConnectionError, TimeoutError):
                closed = True
                break
            most_buffered = max([most_buffered, *write_buffers(server)])
            if server.connections() == 1:
                closed = True
                break
        writer.close()
        assert closed, "the flooder was never closed"
        await eventually(lambda: server.connections() == 1, "the flooder's connection gone")
        # Its pongs never piled up past the socket's bound (plus one pong).
        assert most_buffered <= QUEUE_LIMIT + 200
        # Meanwhile the healthy subscriber got every commit and the port answers.
        commits = await follow(healthy, to_lexi(51))
        assert len(commits) == 50
        assert (await http_get_root(server)).startswith(b"HTTP/1.1 200")


async def test_a_ping_flood_that_reads_everything_is_closed_with_1008(server: Server) -> None:
    async with connect(f"{server.url}/replication/v6/changes?{QUERY}") as flooder:
        await flooder.recv()
        await flooder.send('{"ack":1}')
        with pytest.raises(ConnectionClosed) as e:
            # Over any burst the limit allows: a well-behaved client pings every few s.
            for n in range(5000):
                await flooder.ping(n.to_bytes(4, "big"))
            await asyncio.wait_for(flooder.recv(), 10)
        assert e.value.rcvd is not None
        assert (e.value.rcvd.code, e.value.rcvd.reason) == (1008, "too many control frames")
    await eventually(lambda: server.connections() == 0, "the flooder's connection gone")


async def test_a_few_pings_are_answered(server: Server) -> None:
    async with connect(f"{server.url}/replication/v6/changes?{QUERY}") as ws:
        await ws.recv()
        for n in range(5):
            latency = await asyncio.wait_for(await ws.ping(n.to_bytes(4, "big")), 10)
            assert latency >= 0


async def test_bad_utf8_and_a_close_in_one_packet_log_no_traceback(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    reader, writer = await raw_upgrade(server, f"/replication/v6/changes?{QUERY}")
    await read_frame(reader)
    close = masked(8, (1000).to_bytes(2, "big"))
    writer.write(masked(1, b'{"ack":\xff\xfe}') + close)
    frames = []
    try:
        while True:
            frames.append(await read_frame(reader))
    except asyncio.IncompleteReadError:
        pass  # the server closed the connection
    finally:
        writer.close()
    assert frames
    assert frames[-1][0] == 8  # a close frame (the echo: ours came first)
    await eventually(lambda: server.connections() == 0, "the connection gone")
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert bad == [], [r.getMessage() for r in bad]
