"""A change too large to hold whole (``Pieces``) goes to subscribers as websocket
fragments, live and caught up, and into the change log, without ever being joined
in the service (decision 44). Real loopback sockets, a real SQLite change log."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from app.protocol.canonical_json import JsonPieces, dumps, json_string_piece, loads
from app.protocol.messages import Data
from app.protocol.pieces import PIECE_CHARS, Pieces, join_text

from ..waiting import eventually
from .conftest import REPLICA_VERSION, Server, start_server

QUERY = f"replicaVersion={REPLICA_VERSION}&watermark={REPLICA_VERSION}"
RELATION = {"schema": "public", "name": "t", "rowKey": {"columns": ["id"]}}
# ~6 MB, with every character JSON escapes and multi-byte UTF-8.
VALUE = ('quote " back \\ line \n é € 😀 ' + "x" * 4000) * 1500


def big_row(value: str) -> Data:
    parts = [value[i : i + PIECE_CHARS] for i in range(0, len(value), PIECE_CHARS)]
    quoted = Pieces(['"', *(json_string_piece(p) for p in parts), '"'])
    body: dict[str, Any] = {
        "tag": "insert",
        "relation": RELATION,
        "new": {"id": 1, "v": JsonPieces(quoted)},
    }
    return Data(body, "insert")


def transaction(watermark: str, value: str = VALUE) -> list[Any]:
    return [
        ["begin", {"tag": "begin"}, {"commitWatermark": watermark}],
        big_row(value),
        ["data", {"tag": "insert", "relation": RELATION, "new": {"id": 2}}],
        ["commit", {"tag": "commit"}, {"watermark": watermark}],
    ]


def expected_messages(watermark: str) -> list[Any]:
    return [
        ["begin", {"tag": "begin"}, {"commitWatermark": watermark}],
        ["data", {"tag": "insert", "relation": RELATION, "new": {"id": 1, "v": VALUE}}],
        ["data", {"tag": "insert", "relation": RELATION, "new": {"id": 2}}],
        ["commit", {"tag": "commit"}, {"watermark": watermark}],
    ]


@pytest.fixture(autouse=True)
def no_whole_join(monkeypatch: pytest.MonkeyPatch) -> None:
    """Joining a large text on the event loop is the stall this design removes."""

    def refuse(self: Pieces) -> str:
        raise AssertionError("a large text was joined in the service")

    monkeypatch.setattr(Pieces, "join", refuse)


async def read_messages(ws: ClientConnection, n: int) -> list[Any]:
    """``n`` messages (of msg or batch frames), each frame acked as it comes."""
    messages: list[Any] = []
    while len(messages) < n:
        frame = loads(await asyncio.wait_for(ws.recv(), 30))
        messages += frame["batch"] if "batch" in frame else [frame["msg"]]
        await ws.send(dumps({"ack": frame["id"]}))
    return messages


@pytest.mark.parametrize("batched", [False, True], ids=["v6", "v7-batched"])
async def test_a_large_change_streams_live_and_is_stored(server: Server, batched: bool) -> None:
    url = f"{server.url}/replication/v6/changes?id=live&{QUERY}"
    if batched:
        url = f"{server.url}/replication/v7/changes?id=live&{QUERY}&wsBatched=true"
    async with connect(url, max_size=None) as ws:
        assert (await read_messages(ws, 1))[0][0] == "status"
        stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
        stream.push_all(transaction("02"))
        assert await read_messages(ws, 4) == expected_messages("02")
    await asyncio.wait_for(server.service.storer.wait_durable("02"), 30)
    log = server.service.change_log
    rows = [row async for batch in log.read("02", "02") for row in batch]
    assert [r[:2] for r in rows] == [("02", 0), ("02", 1), ("02", 2), ("02", 3)]
    assert loads(join_text(rows[1][2])) == expected_messages("02")[1][1]


async def spying_read(read: Any, kinds: list[type], *args: Any, **kwargs: Any) -> Any:
    """``ChangeLog.read`` that notes the type of each row's change."""
    async for batch in read(*args, **kwargs):
        kinds.extend(type(row[2]) for row in batch)
        yield batch


