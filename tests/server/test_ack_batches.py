"""Acks that arrive many to one socket read (as a pipelining client sends them).

A raw client writes several masked ack frames in one TCP write, so the server's
fast path sees them in one chunk: the in-order prefix is matched at once, and the
first bad ack still closes the stream with the precise protocol error.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
from collections.abc import AsyncIterator

import pytest
from websockets.frames import Frame, Opcode

from ..waiting import eventually
from .conftest import REPLICA_VERSION, Server
from .test_replication_ws import txn

PATH = (
    f"/replication/v6/changes?id=raw-1&replicaVersion={REPLICA_VERSION}&watermark={REPLICA_VERSION}"
)


class RawClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def frame(self) -> tuple[int, bytes]:
        """The next server frame: (opcode, payload). Server frames are unmasked."""
        head = await asyncio.wait_for(self.reader.readexactly(2), 10)
        length = head[1] & 0x7F
        if length == 126:
            length = int.from_bytes(await self.reader.readexactly(2), "big")
        elif length == 127:
            length = int.from_bytes(await self.reader.readexactly(8), "big")
        return head[0] & 0x0F, await self.reader.readexactly(length)

    def send_acks(self, ids: list[int]) -> None:
        """All acks in one write, each its own masked frame (random masks)."""
        self.writer.write(
            b"".join(
                Frame(Opcode.TEXT, f'{{"ack":{i}}}'.encode()).serialize(mask=True, extensions=[])
                for i in ids
            )
        )


@pytest.fixture
async def client(server: Server) -> AsyncIterator[RawClient]:
    host, port = server.url.removeprefix("ws://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    key = base64.b64encode(os.urandom(16)).decode()
    request = (
        f"GET {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    writer.write(request.encode())
    response = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert response.startswith(b"HTTP/1.1 101")
    yield RawClient(reader, writer)
    writer.close()


async def acked(server: Server, watermark: str) -> list[str]:
    await eventually(
        lambda: server.service.forwarder.acks() == [watermark], f"the ack of {watermark}", 5
    )
    return server.service.forwarder.acks()


async def receive_frames(server: Server, client: RawClient, n: int) -> list[bytes]:
    """Status, then ``n - 1`` frames of two transactions pushed upstream."""
    assert (await client.frame())[1].startswith(b'{"id":1,"msg":["status"')
    stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
    stream.push_all(txn("02", 3) + txn("03", 1))
    return [(await client.frame())[1] for _ in range(n - 1)]


async def test_a_chunk_of_in_order_acks_is_matched_at_once(
    server: Server, client: RawClient
) -> None:
    frames = await receive_frames(server, client, 9)
    assert [f[: len(f'{{"id":{i},')] for i, f in zip(range(2, 10), frames, strict=True)] == [
        f'{{"id":{i},'.encode() for i in range(2, 10)
    ]
    client.send_acks(list(range(1, 10)))
    assert await acked(server, "03") == ["03"]


async def test_the_first_bad_ack_in_a_chunk_closes_after_the_good_ones_count(
    server: Server, client: RawClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.server.transport")
    await receive_frames(server, client, 9)
    (sub,) = server.service.forwarder.active
    # 1..6 ack status and all of transaction 02; 8 skips 7.
    client.send_acks([1, 2, 3, 4, 5, 6, 8, 9])
    opcode, payload = await client.frame()
    assert opcode == Opcode.CLOSE.value
    # Streaming had begun: a close without a status code (peers see 1005), as the
    # reference closes (spec/wire.md §1.4); the reason is in our log.
    assert payload == b""
    assert "closing stream: unexpected ack 8: expected ack 7" in caplog.text
    assert sub.acked == "02"  # the good acks before the bad one were matched
    assert sub.closed


async def test_a_text_frame_that_is_not_utf8_closes_1007_with_one_log_line(
    server: Server, client: RawClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    # uvicorn's loggers do not propagate to the root logger: listen to them directly.
    uvicorn_error = logging.getLogger("uvicorn.error")
    uvicorn_error.addHandler(caplog.handler)
    try:
        await check_invalid_utf8_close(server, client)
    finally:
        uvicorn_error.removeHandler(caplog.handler)
    assert "a text frame is not UTF-8" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def check_invalid_utf8_close(server: Server, client: RawClient) -> None:
    await receive_frames(server, client, 1)
    client.writer.write(
        Frame(Opcode.TEXT, b'{"ack":1,"x":"\xff\xfe"}').serialize(mask=True, extensions=[])
    )
    opcode, payload = await client.frame()
    assert opcode == Opcode.CLOSE.value
    assert int.from_bytes(payload[:2], "big") == 1007
