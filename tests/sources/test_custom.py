"""The custom change source against a real websocket upstream on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from app.protocol.canonical_json import dumps, loads
from app.protocol.messages import Begin, ChangeSourceMessage, Commit, Control, Data, Status
from app.sources.base import ChangeSourceError
from app.sources.custom import (
    MAX_CLOSE_REASON_BYTES,
    CustomChangeSource,
    CustomChangeStream,
    close_reason,
    stream_url,
)

Handler = Callable[[ServerConnection], Awaitable[None]]

REL = {"schema": "public", "name": "foo", "rowKey": {"columns": ["id"], "type": "default"}}
TX = [
    ["begin", {"tag": "begin", "json": "p"}, {"commitWatermark": "0b"}],
    ["data", {"tag": "insert", "relation": REL, "new": {"id": "a", "big": 2**70}}],
    ["commit", {"tag": "commit", "commitTimeMs": 1764426733675}, {"watermark": "0b"}],
    ["status", {"ack": True}, {"watermark": "0c"}],
    ["control", {"tag": "reset-required", "message": "start over"}],
]


class Upstream:
    """What the fake upstream saw: handshake requests and frames from the client."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.received: list[str | bytes] = []
        self.close_codes: list[int | None] = []
        self.close_reasons: list[str | None] = []
        self.url = ""


@contextlib.asynccontextmanager
async def upstream(handler: Handler, **serve_kwargs: Any) -> AsyncIterator[Upstream]:
    seen = Upstream()

    async def recording_handler(ws: ServerConnection) -> None:
        assert ws.request is not None
        seen.requests.append(ws.request)
        try:
            await handler(ws)
        finally:
            seen.close_codes.append(ws.close_code)
            seen.close_reasons.append(ws.close_reason)

    async with serve(
        recording_handler, "127.0.0.1", 0, ping_interval=None, close_timeout=1, **serve_kwargs
    ) as server:
        port = server.sockets[0].getsockname()[1]
        seen.url = f"ws://127.0.0.1:{port}/changes/v0/stream"
        yield seen


def make_source(url: str, **kwargs: Any) -> CustomChangeSource:
    options: dict[str, Any] = {
        "app_id": "zero",
        "shard_num": 3,
        "publications": ["pub_a", "pub_b"],
        "replica_version": "01",
        "connect_timeout_s": 5.0,
    }
    options.update(kwargs)
    return CustomChangeSource(url, **options)


async def collect(stream: CustomChangeStream) -> list[ChangeSourceMessage]:
    return [m async for m in stream]


async def read_until_closed(ws: ServerConnection) -> None:
    """Reads (and drops) client frames until the client closes."""
    with contextlib.suppress(ConnectionClosed):
        async for _ in ws:
            pass


async def send_then_close(ws: ServerConnection) -> None:
    for message in TX:
        await ws.send(dumps(message))
    await ws.close()


# --- URL and handshake -----------------------------------------------------------------


def test_stream_url_keeps_the_query_and_adds_the_protocol_parameters() -> None:
    url = stream_url(
        "wss://cs.example.com/changes/v0/stream?apiKey=s3cret&x=1",
        app_id="zero",
        shard_num=0,
        publications=["a", "b"],
        last_watermark="4d7lu8",
        replica_version="4d7lu0",
    )
    parts = urlsplit(url)
    assert (parts.scheme, parts.netloc, parts.path) == (
        "wss",
        "cs.example.com",
        "/changes/v0/stream",
    )
    assert parse_qsl(parts.query) == [
        ("apiKey", "s3cret"),
        ("x", "1"),
        ("appID", "zero"),
        ("shardNum", "0"),
        ("publications", "a"),
        ("publications", "b"),
        ("lastWatermark", "4d7lu8"),
        ("replicaVersion", "4d7lu0"),
    ]


def test_stream_url_replaces_protocol_parameters_already_in_the_url() -> None:
    url = stream_url(
        "ws://h/s?appID=old&publications=p0&shardNum=9&shardNum=8",
        app_id="zero",
        shard_num=1,
        publications=["p1"],
        last_watermark="0a",
        replica_version="01",
    )
    assert parse_qsl(urlsplit(url).query) == [
        ("appID", "zero"),
        ("publications", "p0"),
        ("shardNum", "1"),
        ("publications", "p1"),
        ("lastWatermark", "0a"),
        ("replicaVersion", "01"),
    ]


