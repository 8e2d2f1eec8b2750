"""ChangeStreamerClient.resume: reconnecting without gaps or duplicate commits."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from websockets.asyncio.server import ServerConnection

from app.client import (
    ChangeStreamerClient,
    ConnectFailedError,
    ProtocolError,
    ReconnectPolicy,
    ResumingSubscription,
    SubscriptionContext,
    WrongReplicaVersionError,
)
from app.client.resume import backoff_delays
from app.client.subscription import SubscriptionMessage
from app.protocol.canonical_json import dumps
from app.protocol.messages import Begin, Commit, Data, Rollback
from app.protocol.subscription_messages import DownstreamStatus

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


def ctx(watermark: str = REPLICA_VERSION, *, initial: bool = True) -> SubscriptionContext:
    return SubscriptionContext("sub-1", REPLICA_VERSION, watermark, initial=initial)


async def next_of(sub: ResumingSubscription) -> SubscriptionMessage:
    return await asyncio.wait_for(sub.__anext__(), TIMEOUT)


def describe(m: SubscriptionMessage) -> str:
    if isinstance(m, Begin):
        return f"begin {m.commit_watermark}"
    if isinstance(m, Commit):
        return f"commit {m.watermark}"
    if isinstance(m, Data):
        return f"data {m.body['new']['id']}"
    return m.kind


async def test_a_drop_mid_transaction_yields_a_rollback_then_the_whole_transaction(
    server: Server, client: ChangeStreamerClient
) -> None:
    got: list[str] = []
    async with client.resume(ctx()) as sub:
        got.append(describe(await next_of(sub)))
        stream = await asyncio.wait_for(server.source.wait_for_stream(), TIMEOUT)
        stream.push_all(txn("02"))
        stream.push_all(txn("03", 2)[:2])  # begin 03 and its first row, no commit yet
        got += [describe(await next_of(sub)) for _ in range(5)]
        assert got[-1] == "data 03-0"
        server.service.forwarder.close_all()
        got.append(describe(await next_of(sub)))  # the synthetic rollback
        # The server starts the new subscription's catch-up (status first) once
        # its open transaction is over.
        stream.push_all(txn("03", 2)[2:])  # the rest of 03
        got += [describe(await next_of(sub)) for _ in range(5)]
        assert sub.watermark == "03"
        assert sub.connections == 2
    assert got == [
        "status",
        "begin 02",
        "data 02-0",
        "commit 02",
        "begin 03",
        "data 03-0",
        "rollback",
        "status",
        "begin 03",
        "data 03-0",
        "data 03-1",
        "commit 03",
    ]


async def test_a_drop_between_transactions_continues_with_no_gap_and_no_duplicate(
    server: Server, client: ChangeStreamerClient
) -> None:
    commits: list[str] = []
    async with client.resume(ctx()) as sub:
        await next_of(sub)
        stream = await asyncio.wait_for(server.source.wait_for_stream(), TIMEOUT)
        stream.push_all([*txn("02"), *txn("03")])
        for _ in range(6):
            m = await next_of(sub)
            if isinstance(m, Commit):
                commits.append(m.watermark)
        server.service.forwarder.close_all()
        stream.push_all([*txn("04"), *txn("05")])
        while len(commits) < 4:
            m = await next_of(sub)
            assert not isinstance(m, Rollback)
            if isinstance(m, Commit):
                commits.append(m.watermark)
        assert sub.connections == 2
    assert commits == ["02", "03", "04", "05"]


async def test_in_band_errors_are_not_retried(server: Server, client: ChangeStreamerClient) -> None:
    sub = client.resume(SubscriptionContext("x", "0z", "0z"))
    with pytest.raises(WrongReplicaVersionError):
        await next_of(sub)
    assert sub.connections == 1
    with pytest.raises(StopAsyncIteration):
        await next_of(sub)


async def test_protocol_errors_are_not_retried_by_default(server: Server) -> None:
    sub = ChangeStreamerClient(server.url, protocol_version=99).resume(ctx())
    with pytest.raises(ProtocolError):
        await next_of(sub)
    assert sub.connections == 1


async def test_it_gives_up_after_the_configured_attempts() -> None:
    client = ChangeStreamerClient(f"ws://127.0.0.1:{free_port()}")
    policy = ReconnectPolicy(initial_delay_s=0.001, max_attempts=3)
    sub = client.resume(ctx(), policy)
    with pytest.raises(ConnectFailedError):
        await next_of(sub)
    assert sub.connections == 0


def test_backoff_doubles_from_25_ms_to_10_s() -> None:
    delay = backoff_delays(ReconnectPolicy())
    assert [delay(n) for n in (1, 2, 3, 4)] == [0.025, 0.05, 0.1, 0.2]
    assert delay(10) == 10.0
    assert delay(100) == 10.0


def _frames(*messages: Any) -> list[str]:
    return [dumps({"id": i, "msg": m}) for i, m in enumerate(messages, start=1)]


STATUS = ["status", {"tag": "status"}]


async def _replaying(ws: ServerConnection, stub: StubServer) -> None:
    """1st connection: 02, then drop. 2nd: 02 again (a misbehaving server), then 03."""
    messages = [STATUS, *txn("02")]
    if len(stub.paths) > 1:
        messages += txn("03")
    for frame in _frames(*messages):
        await ws.send(frame)
    if len(stub.paths) == 1:
        await ws.close()
    else:
        await ws.wait_closed()


async def test_a_replayed_transaction_is_dropped_and_the_reconnect_resumes_from_it() -> None:
    async with stub_server(_replaying) as stub:
        commits: list[str] = []
        async with ChangeStreamerClient(stub.url).resume(ctx()) as sub:
            while len(commits) < 2:
                m = await next_of(sub)
                if isinstance(m, Commit):
                    commits.append(m.watermark)
        assert commits == ["02", "03"]
        first, second = (parse_qs(urlsplit(p).query) for p in stub.paths)
        assert (first["watermark"], first["initial"]) == ([REPLICA_VERSION], ["true"])
        assert (second["watermark"], second["initial"]) == (["02"], ["false"])


async def _status_then_close(ws: ServerConnection, stub: StubServer) -> None:
    await ws.send(_frames(STATUS)[0])
    await ws.close()


async def test_repeated_drops_keep_reconnecting_and_each_status_is_yielded() -> None:
    async with stub_server(_status_then_close) as stub:
        policy = ReconnectPolicy(initial_delay_s=0.001)
        async with ChangeStreamerClient(stub.url).resume(ctx(), policy) as sub:
            for _ in range(3):
                assert isinstance(await next_of(sub), DownstreamStatus)
        await wait_until(lambda: len(stub.paths) >= 3, "three connections")
