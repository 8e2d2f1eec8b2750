"""Bad input and bad clients: the server keeps serving everyone else and loses nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from pathlib import Path

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from app.protocol.canonical_json import loads
from app.protocol.errors import ErrorType
from app.protocol.lexi import to_lexi
from app.server import transport as transport_module
from app.server import ws_protocol as ws_protocol_module
from app.streamer import forwarder as forwarder_module
from app.streamer import subscriber as subscriber_module

from ..waiting import eventually
from .conftest import Server, start_server
from .test_replication_ws import QUERY, txn


async def follow(ws: ClientConnection, until: str) -> list[str]:
    """Reads and acks until the commit ``until``; returns the commit watermarks seen."""
    commits: list[str] = []
    while True:
        frame = loads(await asyncio.wait_for(ws.recv(), 20))
        await ws.send(f'{{"ack":{frame["id"]}}}')
        msg = frame["msg"]
        if msg[0] == "error":
            raise AssertionError(f"unexpected error: {msg}")
        if msg[0] == "commit":
            commits.append(msg[2]["watermark"])
            if msg[2]["watermark"] == until:
                return commits


# The server closes while the client is still writing the frame, so the client's
# transport reports a connection reset from a callback: expected here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_an_oversized_frame_closes_only_that_connection(server: Server) -> None:
    async with (
        connect(f"{server.url}/replication/v6/changes?{QUERY}") as good,
        connect(
            f"{server.url}/replication/v6/changes?{QUERY.replace('-1', '-2')}", max_size=None
        ) as big,
    ):
        await good.recv()
        await big.recv()
        with pytest.raises(ConnectionClosed) as e:
            await big.send("x" * (17 * 1024 * 1024))  # uvicorn's limit is 16 MiB
            await asyncio.wait_for(big.recv(), 20)
        assert e.value.rcvd is not None
        assert e.value.rcvd.code == 1009  # message too big
        await good.send('{"ack":1}')
        stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
        stream.push_all(txn("02"))
        assert await follow(good, "02") == ["02"]


async def test_a_client_that_stops_reading_is_dropped_and_others_continue(tmp_path: Path) -> None:
    # Three subscribers: with two, "majority" is both, and flow control would wait
    # for the stuck one until its pings time out (as in the reference).
    async for server in start_server(tmp_path, max_unconsumed_bytes=192 * 1024):
        base = f"{server.url}/replication/v6/changes?replicaVersion=01&watermark=01"
        async with (
            connect(f"{base}&id=good-1") as good1,
            connect(f"{base}&id=good-2") as good2,
            connect(f"{base}&id=stuck", max_queue=1) as stuck,
        ):
            for ws in (good1, good2):
                await ws.recv()
                await ws.send('{"ack":1}')
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
            final = to_lexi(2 + 149)
            for n in range(2, 2 + 150):
                stream.push_all(txn(to_lexi(n), 20))
            # The stuck client never reads or acks; the healthy ones get everything.
            expected = [to_lexi(n) for n in range(2, 2 + 150)]
            results = await asyncio.gather(follow(good1, final), follow(good2, final))
            assert list(results) == [expected, expected]
            await eventually(
                lambda: len(server.service.forwarder.active) == 2,  # noqa: B023 (awaited here)
                "the stuck client to be dropped",
            )
            assert {s.id for s in server.service.forwarder.active} == {"good-1", "good-2"}
            del stuck


async def read_until_error(ws: ClientConnection) -> dict[str, object]:
    """Reads without acking until an in-band error; returns its body."""
    while True:
        msg = loads(await asyncio.wait_for(ws.recv(), 20))["msg"]
        if msg[0] == "error":
            return dict(msg[1])


async def messages_until_closed(ws: ClientConnection) -> list[list[object]]:
    """Reads without acking until the server closes; the messages read."""
    received: list[list[object]] = []
    with contextlib.suppress(ConnectionClosed):
        for _ in range(1_000_000):
            received.append(list(loads(await asyncio.wait_for(ws.recv(), 20))["msg"]))
    return received


async def closed_by_server(ws: ClientConnection) -> None:
    """Reads whatever is buffered until the server's close or abort shows."""
    with pytest.raises(ConnectionClosed):
        for _ in range(1_000_000):
            await asyncio.wait_for(ws.recv(), 20)