def test_stream_url_for_initial_sync_has_no_watermarks() -> None:
    url = stream_url(
        "ws://h/s",
        app_id="zero",
        shard_num=0,
        publications=[],
        last_watermark=None,
        replica_version=None,
    )
    assert parse_qsl(urlsplit(url).query) == [("appID", "zero"), ("shardNum", "0")]


def test_stream_url_turns_http_into_ws_and_encodes_values() -> None:
    url = stream_url(
        "https://h/s",
        app_id="my app",
        shard_num=0,
        publications=["a&b"],
        last_watermark="0a",
        replica_version="01",
    )
    assert url.startswith("wss://h/s?appID=my+app&")
    assert ("publications", "a&b") in parse_qsl(urlsplit(url).query)


@pytest.mark.parametrize(
    "url", ["http//no-scheme", "ftp://h/s", "ws:///no-host", "ws://h/s#fragment"]
)
def test_source_rejects_an_unusable_url(url: str) -> None:
    with pytest.raises(ValueError, match="custom change source URL"):
        make_source(url)


async def test_start_stream_sends_the_query_parameters() -> None:
    async with upstream(read_until_closed) as up:
        source = make_source(up.url + "?apiKey=k%20y")
        stream = await source.start_stream("0a", [])
        await stream.close()
    path = up.requests[0].path
    assert urlsplit(path).path == "/changes/v0/stream"
    assert parse_qsl(urlsplit(path).query) == [
        ("apiKey", "k y"),
        ("appID", "zero"),
        ("shardNum", "3"),
        ("publications", "pub_a"),
        ("publications", "pub_b"),
        ("lastWatermark", "0a"),
        ("replicaVersion", "01"),
    ]
    assert "Authorization" not in up.requests[0].headers


async def test_credentials_in_the_url_become_basic_auth() -> None:
    async with upstream(read_until_closed) as up:
        url = up.url.replace("ws://", "ws://alice:p%40ss@")
        stream = await make_source(url).start_stream("0a", [])
        await stream.close()
    request = up.requests[0]
    # Sent as written in the URL, like zero's `ws` client; never in the request line.
    expected = base64.b64encode(b"alice:p%40ss").decode()
    assert request.headers["Authorization"] == f"Basic {expected}"
    assert "alice" not in request.path


async def test_a_user_without_password_is_sent_with_an_empty_password() -> None:
    async with upstream(read_until_closed) as up:
        stream = await make_source(up.url.replace("ws://", "ws://token@")).start_stream("0a", [])
        await stream.close()
    expected = base64.b64encode(b"token:").decode()
    assert up.requests[0].headers["Authorization"] == f"Basic {expected}"


async def test_a_rejected_handshake_is_a_change_source_error() -> None:
    def unauthorized(ws: ServerConnection, request: Request) -> Response:
        return Response(401, "Unauthorized", Headers(), b"no\n")

    async with upstream(read_until_closed, process_request=unauthorized) as up:
        with pytest.raises(ChangeSourceError, match=r"cannot connect.*401"):
            await make_source(up.url + "?apiKey=secret").start_stream("0a", [])


async def test_connection_errors_do_not_reveal_the_query_string() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    source = make_source(f"ws://u:pw@127.0.0.1:{port}/changes/v0/stream?apiKey=secret")
    with pytest.raises(ChangeSourceError, match="cannot connect") as info:
        await source.start_stream("0a", [])
    assert "secret" not in str(info.value)
    assert "pw" not in str(info.value)


async def test_backfill_requests_are_rejected() -> None:
    source = make_source("ws://127.0.0.1:9/changes/v0/stream")
    request = {"table": {"schema": "public", "name": "t", "metadata": None}, "columns": {"c": {}}}
    with pytest.raises(ChangeSourceError, match="custom change sources do not support backfill"):
        await source.start_stream("0a", [request])


# --- inbound frames ---------------------------------------------------------------------


