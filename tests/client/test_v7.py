"""Protocol v7: ChangeStreamerClient.connect / reserve_snapshot / subscribe over /subscribe."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection

from app.client import (
    ChangeStreamerClient,
    ConnectionLostError,
    InvalidMessageError,
    ProtocolError,
    SnapshotStatus,
    StreamTooFarBehindError,
    Subscription,
    SubscriptionContext,
    V7Connection,
    V7ReservationFollowup,
    WrongReplicaVersionError,
)
from app.client.subscription import SubscriptionMessage
from app.client.v7 import V7Message, start_subscription_message
from app.protocol.canonical_json import dumps, loads
from app.protocol.errors import ErrorType
from app.protocol.messages import Begin, Commit, Data
from app.protocol.subscription_messages import DownstreamStatus
from tests.waiting import stays

from .conftest import (
    REPLICA_VERSION,
    TIMEOUT,
    Server,
    StubServer,
    stub_server,
    txn,
    wait_until,
)

BACKUP_URL = "file:///backups/r"  # what the backup_server fixture is configured with


def v7(server: Server | StubServer) -> ChangeStreamerClient:
    return ChangeStreamerClient(server.url, protocol_version=7)


def ctx(watermark: str = REPLICA_VERSION, **kw: Any) -> SubscriptionContext:
    return SubscriptionContext("serving-1", REPLICA_VERSION, watermark, **kw)


async def next_of(sub: Subscription) -> SubscriptionMessage:
    return await asyncio.wait_for(sub.__anext__(), TIMEOUT)


async def next_v7(conn: V7Connection) -> V7Message:
    return await asyncio.wait_for(conn.__anext__(), TIMEOUT)


async def next_change(conn: V7Connection) -> SubscriptionMessage:
    """``next_v7`` on a subscription's connection: never a snapshot status there."""
    message = await next_v7(conn)
    assert not isinstance(message, SnapshotStatus)
    return message


async def reserve(server: Server, task_id: str = "t1") -> tuple[SnapshotStatus, Any]:
    """Reserves over v7; a backup at 02 (which also opens the coverage gate, so the
    stream starts) confirms it so ``reserved`` comes, and 02 is stored."""
    reserving = asyncio.create_task(v7(server).reserve_snapshot(task_id))
    await wait_until(
        lambda: server.service.reservations.is_open(task_id), "the reservation to open"
    )
    server.service.backups.track("02")
    stream = await asyncio.wait_for(server.source.wait_for_stream(), TIMEOUT)
    stream.push_all(txn("02"))
    await asyncio.wait_for(server.service.storer.wait_durable("02"), TIMEOUT)
    return await asyncio.wait_for(reserving, TIMEOUT)


# -- against the real server ------------------------------------------------------------


async def test_reserve_then_subscribe_on_the_same_socket(backup_server: Server) -> None:
    server = backup_server
    status, followup = await reserve(server)
    assert status == SnapshotStatus(
        backup_url=BACKUP_URL, replica_version=REPLICA_VERSION, min_watermark="02", body=status.body
    )
    assert status.body["tag"] == "snapshot"
    assert isinstance(followup, V7ReservationFollowup)
    conn = followup.connection
    assert conn.url == f"{server.url}/replication/v7/subscribe?taskID=t1"
    assert (conn.last_sent, conn.last_acked) == (1, 1)  # reserve-snapshot, acked
    assert server.service.reservations.reserved_watermarks() == ["02"]
    assert not followup.closed.is_set()

    sub = await followup.subscribe(ctx("02", task_id="ignored"))
    async with sub:
        assert sub.url == conn.url
        assert (sub.ctx.task_id, sub.ctx.initial) == ("t1", True)
        assert isinstance(await next_of(sub), DownstreamStatus)
        # start-subscription went out as our frame 2 on the same socket; once the
        # server acted on it, the subscriber replaced the reservation.
        await wait_until(lambda: conn.last_acked == 2, "the ack of start-subscription")
        assert conn.last_sent == 2
        assert server.service.reservations.reserved_watermarks() == []
        stream = server.source.streams[0]
        stream.push_all([*txn("03", 100), *txn("04", 100)])
        got = [await next_of(sub) for _ in range(204)]
        frames = conn.frames_received
        assert not followup.closed.is_set()
    await asyncio.wait_for(followup.wait_closed(), TIMEOUT)
    assert not followup.aborted
    assert followup.close_error is None

    assert [m.kind for m in got] == [
        "begin",
        *["data"] * 100,
        "commit",
        "begin",
        *["data"] * 100,
        "commit",
    ]
    assert isinstance(got[0], Begin)
    assert got[0].commit_watermark == "03"
    assert isinstance(got[1], Data)
    assert [m.body["new"]["id"] for m in got[1:101] if isinstance(m, Data)] == [
        f"03-{i}" for i in range(100)
    ]
    assert isinstance(got[101], Commit)
    assert got[101].watermark == "03"
    assert isinstance(got[203], Commit)
    assert got[203].watermark == "04"
    # reserved + status + 204 messages came in fewer frames: batches were flattened.
    assert frames < 206