async def test_stuck_subscribers_that_block_the_majority_are_dropped_after_the_grace_period(
    tmp_path: Path,
) -> None:
    # One healthy subscriber and two stuck ones: no majority ever consumes a
    # checkpoint, so no consensus timer is armed; before the stuck rule the healthy
    # one got nothing more until the stuck ones went away.
    async for server in start_server(tmp_path, slow_subscriber_grace_s=1.0):
        # v7: StreamTooFarBehind is a v7 error type (a v6 client is closed plainly).
        base = f"{server.url}/replication/v7/changes?replicaVersion=01&watermark=01"
        async with (
            connect(f"{base}&id=good") as good,
            connect(f"{base}&id=no-acks") as no_acks,
            connect(f"{base}&id=no-reads", max_queue=1) as no_reads,
        ):
            # All three ack their status (a client that acks nothing at all is not
            # waited for, and goes after FIRST_ACK_TIMEOUT_S); then two stop.
            for ws in (good, no_acks, no_reads):
                await ws.recv()
                await ws.send('{"ack":1}')
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
            count = 150
            for n in range(2, 2 + count):
                stream.push_all(txn(to_lexi(n), 20))
            expected = [to_lexi(n) for n in range(2, 2 + count)]
            reading = asyncio.create_task(read_until_error(no_acks))
            assert await follow(good, expected[-1]) == expected
            error = await reading
            assert error["type"] == int(ErrorType.STREAM_TOO_FAR_BEHIND)
            assert "held up flow control for over 1000ms" in str(error["message"])
            await closed_by_server(no_acks)
            await closed_by_server(no_reads)
            assert {s.id for s in server.service.forwarder.active} == {"good"}
            # The stream goes on at full pace for the one left.
            stream.push_all(txn(to_lexi(2 + count), 20))
            assert await follow(good, to_lexi(2 + count)) == [to_lexi(2 + count)]