async def test_frames_are_parsed_and_yielded_in_order() -> None:
    async with upstream(send_then_close) as up:
        stream = await make_source(up.url).start_stream("0a", [])
        messages = await collect(stream)
        await stream.close()
    assert [type(m) for m in messages] == [Begin, Data, Commit, Status, Control]
    assert [m.as_list() for m in messages] == TX
    assert isinstance(messages[0], Begin)
    assert messages[0].commit_watermark == "0b"


async def test_a_clean_close_by_the_server_ends_iteration() -> None:
    async def close_normally(ws: ServerConnection) -> None:
        await ws.close(1000, "done")

    async with upstream(close_normally) as up:
        stream = await make_source(up.url).start_stream("0a", [])
        assert await collect(stream) == []
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        await stream.close()


async def test_an_error_close_by_the_server_fails_the_stream() -> None:
    async def close_with_error(ws: ServerConnection) -> None:
        await ws.send(dumps(TX[0]))
        await ws.close(4000, "upstream restarting")

    async with upstream(close_with_error) as up:
        stream = await make_source(up.url).start_stream("0a", [])
        assert isinstance(await stream.__anext__(), Begin)
        with pytest.raises(ChangeSourceError, match="upstream restarting"):
            await stream.__anext__()
        await stream.close()


async def fails_with(frame: str | bytes) -> tuple[ChangeSourceError, Upstream]:
    async def send_bad_frame(ws: ServerConnection) -> None:
        await ws.send(dumps(TX[0]))
        await ws.send(frame)
        await read_until_closed(ws)

    async with upstream(send_bad_frame) as up:
        stream = await make_source(up.url).start_stream("0a", [])
        assert isinstance(await stream.__anext__(), Begin)
        with pytest.raises(ChangeSourceError) as info:
            await stream.__anext__()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        await stream.close()
    return info.value, up


async def test_a_binary_frame_fails_the_stream_and_closes_with_unsupported_data() -> None:
    error, up = await fails_with(b"\x00\x01")
    assert "binary frame" in str(error)
    assert up.close_codes == [1003]
    assert up.close_reasons[0] is not None
    assert "binary frame" in up.close_reasons[0]


async def test_invalid_json_fails_the_stream_and_closes_with_invalid_data() -> None:
    error, up = await fails_with('["begin", {')
    assert "invalid JSON" in str(error)
    assert up.close_codes == [1007]


async def test_an_invalid_message_fails_the_stream_naming_the_problem() -> None:
    error, up = await fails_with(dumps(["data", {"tag": "insert", "relation": REL}]))
    assert "invalid change-source message" in str(error)
    assert "'new'" in str(error)
    assert up.close_codes == [1007]
    reason = up.close_reasons[0]
    assert reason is not None
    assert len(reason.encode()) <= MAX_CLOSE_REASON_BYTES


async def test_a_broken_watermark_rule_fails_the_stream_and_closes_with_1008() -> None:
    error, up = await fails_with(dumps(["commit", {"tag": "commit"}, {"watermark": "0c"}]))
    assert str(error).endswith(
        "sent a commit with watermark 0c, not its begin's commitWatermark 0b"
    )
    assert up.close_codes == [1008]


async def test_the_rules_start_from_the_streams_last_watermark() -> None:
    async with upstream(send_then_close) as up:
        stream = await make_source(up.url).start_stream("0b", [])  # TX begins at 0b
        with pytest.raises(ChangeSourceError, match="not after lastWatermark 0b"):
            await stream.__anext__()
        await stream.close()


async def test_an_initial_sync_stream_has_no_position() -> None:
    async with upstream(send_then_close) as up:
        stream = await make_source(up.url, replica_version=None).start_initial_sync()
        assert [type(m) for m in await collect(stream)] == [Begin, Data, Commit, Status, Control]
        await stream.close()
    query = dict(parse_qsl(urlsplit(up.requests[0].path).query))
    assert "lastWatermark" not in query
    assert "replicaVersion" not in query


async def test_streaming_needs_a_replica_version() -> None:
    source = make_source("ws://127.0.0.1:9/changes/v0/stream", replica_version=None)
    with pytest.raises(ChangeSourceError, match="the initial sync comes first"):
        await source.start_stream("0a", [])