@pytest.mark.parametrize("tail_bytes", [16 << 20, 0], ids=["from-memory", "from-the-log"])
async def test_a_large_change_is_caught_up(tmp_path: Path, tail_bytes: int) -> None:
    async for server in start_server(tmp_path, catchup_tail_bytes=tail_bytes):
        async with connect(f"{server.url}/replication/v6/changes?id=live&{QUERY}") as ws:
            await read_messages(ws, 1)
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
            stream.push_all(
                [
                    ["begin", {"tag": "begin"}, {"commitWatermark": "02"}],
                    ["commit", {"tag": "commit"}, {"watermark": "02"}],
                    *transaction("03"),
                ]
            )
            await asyncio.wait_for(server.service.storer.wait_durable("03"), 30)
        log = server.service.change_log
        read = log.read
        kinds: list[type] = []

        log.read = partial(spying_read, read, kinds)  # type: ignore[method-assign]
        # From 02: the tail holds 02 and 03 (unless its budget is 0).
        url = f"{server.url}/replication/v6/changes?id=late&replicaVersion=01&watermark=02"
        async with connect(url, max_size=None) as ws:
            messages = await read_messages(ws, 5)
        assert messages[0][0] == "status"
        assert messages[1:] == expected_messages("03")
        if tail_bytes:
            assert kinds == []  # all from memory
        else:
            assert Pieces in kinds  # read back from the log in pieces


async def test_the_message_goes_out_in_fragments(server: Server) -> None:
    """Read the raw socket: the large message is a text frame without FIN, then
    continuation frames, each at most a piece's UTF-8 and its header."""
    host, port = server.url.removeprefix("ws://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            (
                f"GET /replication/v6/changes?id=raw&{QUERY} HTTP/1.1\r\nHost: {host}\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        frames: list[tuple[int, bytes]] = []

        async def frame() -> tuple[int, bytes]:
            head = await reader.readexactly(2)
            n = head[1] & 0x7F
            if n == 126:
                n = int.from_bytes(await reader.readexactly(2), "big")
            elif n == 127:
                n = int.from_bytes(await reader.readexactly(8), "big")
            return head[0], await reader.readexactly(n)

        def ack(frame_id: int) -> None:
            payload = dumps({"ack": frame_id}).encode()
            writer.write(bytes((0x81, 0x80 | len(payload))) + bytes(4) + payload)  # mask 0

        first, _status = await asyncio.wait_for(frame(), 10)
        assert first == 0x81
        ack(1)
        stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
        stream.push_all(transaction("02"))
        while len(frames) < 3 or frames[-1][0] & 0x80 == 0:  # begin, then the message
            frames.append(await asyncio.wait_for(frame(), 30))
        begin, *fragments = frames
        assert begin[0] == 0x81
        assert fragments[0][0] == 0x01  # text, no FIN
        assert all(op == 0x00 for op, _ in fragments[1:-1])  # continuations
        assert fragments[-1][0] == 0x80  # the last continuation, FIN
        assert max(len(p) for _, p in fragments) <= 4 * PIECE_CHARS + 64
        text = b"".join(p for _, p in fragments).decode()
        assert loads(text) == {"id": 3, "msg": expected_messages("02")[1]}
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await asyncio.wait_for(writer.wait_closed(), 5)


async def test_nothing_holds_a_large_change_once_it_is_stored_and_consumed(
    tmp_path: Path,
) -> None:
    """Memory comes back: with the tail off, no stage keeps the change's pieces
    (the storer's loop once held its last group while it awaited the next). Only
    this test's change counts (an earlier test's server may still be alive)."""
    async for server in start_server(tmp_path, catchup_tail_bytes=0):
        url = f"{server.url}/replication/v6/changes?id=live&{QUERY}"
        async with connect(url, max_size=None) as ws:
            await read_messages(ws, 1)
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
            stream.push_all(transaction("02", VALUE + MARK))
            await read_messages(ws, 4)
            await asyncio.wait_for(server.service.storer.wait_durable("02"), 30)
            held: list[str] = ["?"]

            def released() -> bool:
                nonlocal held
                gc.collect()
                held = [type(o).__name__ for o in gc.get_objects() if _marked(o)]
                return not held

            # ~1 s: the last acks and the sender's grace run out. (The message is
            # built within this iteration of the loop, when the wait fails.)
            still = lambda: f"no stage to hold the change (held: {held})"  # noqa: B023, E731
            await eventually(released, still, 1, poll_s=0.05)
            assert held == []


MARK = "this test's own value"


def _marked(o: object) -> bool:
    if type(o) is JsonPieces:
        o = o.text
    return type(o) is Pieces and MARK in o.tail(len(MARK) + 20)