async def test_a_dropped_client_that_does_not_read_is_disconnected_and_its_bytes_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Shorter bounds than the defaults (5 s each), so the test waits less.
    monkeypatch.setattr(subscriber_module, "ERROR_DELIVERY_S", 0.5)
    monkeypatch.setattr(transport_module, "CLOSE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(ws_protocol_module, "CLOSE_FLUSH_S", 0.5)
    async for server in start_server(tmp_path, slow_subscriber_grace_s=1.0):
        base = f"{server.url}/replication/v6/changes?replicaVersion=01&watermark=01"
        async with (
            connect(f"{base}&id=good", max_size=None) as good,
            connect(f"{base}&id=no-reads", max_queue=1, max_size=None) as no_reads,
        ):
            for ws in (good, no_reads):  # both ack their status; one then stops reading
                await ws.recv()
                await ws.send('{"ack":1}')
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
            # Values far larger than the sockets' kernel buffers: what the client does
            # not read stays queued in the server process until it is disconnected.
            big = "x" * (2 * 1024 * 1024)
            watermarks = [to_lexi(n) for n in range(2, 8)]
            for w in watermarks:
                stream.push_all(big_txn(w, big))
            assert await follow(good, watermarks[-1]) == watermarks
            await eventually(  # its socket is closed while it still reads nothing
                lambda: server.connections() == 1,  # noqa: B023 (awaited here)
                "one connection left",
                20.0,
            )
            assert server.connections() == 1
            assert {s.id for s in server.service.forwarder.active} == {"good"}
            del no_reads


def big_txn(w: str, value: str) -> list[list[object]]:
    """``txn(w)`` with one insert of ``value``."""
    begin, data, commit = txn(w, 1)
    data[1]["new"] = {"id": 1, "v": value}
    return [begin, data, commit]


@pytest.mark.parametrize("version", [6, 7])
async def test_a_sole_subscriber_that_stops_acking_is_dropped_and_can_resume(
    tmp_path: Path, version: int
) -> None:
    async for server in start_server(tmp_path, slow_subscriber_grace_s=1.0):
        base = f"{server.url}/replication/v{version}/changes?replicaVersion=01&watermark=01"
        async with connect(f"{base}&id=alone") as alone:
            await alone.recv()
            await alone.send('{"ack":1}')  # its status; then it acks nothing more
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
            count = 150
            for n in range(2, 2 + count):
                stream.push_all(txn(to_lexi(n), 20))
            if version >= 7:
                error = await read_until_error(alone)
                assert error["type"] == int(ErrorType.STREAM_TOO_FAR_BEHIND)
            else:  # v6 knows no such error type: a plain close, then it resumes
                received = await messages_until_closed(alone)
                assert "error" not in {m[0] for m in received}
            await closed_by_server(alone)
        # Everything was stored meanwhile: a new connection catches up on all of it.
        async with connect(f"{base}&id=alone") as again:
            await again.recv()
            await again.send('{"ack":1}')
            expected = [to_lexi(n) for n in range(2, 2 + count)]
            assert await follow(again, expected[-1]) == expected


async def test_200_subscribers_churning_do_not_disturb_a_steady_one(server: Server) -> None:
    rng = random.Random(7)
    async with connect(f"{server.url}/replication/v6/changes?{QUERY}") as steady:
        await steady.recv()
        await steady.send('{"ack":1}')
        stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
        steady_commits = asyncio.create_task(follow(steady, to_lexi(41)))

        async def churn(i: int) -> None:
            url = f"{server.url}/replication/v6/changes?id=churn-{i}&replicaVersion=01&watermark=01"
            # max_queue=None: a client that stops reading with a full queue would
            # not see the server's close frame and wait out its close timeout.
            async with connect(url, max_queue=None) as ws:
                for _ in range(rng.randint(0, 3)):
                    frame = loads(await asyncio.wait_for(ws.recv(), 20))
                    await ws.send(f'{{"ack":{frame["id"]}}}')

        async def produce() -> None:
            for n in range(2, 42):
                stream.push_all(txn(to_lexi(n), 3))
                # Paced, not a wait: the commits must spread across the churn.
                await asyncio.sleep(0.005)

        producer = asyncio.create_task(produce())
        for batch in range(10):
            await asyncio.gather(*(churn(batch * 20 + i) for i in range(20)))
        await producer
        assert await steady_commits == [to_lexi(n) for n in range(2, 42)]
    await eventually(
        lambda: not server.service.forwarder.active and not server.service.forwarder.queued,
        "every subscriber to be gone",
    )
    assert not server.service.forwarder.active
    assert not server.service.forwarder.queued


@pytest.mark.parametrize("frame", ['{"ack":1}', '{"ack":3}'])
async def test_a_duplicate_or_skipping_ack_closes_the_stream(
    server: Server, frame: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.server.transport")
    async with connect(f"{server.url}/replication/v6/changes?{QUERY}") as ws:
        await ws.recv()
        await ws.send('{"ack":1}')
        stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
        stream.push_all(txn("02"))
        await ws.recv()
        await ws.send(frame)  # a duplicate of 1, or 3 before 2
        with pytest.raises(ConnectionClosed) as e:
            while True:
                await asyncio.wait_for(ws.recv(), 10)
        assert e.value.rcvd is not None
        assert e.value.rcvd.code == 1005  # a plain close once streaming began
        assert "closing stream: unexpected ack" in caplog.text


async def test_a_client_that_acks_nothing_is_not_waited_for_and_goes_after_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(forwarder_module, "FIRST_ACK_TIMEOUT_S", 2.0)
    async for server in start_server(tmp_path):
        base = f"{server.url}/replication/v6/changes?replicaVersion=01&watermark=01"
        async with (
            connect(f"{base}&id=good") as good,
            connect(f"{base}&id=silent", max_queue=1) as silent,
        ):
            await good.recv()
            await good.send('{"ack":1}')
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
            count = 150
            for n in range(2, 2 + count):
                stream.push_all(txn(to_lexi(n), 20))
            # The default grace period is 30 s: the good one gets everything at once.
            expected = [to_lexi(n) for n in range(2, 2 + count)]
            assert await follow(good, expected[-1]) == expected
            await eventually(
                lambda: {s.id for s in server.service.forwarder.active} == {"good"},  # noqa: B023 (awaited here)
                "only the good subscriber to be left",
            )
            assert {s.id for s in server.service.forwarder.active} == {"good"}
            del silent