async def test_frames_are_acked_only_after_their_messages_were_consumed(
    backup_server: Server,
) -> None:
    server = backup_server
    server.service.backups.track(REPLICA_VERSION)  # a backup: the stream may start
    async with await v7(server).subscribe(ctx(task_id="t1")) as sub:
        assert isinstance(await next_of(sub), DownstreamStatus)
        stream = await asyncio.wait_for(server.source.wait_for_stream(), TIMEOUT)
        stream.push_all(txn("02", 3))
        got = [await next_of(sub) for _ in range(5)]
        assert isinstance(got[-1], Commit)
        await asyncio.wait_for(server.service.storer.wait_durable("02"), TIMEOUT)
        # The commit was received but the caller has not asked past it yet.
        await stays(
            lambda: server.service.forwarder.acks() == [REPLICA_VERSION], 0.3, "no ack of 02 yet"
        )
        assert server.service.forwarder.acks() == [REPLICA_VERSION]
        # Asking for the next message acks the frame that held the commit.
        stream.push_all(txn("03"))
        assert isinstance(await next_of(sub), Begin)
        await wait_until(lambda: server.service.forwarder.acks() == ["02"], "the ack of 02")


async def test_cancel_before_subscribing_cancels_the_reservation(backup_server: Server) -> None:
    server = backup_server
    _, followup = await reserve(server, "t9")
    assert server.service.reservations.reserved_watermarks() == ["02"]
    await asyncio.wait_for(followup.cancel(), TIMEOUT)
    await followup.cancel()  # idempotent
    assert followup.closed.is_set()
    assert not followup.aborted
    await wait_until(
        lambda: server.service.reservations.reserved_watermarks() == [],
        "the server to cancel the reservation",
    )
    with pytest.raises(RuntimeError, match="already called"):
        await followup.subscribe(ctx("02"))


async def test_a_direct_subscription_streams_status_then_transactions(server: Server) -> None:
    client = v7(server)
    async with await client.subscribe(ctx(task_id="t2")) as sub:
        assert sub.url == f"{server.url}/replication/v7/subscribe?taskID=t2"
        assert isinstance(await next_of(sub), DownstreamStatus)
        stream = await asyncio.wait_for(server.source.wait_for_stream(), TIMEOUT)
        stream.push_all([*txn("02", 2), *txn("03")])
        got = [await next_of(sub) for _ in range(7)]
        await wait_until(lambda: server.service.forwarder.acks() != [], "the subscriber")
    assert [m.kind for m in got] == ["begin", "data", "data", "commit", "begin", "data", "commit"]
    assert isinstance(got[6], Commit)
    assert got[6].watermark == "03"


async def test_the_low_level_connection_sends_and_tracks_acks(server: Server) -> None:
    async with await v7(server).connect("t3") as conn:
        frame_id = await asyncio.wait_for(
            conn.send(start_subscription_message(ctx(task_id="t3"))), TIMEOUT
        )
        assert frame_id == 1
        assert conn.last_acked == 1  # send() returned: the server acked it
        assert isinstance(await next_v7(conn), DownstreamStatus)
    assert conn.closed.is_set()
    assert conn.end_error is None
    with pytest.raises(StopAsyncIteration):
        await next_v7(conn)
    with pytest.raises(ConnectionLostError, match="closed"):
        await conn.send(["reserve-snapshot", {"taskID": "t3"}])


