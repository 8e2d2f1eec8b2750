"""ChangeStreamerClient.subscribe against the real server over loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from http import HTTPStatus

import pytest
from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from app.client import (
    ChangeStreamerClient,
    ConnectFailedError,
    ConnectionLostError,
    InvalidMessageError,
    ProtocolError,
    Subscription,
    SubscriptionContext,
    UnauthorizedError,
    WatermarkTooOldError,
    WrongReplicaVersionError,
)
from app.client.subscription import SubscriptionMessage
from app.protocol.errors import ErrorType
from app.protocol.messages import Begin, Commit, Data
from app.protocol.subscription_messages import DownstreamStatus
from tests.waiting import stays

from .conftest import (
    REPLICA_VERSION,
    TIMEOUT,
    Server,
    StubServer,
    free_port,
    stub_server,
    txn,
    wait_until,
)


def ctx(watermark: str = REPLICA_VERSION, **kw: object) -> SubscriptionContext:
    return SubscriptionContext("sub-1", REPLICA_VERSION, watermark, **kw)  # type: ignore[arg-type]


async def next_of(sub: Subscription) -> SubscriptionMessage:
    return await asyncio.wait_for(sub.__anext__(), TIMEOUT)


async def test_status_then_transactions_as_typed_messages(
    server: Server, client: ChangeStreamerClient
) -> None:
    async with await client.subscribe(ctx()) as sub:
        assert isinstance(await next_of(sub), DownstreamStatus)
        stream = await asyncio.wait_for(server.source.wait_for_stream(), TIMEOUT)
        stream.push_all([*txn("02", 2), *txn("03")])
        got = [await next_of(sub) for _ in range(7)]
    assert [m.kind for m in got] == [
        "begin",
        "data",
        "data",
        "commit",
        "begin",
        "data",
        "commit",
    ]
    assert isinstance(got[0], Begin)
    assert got[0].commit_watermark == "02"
    assert isinstance(got[1], Data)
    assert got[1].body["new"] == {"id": "02-0", "title": "t0"}
    assert isinstance(got[3], Commit)
    assert got[3].watermark == "02"
    assert isinstance(got[6], Commit)
    assert got[6].watermark == "03"


async def test_the_query_carries_the_context_like_zero(server: Server) -> None:
    client = ChangeStreamerClient(server.url + "/ignored/path?x=1")
    url = client.changes_url(ctx(task_id="T1", initial=True, mode="backup"))
    assert url == (
        f"{server.url}/replication/v6/changes?taskID=T1&id=sub-1&mode=backup"
        f"&watermark={REPLICA_VERSION}&replicaVersion={REPLICA_VERSION}&initial=true"
    )


async def test_a_message_is_acked_only_when_the_caller_asks_for_the_next(
    server: Server, client: ChangeStreamerClient
) -> None:
    async with await client.subscribe(ctx()) as sub:
        await next_of(sub)  # status
        stream = await asyncio.wait_for(server.source.wait_for_stream(), TIMEOUT)
        stream.push_all(txn("02"))
        got = [await next_of(sub) for _ in range(3)]
        assert isinstance(got[-1], Commit)
        await asyncio.wait_for(server.service.storer.wait_durable("02"), TIMEOUT)
        # The commit was received but the caller has not asked past it yet.
        await stays(
            lambda: server.service.forwarder.acks() == [REPLICA_VERSION], 0.3, "no ack of 02 yet"
        )
        assert server.service.forwarder.acks() == [REPLICA_VERSION]
        # Asking for the next message is what acks the commit.
        stream.push_all(txn("03"))
        assert isinstance(await next_of(sub), Begin)
        await wait_until(lambda: server.service.forwarder.acks() == ["02"], "the ack of 02")


async def test_wrong_replica_version_raises_a_typed_error(
    server: Server, client: ChangeStreamerClient
) -> None:
    sub = await client.subscribe(SubscriptionContext("x", "0z", "0z"))
    with pytest.raises(WrongReplicaVersionError) as e:
        await next_of(sub)
    assert e.value.error_type is ErrorType.WRONG_REPLICA_VERSION
    assert e.value.message == "current replica version is 01 (requested 0z)"
    assert str(e.value) == "WrongReplicaVersion: current replica version is 01 (requested 0z)"
    assert sub.closed
    with pytest.raises(StopAsyncIteration):
        await next_of(sub)


async def test_a_purged_watermark_raises_watermark_too_old(
    server: Server, client: ChangeStreamerClient
) -> None:
    async with await client.subscribe(ctx()) as sub:
        await next_of(sub)
        stream = await asyncio.wait_for(server.source.wait_for_stream(), TIMEOUT)
        stream.push_all([*txn("02"), *txn("03"), *txn("04")])
        await asyncio.wait_for(server.service.storer.wait_durable("04"), TIMEOUT)
    deleted = await server.service.change_log.purge_before("04", server.service.task_id)
    assert deleted > 0
    sub = await client.subscribe(ctx("02"))
    with pytest.raises(WatermarkTooOldError) as e:
        await next_of(sub)
    assert e.value.error_type is ErrorType.WATERMARK_TOO_OLD
    assert e.value.message == "earliest supported watermark is 04 (requested 02)"


async def test_a_1002_close_raises_protocol_error_with_the_reason(server: Server) -> None:
    client = ChangeStreamerClient(server.url, protocol_version=99)
    sub = await client.subscribe(ctx())
    with pytest.raises(ProtocolError) as e:
        await next_of(sub)
    assert e.value.reason.startswith(
        "Error: Cannot service client at protocol v99. Supported protocols: [v1 ... v"
    )
    assert sub.closed


async def test_a_v6_request_error_surfaces_on_the_first_message(
    server: Server, client: ChangeStreamerClient
) -> None:
    sub = await client.subscribe(ctx("zz"))
    assert "/replication/v6/changes?" in sub.url
    with pytest.raises(ProtocolError) as e:
        await next_of(sub)
    assert e.value.reason.startswith("Error: invalid querystring - watermark")
    assert sub.closed


async def test_a_server_side_close_ends_the_iteration(
    server: Server, client: ChangeStreamerClient
) -> None:
    async with await client.subscribe(ctx()) as sub:
        await next_of(sub)
        await wait_until(lambda: bool(server.service.forwarder.acks()), "the subscriber")
        server.service.forwarder.close_all()
        with pytest.raises(StopAsyncIteration):
            await next_of(sub)


async def test_close_is_idempotent_and_ends_the_iteration(
    server: Server, client: ChangeStreamerClient
) -> None:
    sub = await client.subscribe(ctx())
    await next_of(sub)
    await sub.close()
    await sub.close()
    assert sub.closed
    with pytest.raises(StopAsyncIteration):
        await next_of(sub)
    await wait_until(lambda: server.service.forwarder.acks() == [], "the server to drop it")


async def test_close_from_another_task_ends_a_waiting_iteration(
    server: Server, client: ChangeStreamerClient
) -> None:
    sub = await client.subscribe(ctx())
    await next_of(sub)
    waiting = asyncio.create_task(next_of(sub))
    # Long enough for it to reach its wait, and seen to be still waiting.
    await stays(lambda: not waiting.done(), 0.05, "the iteration waiting")
    await sub.close()
    with pytest.raises(StopAsyncIteration):
        await waiting


async def test_an_unreachable_server_raises_connect_failed() -> None:
    client = ChangeStreamerClient(f"ws://127.0.0.1:{free_port()}")
    with pytest.raises(ConnectFailedError, match="cannot connect"):
        await client.subscribe(ctx())


# -- behaviour the real server cannot be made to show: raw stub servers --------------


async def _error_then_wait(ws: ServerConnection, stub: StubServer) -> None:
    await ws.send('{"id":1,"msg":["error",{"type":2,"message":"too old"}]}')
    frames: list[str | bytes] = []
    stub.received.append(frames)
    async for frame in ws:
        frames.append(frame)


async def test_an_error_message_is_acked_before_it_is_raised() -> None:
    async with stub_server(_error_then_wait) as stub:
        sub = await ChangeStreamerClient(stub.url).subscribe(ctx())
        with pytest.raises(WatermarkTooOldError):
            await next_of(sub)
        await wait_until(lambda: stub.received == [['{"ack":1}']], "the ack")


async def _silent(ws: ServerConnection, stub: StubServer) -> None:
    await ws.wait_closed()


async def test_silence_beyond_the_liveness_timeout_terminates_the_connection() -> None:
    async with stub_server(_silent) as stub:
        client = ChangeStreamerClient(stub.url, liveness_timeout_s=0.3)
        sub = await client.subscribe(ctx())
        with pytest.raises(ConnectionLostError, match="no ping or message"):
            await next_of(sub)


async def _pings_then_status(ws: ServerConnection, stub: StubServer) -> None:
    for _ in range(24):  # 1.2 s of pings only: three liveness periods
        await ws.ping()
        await asyncio.sleep(0.05)  # a peer that pings and says nothing: the point
    await ws.send('{"id":1,"msg":["status",{"tag":"status"}]}')
    await ws.wait_closed()


async def test_pings_keep_an_idle_connection_alive() -> None:
    async with stub_server(_pings_then_status) as stub:
        client = ChangeStreamerClient(stub.url, liveness_timeout_s=0.4)
        async with await client.subscribe(ctx()) as sub:
            assert isinstance(await next_of(sub), DownstreamStatus)


async def _garbage(ws: ServerConnection, stub: StubServer) -> None:
    await ws.send('{"id":1,"msg":["status",{"tag":"status"}]}')
    await ws.send('{"id":2,"msg":["begin",{"tag":"nope"},{"commitWatermark":"02"}]}')
    await ws.wait_closed()


async def test_an_invalid_message_raises_and_closes() -> None:
    async with stub_server(_garbage) as stub:
        sub = await ChangeStreamerClient(stub.url).subscribe(ctx())
        await next_of(sub)
        with pytest.raises(InvalidMessageError, match="begin"):
            await next_of(sub)
        assert sub.closed


async def _abnormal(ws: ServerConnection, stub: StubServer) -> None:
    await ws.send('{"id":1,"msg":["status",{"tag":"status"}]}')
    await ws.close(1011, "boom")


async def test_an_unexpected_close_code_raises_connection_lost() -> None:
    async with stub_server(_abnormal) as stub:
        sub = await ChangeStreamerClient(stub.url).subscribe(ctx())
        await next_of(sub)
        with pytest.raises(ConnectionLostError) as e:
            await next_of(sub)
        assert (e.value.code, e.value.reason) == (1011, "boom")


def _answer(status: HTTPStatus) -> Callable[[ServerConnection, Request], Response]:
    def process_request(ws: ServerConnection, request: Request) -> Response:
        return ws.respond(status, "no\n")

    return process_request


@pytest.mark.parametrize("version", [6, 7])
async def test_a_403_upgrade_raises_unauthorized_with_the_status(version: int) -> None:
    async with stub_server(_abnormal, process_request=_answer(HTTPStatus.FORBIDDEN)) as stub:
        url = stub.url.replace("ws://", "ws://zero:pw-403@")
        client = ChangeStreamerClient(url, protocol_version=version)
        with pytest.raises(UnauthorizedError) as e:
            await client.subscribe(ctx())
    assert e.value.status == 403
    assert str(e.value).startswith(f"{stub.url}/replication/v{version}/")
    assert "HTTP 403: access refused" in str(e.value)
    assert "pw-403" not in str(e.value)
    assert "zero" not in str(e.value)


async def test_another_refused_upgrade_is_a_connect_failure_without_the_password() -> None:
    async with stub_server(_abnormal, process_request=_answer(HTTPStatus.BAD_GATEWAY)) as stub:
        client = ChangeStreamerClient(stub.url, password="pw-502")
        with pytest.raises(ConnectFailedError, match="HTTP 502") as e:
            await client.subscribe(ctx())
    assert "pw-502" not in str(e.value)
