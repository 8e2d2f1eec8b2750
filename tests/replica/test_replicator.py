"""Replicator: downstream messages in, one SQLite transaction per upstream transaction."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from app.protocol.messages import parse_change_source_message
from app.protocol.subscription_messages import DownstreamError, parse_downstream_message
from app.replica.errors import ReplicaError, ResyncRequiredError
from app.replica.replicator import ReplicaMessage, Replicator
from app.replica.writer import CommitResult

from .conftest import create_index, create_table, insert, rows, snapshot


def tx(watermark: str, *changes: dict[str, Any]) -> list[list[Any]]:
    return [
        ["begin", {"tag": "begin", "json": "s"}, {"commitWatermark": watermark}],
        *(["data", c] for c in changes),
        ["commit", {"tag": "commit", "commitTimeMs": 1700000000000}, {"watermark": watermark}],
    ]


def parse(message: list[Any]) -> ReplicaMessage:
    """``message`` parsed: never a downstream error here (the subscription raises those)."""
    parsed = parse_downstream_message(message)
    assert not isinstance(parsed, DownstreamError)
    return parsed


async def stream(
    messages: Sequence[list[Any]], fail: BaseException | None = None, *, size: int = 1
) -> AsyncIterator[list[ReplicaMessage]]:
    """The messages in batches of ``size`` (a subscription's ``batches``)."""
    parsed = [parse(m) for m in messages]
    for start in range(0, len(parsed), size):
        yield parsed[start : start + size]
    if fail is not None:
        raise fail


@pytest.mark.parametrize("size", [1, 3, 100])
async def test_consume_applies_transactions_and_reports_commits(replica: Path, size: int) -> None:
    results: list[CommitResult] = []
    async with Replicator(replica, on_commit=results.append) as replicator:
        assert (replicator.replica_version, replicator.watermark) == ("01", "01")
        messages = [
            ["status", {"tag": "status"}],
            *tx("02", create_table(), create_index()),
            *tx("03", insert({"id": 1, "name": "a"})),
        ]
        assert await replicator.consume(stream(messages, size=size)) == 2
        assert replicator.watermark == "03"
    assert [(r.watermark, r.schema_updated, r.upstream_commit_time_ms) for r in results] == [
        ("02", True, 1700000000000),
        ("03", False, 1700000000000),
    ]
    assert rows(replica, "SELECT * FROM foo") == [(1, "a", "03")]


async def test_a_rollback_discards_the_open_transaction(replica: Path) -> None:
    async with Replicator(replica) as replicator:
        await replicator.consume(stream(tx("02", create_table(), create_index())))
        before = snapshot(replica)
        partial = tx("03", insert({"id": 1}))[:-1]
        await replicator.consume(stream([*partial, ["rollback", {"tag": "rollback"}]]))
        assert snapshot(replica) == before
        assert replicator.watermark == "02"


async def test_a_stream_that_breaks_mid_transaction_leaves_nothing(replica: Path) -> None:
    async with Replicator(replica) as replicator:
        await replicator.consume(stream(tx("02", create_table(), create_index())))
        before = snapshot(replica)
        with pytest.raises(ConnectionError):
            await replicator.consume(stream(tx("03", insert({"id": 1}))[:-1], ConnectionError()))
        assert not replicator.in_transaction
        assert snapshot(replica) == before
        # Resent whole on the next subscription.
        await replicator.consume(stream(tx("03", insert({"id": 1}))))
        assert replicator.watermark == "03"


async def test_a_bad_change_stops_consumption(replica: Path) -> None:
    async with Replicator(replica) as replicator:
        with pytest.raises(ReplicaError, match="unknown table 'foo'"):
            await replicator.consume(stream(tx("02", insert({"id": 1}), create_table())))
        assert replicator.watermark == "01"


async def test_reopening_resumes_where_it_left_off(replica: Path) -> None:
    async with Replicator(replica) as replicator:
        await replicator.consume(stream(tx("02", create_table(), create_index())))
    async with Replicator(replica) as replicator:
        assert replicator.watermark == "02"
        await replicator.consume(stream(tx("03", insert({"id": 1}))))
    async with Replicator(replica) as replicator:
        assert replicator.watermark == "03"


async def test_change_source_messages_work_in_process(replica: Path) -> None:
    async def source() -> AsyncIterator[list[ReplicaMessage]]:
        for m in [
            *tx("02", create_table(), create_index()),
            ["status", {"ack": True}, {"watermark": "02"}],
            ["control", {"tag": "reset-required", "message": "slot lost"}],
        ]:
            yield [parse_change_source_message(m)]

    async with Replicator(replica) as replicator:
        with pytest.raises(ResyncRequiredError, match="slot lost"):
            await replicator.consume(source())
        assert replicator.watermark == "02"


async def test_a_closed_replicator_refuses_work(replica: Path) -> None:
    replicator = Replicator(replica)
    with pytest.raises(ReplicaError, match="not open"):
        _ = replicator.watermark
    await replicator.open()
    await replicator.close()
    await replicator.close()  # idempotent
    with pytest.raises(ReplicaError, match="not open"):
        await replicator.apply_batch([parse(["rollback", {"tag": "rollback"}])])