async def test_a_wrong_replica_version_raises_the_typed_error(server: Server) -> None:
    sub = await v7(server).subscribe(SubscriptionContext("x", "0z", "0z", task_id="t4"))
    with pytest.raises(WrongReplicaVersionError) as e:
        await next_of(sub)
    assert e.value.error_type is ErrorType.WRONG_REPLICA_VERSION
    assert e.value.message == "current replica version is 01 (requested 0z)"
    assert sub.closed
    with pytest.raises(StopAsyncIteration):
        await next_of(sub)


async def test_the_low_level_iterator_raises_in_band_errors(server: Server) -> None:
    conn = await v7(server).connect("t5")
    wrong = SubscriptionContext("x", "0z", "0z", task_id="t5")
    await conn.send(start_subscription_message(wrong), wait_for_ack=False)
    with pytest.raises(WrongReplicaVersionError):
        await next_v7(conn)
    assert conn.closed.is_set()


async def test_the_replica_version_probe_works_over_v7(server: Server) -> None:
    # The probe's context has no task ID: the subscriber id stands in for it.
    assert await asyncio.wait_for(v7(server).probe_replica_version(), TIMEOUT) == REPLICA_VERSION


async def test_reserving_without_backups_raises_protocol_error(server: Server) -> None:
    with pytest.raises(ProtocolError) as e:
        await asyncio.wait_for(v7(server).reserve_snapshot("t1"), TIMEOUT)
    assert e.value.reason == (
        "Error: replication-manager is not configured with a ZERO_LITESTREAM_BACKUP_URL"
    )


async def test_a_1002_close_fails_the_send_and_the_iteration(server: Server) -> None:
    conn = await v7(server).connect("t6")
    with pytest.raises(ProtocolError) as e:
        await asyncio.wait_for(conn.send(["hello", {}]), TIMEOUT)
    assert e.value.reason == "Error: unknown message type 'hello'"
    with pytest.raises(ProtocolError):
        await next_v7(conn)
    with pytest.raises(StopAsyncIteration):
        await next_v7(conn)


def test_the_endpoint_follows_the_protocol_version() -> None:
    v6 = ChangeStreamerClient("http://h:1/some/path?q=1")
    assert not v6.uses_subscribe
    # connect() is v7 whatever the client's version; a later version keeps its number.
    assert v6.subscribe_url("t") == "ws://h:1/replication/v7/subscribe?taskID=t"
    assert v6.subscribe_url() == "ws://h:1/replication/v7/subscribe"
    v8 = ChangeStreamerClient("ws://h:1", protocol_version=8)
    assert v8.uses_subscribe
    assert v8.subscribe_url("t") == "ws://h:1/replication/v8/subscribe?taskID=t"


async def test_the_default_protocol_is_still_v6(server: Server) -> None:
    async with await ChangeStreamerClient(server.url).subscribe(ctx()) as sub:
        assert "/replication/v6/changes?" in sub.url
        assert isinstance(await next_of(sub), DownstreamStatus)


# -- exact framing, against stub servers ----------------------------------------------


def _acking(*frames: str) -> Any:
    """A stub that sends ``frames``, then records what arrives and acks each client frame."""

    async def handler(ws: ServerConnection, stub: StubServer) -> None:
        received: list[str | bytes] = []
        stub.received.append(received)
        for f in frames:
            await ws.send(f)
        async for data in ws:
            received.append(data)
            value = loads(data)
            if "id" in value:
                await ws.send(dumps({"ack": value["id"]}))

    return handler


async def test_a_batch_is_acked_after_its_last_message_and_an_empty_one_at_once() -> None:
    begin, data, commit = txn("02")
    frames = (
        dumps({"id": 1, "batch": [["status", {"tag": "status"}], begin, data]}),
        dumps({"id": 2, "batch": []}),
        dumps({"id": 3, "msg": commit}),
    )
    async with stub_server(_acking(*frames)) as stub:
        conn = await v7(stub).connect("t1")
        assert [(await next_change(conn)).kind for _ in range(3)] == ["status", "begin", "data"]
        await conn.send(["marker", {"n": 1}])  # all of frame 1 handed out, none asked past
        assert isinstance(await next_v7(conn), Commit)  # asking past frame 1 (and 2) acks them
        await conn.send(["marker", {"n": 2}])
        await conn.close()
    assert stub.paths == ["/replication/v7/subscribe?taskID=t1"]
    assert [loads(f) for f in stub.received[0]] == [
        {"id": 1, "msg": ["marker", {"n": 1}]},
        {"ack": 1},
        {"ack": 2},
        {"id": 2, "msg": ["marker", {"n": 2}]},
    ]