async def test_a_long_problem_is_cut_to_fit_the_close_frame() -> None:
    huge = dumps(["begin", {"tag": "begin", "json": "x" * 500}, {"commitWatermark": "0b"}])
    error, up = await fails_with(huge)
    assert "'json'" in str(error)
    reason = up.close_reasons[0]
    assert reason is not None
    assert reason.endswith("...")
    assert len(reason.encode()) <= MAX_CLOSE_REASON_BYTES


def test_close_reason_cuts_at_a_character_boundary() -> None:
    assert close_reason("short") == "short"
    cut = close_reason("é" * 100)  # 200 bytes, two per character
    assert cut.endswith("...")
    assert len(cut.encode()) <= MAX_CLOSE_REASON_BYTES
    assert set(cut[:-3]) == {"é"}


# --- acks -------------------------------------------------------------------------------


async def test_acks_are_sent_as_text_frames() -> None:
    got = asyncio.Queue[str | bytes]()

    async def record_acks(ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                got.put_nowait(frame)

    ack = ["status", {"tag": "commit", "commitTimeMs": 1764426733675}, {"watermark": "0b"}]
    async with upstream(record_acks) as up:
        stream = await make_source(up.url).start_stream("0a", [])
        stream.ack(ack)
        frame = await got.get()
        await stream.close()
    assert isinstance(frame, str)
    assert loads(frame) == ack
    assert frame == dumps(ack)


async def test_acks_after_close_are_dropped() -> None:
    async with upstream(read_until_closed) as up:
        stream = await make_source(up.url).start_stream("0a", [])
        await stream.close()
        stream.ack(["status", {"ack": True}, {"watermark": "0b"}])
        assert stream.ack_sender.pending is None


# --- close and liveness -----------------------------------------------------------------


async def test_close_is_idempotent_and_ends_iteration() -> None:
    async with upstream(read_until_closed) as up:
        stream = await make_source(up.url).start_stream("0a", [])
        await stream.close()
        await stream.close()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
    assert up.close_codes == [1000]


async def test_close_stops_a_pending_iteration() -> None:
    async with upstream(read_until_closed) as up:
        stream = await make_source(up.url).start_stream("0a", [])
        reader = asyncio.create_task(collect(stream))
        await asyncio.sleep(0)  # let the reader wait for a frame
        await stream.close()
        assert await reader == []


async def test_a_peer_that_stops_answering_pings_fails_the_stream() -> None:
    release = asyncio.Event()

    async def go_silent(ws: ServerConnection) -> None:
        # The server stops reading the socket, so the client's pings get no pong.
        ws.transport.pause_reading()
        await release.wait()
        ws.transport.resume_reading()

    async with upstream(go_silent) as up:
        stream = await make_source(up.url, ping_interval_s=0.02).start_stream("0a", [])
        try:
            with pytest.raises(ChangeSourceError, match="not even a pong"):
                await stream.__anext__()
        finally:
            release.set()
            await stream.close()


async def test_pongs_keep_a_quiet_connection_alive() -> None:
    async def quiet_then_send(ws: ServerConnection) -> None:
        # Many ping intervals without a message: only the pongs show the peer is alive.
        # The silence is the behaviour under test.
        await asyncio.sleep(0.3)
        await send_then_close(ws)

    async with upstream(quiet_then_send) as up:
        stream = await make_source(up.url, ping_interval_s=0.02).start_stream("0a", [])
        messages = await collect(stream)
        await stream.close()
    assert [m.as_list() for m in messages] == TX


async def test_only_the_newest_ack_reaches_the_upstream() -> None:
    got = asyncio.Queue[str | bytes]()

    async def record(ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                got.put_nowait(frame)

    async with upstream(record) as up:
        stream = await make_source(up.url).start_stream("0a", [])
        # No await in between: the writer task cannot run, so only the newest is kept.
        for wm in ("0b", "0c", "0d"):
            stream.ack(["status", {"ack": True}, {"watermark": wm}])
        assert stream.ack_sender.coalesced == 2
        first = await got.get()
        await stream.close()
    assert first == dumps(["status", {"ack": True}, {"watermark": "0d"}])
    assert got.empty()  # the server read everything before the handler ended
