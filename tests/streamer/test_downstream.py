"""The subscriber channel (app/streamer/downstream.py): order, byte bound, consumption."""

from __future__ import annotations

import pytest

from app.streamer.downstream import Downstream, DownstreamClosed


def closed(ds: Downstream) -> bool:
    """``ds.closed``, read afresh: mypy keeps an attribute narrowed by an ``assert``
    across the pushes that change it."""
    return ds.closed


async def test_messages_come_out_in_order_singly_and_in_takes() -> None:
    ds = Downstream()
    for i in range(10):
        ds.push([f"m{i}"])
    assert await ds.get() == "m0"
    assert ds.get_nowait() == "m1"
    assert ds.take(3) == ["m2", "m3", "m4"]
    assert ds.take(100) == ["m5", "m6", "m7", "m8", "m9"]
    assert ds.take(5) == []
    assert ds.get_nowait() is None
    assert ds.sent_unacked == 10


async def test_acks_consume_bytes_and_resolve_tracked_pushes_in_order() -> None:
    ds = Downstream()
    tracked = {}
    for i in range(3000):  # enough to compact the byte index several times
        future = ds.push(["x" * (i % 7 + 1)], track=i % 1000 == 999)
        if future is not None:
            tracked[i + 1] = future
    total = sum(i % 7 + 1 for i in range(3000))
    assert ds.unconsumed_bytes == total
    ds.take(3000)
    seen: list[int] = []
    ds.on_consumed(seen.append)
    consumed_bytes = 0
    for n in (1, 998, 1, 1500, 499, 1):
        ds.ack_many(n)
        consumed_bytes += sum(i % 7 + 1 for i in range(ds.consumed - n, ds.consumed))
        assert ds.unconsumed_bytes == total - consumed_bytes
        assert {k for k, f in tracked.items() if f.done()} == {
            k for k in tracked if k <= ds.consumed
        }
    assert seen == [1, 999, 1000, 2500, 2999, 3000]
    assert all(f.result() is True for f in tracked.values())
    assert ds.pending == 0
    assert ds.unconsumed_bytes == 0


async def test_an_ack_beyond_what_was_sent_is_refused_and_changes_nothing() -> None:
    ds = Downstream()
    for i in range(3):
        ds.push([f"m{i}"])
    ds.take(2)
    with pytest.raises(ValueError, match="not sent"):
        ds.ack_many(3)
    assert ds.consumed == 0
    ds.ack_many(2)
    with pytest.raises(ValueError, match="not sent"):
        ds.ack_next()
    assert ds.consumed == 2


async def test_closing_resolves_tracked_pushes_false_and_ends_gets() -> None:
    ds = Downstream()
    first = ds.push(["a"], track=True)
    ds.push(["b"])
    ds.take(1)
    ds.close("bye")
    assert first.result() is False
    assert ds.push(["c"], track=True).result() is False
    assert ds.unconsumed_bytes == 0
    with pytest.raises(DownstreamClosed, match="bye"):
        await ds.get()


async def test_more_unconsumed_bytes_than_the_bound_closes_the_channel() -> None:
    ds = Downstream(max_unconsumed_bytes=100)
    ds.push(["12345"])
    ds.take(1)
    ds.ack_next()
    ds.push(["x" * 20] * 5)  # 100 unconsumed: at the bound, still open
    assert not closed(ds)
    ds.push(["1"])
    assert ds.closed
    assert ds.close_reason == "more than 100 bytes sent but not acknowledged"


async def test_large_messages_do_not_count_against_the_bound_until_consumed() -> None:
    # Large: over a quarter of the bound (25 bytes here).
    ds = Downstream(max_unconsumed_bytes=100)
    ds.push(["a" * 50])
    ds.push(["b" * 60, *(["c" * 20] * 5)])  # 210 unconsumed, 100 of them counted
    assert not closed(ds)
    ds.push(["d"])  # 101 counted
    assert ds.closed

    ds = Downstream(max_unconsumed_bytes=100)
    ds.push(["x" * 50, *(["y" * 20] * 4)])  # 130 unconsumed, 80 counted
    assert not closed(ds)
    assert ds.take(5) == ["x" * 50, *(["y" * 20] * 4)]
    ds.ack_next()  # the large one is consumed: 80 unconsumed, all counted
    ds.push(["z" * 20])  # 100: at the bound
    assert not closed(ds)
    ds.push(["!"])
    assert ds.closed