async def _reserved_then_drop(ws: ServerConnection, stub: StubServer) -> None:
    request = loads(await ws.recv())
    stub.received.append([dumps(request)])
    await ws.send(dumps({"ack": request["id"]}))
    body = {"tag": "snapshot", "backupURL": "s3://b", "replicaVersion": "01", "minWatermark": "02"}
    await ws.send(dumps({"id": 1, "msg": ["reserved", body]}))
    stub.received[0].append(await ws.recv())  # the client's ack of reserved
    await ws.close(1011, "node going away")


async def test_a_socket_lost_before_subscribing_aborts_the_followup() -> None:
    async with stub_server(_reserved_then_drop) as stub:
        status, followup = await asyncio.wait_for(v7(stub).reserve_snapshot("t7"), TIMEOUT)
        assert status.backup_url == "s3://b"
        await asyncio.wait_for(followup.wait_closed(), TIMEOUT)
    assert [loads(f) for f in stub.received[0]] == [
        {"id": 1, "msg": ["reserve-snapshot", {"taskID": "t7"}]},
        {"ack": 1},
    ]
    assert followup.aborted
    assert isinstance(followup.close_error, ConnectionLostError)
    assert followup.close_error.code == 1011
    with pytest.raises(ConnectionLostError, match="node going away"):
        await followup.subscribe(ctx("02"))


async def _bad_ack(ws: ServerConnection, stub: StubServer) -> None:
    await ws.recv()
    await ws.send('{"ack":5}')
    await ws.wait_closed()


async def test_an_ack_for_a_frame_never_sent_is_an_invalid_message() -> None:
    async with stub_server(_bad_ack) as stub:
        conn = await v7(stub).connect("t8")
        with pytest.raises(InvalidMessageError, match="acked frame 5, which was not sent"):
            await asyncio.wait_for(conn.send(["reserve-snapshot", {"taskID": "t8"}]), TIMEOUT)
        assert conn.closed.is_set()


async def test_batches_hand_out_what_arrived_and_ack_when_the_next_batch_is_asked_for() -> None:
    """``Subscription.batches`` (the replicator's way to read): every message received so
    far in one list, frames acked in order only once the caller asks for more, and an
    in-band error after good messages raised only after those were handed out."""
    b2, d2, c2 = txn("02")
    b3, d3, c3 = txn("03")
    too_far = ["error", {"type": ErrorType.STREAM_TOO_FAR_BEHIND, "message": "slow"}]
    frames = (
        dumps({"id": 1, "batch": [["status", {"tag": "status"}], b2, d2]}),
        dumps({"id": 2, "msg": c2}),
        dumps({"id": 3, "batch": [b3, d3, c3]}),
        dumps({"id": 4, "batch": [["status", {"tag": "status"}], too_far]}),
    )
    async with stub_server(_acking(*frames)) as stub:
        conn = await v7(stub).connect("t1")
        await wait_until(lambda: conn.frames_received == 4, "every frame to arrive")
        batches = Subscription(conn, ctx()).batches(limit=5)
        first = await asyncio.wait_for(anext(batches), TIMEOUT)
        assert [m.kind for m in first] == ["status", "begin", "data", "commit", "begin"]
        await conn.send(["marker", {"n": 1}])  # nothing is acked while the caller works
        second = await asyncio.wait_for(anext(batches), TIMEOUT)
        assert [m.kind for m in second] == ["data", "commit", "status"]
        await conn.send(["marker", {"n": 2}])
        with pytest.raises(StreamTooFarBehindError):
            await asyncio.wait_for(anext(batches), TIMEOUT)
    assert [loads(f) for f in stub.received[0]] == [
        {"id": 1, "msg": ["marker", {"n": 1}]},
        {"ack": 1},  # frames 1 and 2 were handed out whole by the first batch
        {"ack": 2},
        {"id": 2, "msg": ["marker", {"n": 2}]},
        {"ack": 3},  # asking past the second batch
        {"ack": 4},  # the error's frame: the server waits for it before closing
    ]
