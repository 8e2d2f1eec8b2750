"""The change log's durable end in memory: catch-ups near the head read it, and
get exactly what the change DB would give them."""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator

import pytest

from app.protocol.errors import ErrorType
from app.storage import ChangeDb, StoredRow
from app.streamer.tail import ROW_BYTES, TX_BYTES, LogTail

from .helpers import collect
from .test_storer import Harness, begin, commit, harness, insert, subscribe, txn

__all__ = ["harness"]  # the fixture, used here too

# -- LogTail --------------------------------------------------------------------


def rows(w: str, n: int) -> list[StoredRow]:
    return [(w, i, "x" * 10, w if i == n - 1 else None) for i in range(n)]


def test_rows_from_needs_the_starting_transaction_and_everything_up_to_the_bound() -> None:
    tail = LogTail(1 << 20)
    for w in ("02", "03", "04"):
        tail.add(w, rows(w, 2), 20)
    assert tail.rows_from("03", "04") == [rows("03", 2), rows("04", 2)]
    assert tail.rows_from("02", "03") == [rows("02", 2), rows("03", 2)]
    assert tail.rows_from("01", "04") is None  # its own transaction is not held
    assert tail.rows_from("025", "04") is None  # not a transaction of the log
    assert tail.rows_from("03", "05") is None  # past what is held


def test_the_budget_drops_the_oldest_transactions_and_a_too_big_one_empties_it() -> None:
    each = 20 + 2 * ROW_BYTES + TX_BYTES  # two rows of 10 bytes of text
    tail = LogTail(2 * each + 10)
    for i in range(2, 10):
        tail.add(f"0{i}", rows(f"0{i}", 2), 20)
    assert (tail.first, tail.last, tail.bytes) == ("08", "09", 2 * each)
    assert tail.rows_from("07", "09") is None
    tail.add("10", rows("10", 9), 90)  # bigger than the budget: the run would break
    assert len(tail) == 0
    assert tail.rows_from("09", "09") is None


def test_transactions_must_come_in_order() -> None:
    tail = LogTail(1 << 20)
    tail.add("03", rows("03", 1), 10)
    with pytest.raises(ValueError, match="does not follow 03"):
        tail.add("02", rows("02", 1), 10)


def test_forget_before_drops_what_a_purge_will_delete() -> None:
    tail = LogTail(1 << 20)
    for i in range(100, 300):  # enough to compact the lists on the way
        tail.add(str(i), rows(str(i), 1), 10)
    tail.forget_before("250")
    assert (tail.first, tail.last, len(tail)) == ("250", "299", 50)
    assert tail.rows_from("249", "299") is None
    assert tail.rows_from("250", "251") == [rows("250", 1), rows("251", 1)]


@pytest.mark.parametrize("size", [1, 100])
def test_the_budget_counts_memory_not_only_text(size: int) -> None:
    """What the tail counts is what it holds, within a quarter (tracemalloc), for
    the 1-row transactions most apps write as for big ones: the budget bounds RSS."""
    n = 20_000 // size
    tail = LogTail(1 << 40)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            w = f"{10**9 + i:x}"  # a fresh watermark string per transaction, as stored
            held: list[StoredRow] = [(w, 0, f'{{"tag":"begin","xid":{i}}}', None)]
            held += [
                (w, p, f'{{"tag":"insert","new":{{"id":{i * size + p},"v":"x"}}}}', None)
                for p in range(1, size + 1)
            ]
            held.append((w, size + 1, '{"tag":"commit"}', w))
            tail.add(w, held, sum(len(r[2]) for r in held))
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.75 < tail.bytes / measured < 1.33, (tail.bytes, measured)


# -- the storer's catch-ups -------------------------------------------------------


@pytest.fixture(params=["memory", "log"])
async def either(request: pytest.FixtureRequest, change_db: ChangeDb) -> AsyncIterator[Harness]:
    """A storer with its tail (``memory``), and one without (``log``)."""
    h = Harness(change_db, tail_bytes=16 << 20 if request.param == "memory" else 0)
    h.kind = request.param  # type: ignore[attr-defined]
    h.start()
    yield h
    await h.close()


async def test_a_catch_up_near_the_head_gets_the_same_stream_from_memory_and_from_the_log(
    either: Harness,
) -> None:
    h = either
    h.feed(txn("02", 3) + txn("03", 100) + txn("04", 2))  # 03 spans the batch ramp
    await h.until_durable("04")
    _sub, ds = subscribe(h, "02")
    msgs = await collect(ds, 1 + 102 + 4)
    assert [m[0] for m in msgs[:3]] == ["status", "begin", "data"]
    assert msgs[1][2] == {"commitWatermark": "03"}  # 02 itself is what the replica has
    assert msgs[-1] == ["commit", {"tag": "commit"}, {"watermark": "04"}]
    assert [m[1].get("new") for m in msgs if m[0] == "data"] == [
        {"id": i} for i in [*range(100), *range(2)]
    ]
    counts = h.storer.catchups.from_memory, h.storer.catchups.from_log
    assert counts == ((1, 0) if h.kind == "memory" else (0, 1))  # type: ignore[attr-defined]


async def test_a_purged_watermark_is_too_old_though_the_tail_held_it(harness: Harness) -> None:
    harness.feed(txn("02") + txn("03"))
    await harness.until_durable("03")
    await harness.log.purge_before("03", "owner")  # tells the tail first
    _sub, ds = subscribe(harness, "02")
    msgs = await collect(ds, 1)
    assert msgs[0][0] == "error"
    assert msgs[0][1]["type"] == int(ErrorType.WATERMARK_TOO_OLD)
    assert harness.storer.catchups.from_log == 1


async def test_a_transaction_written_in_pieces_empties_the_tail(change_db: ChangeDb) -> None:
    h = Harness(change_db, open_tx_flush_bytes=2000)
    h.start()
    try:
        h.feed(txn("02"))
        h.feed([begin("03"), *[insert("03", i) for i in range(200)], commit("03")])
        h.feed(txn("04"))
        await h.until_durable("04")
        _sub, ds = subscribe(h, "02")  # 02 and 03 are read from the log
        msgs = await collect(ds, 1 + 202 + 3)
        assert msgs[-1] == ["commit", {"tag": "commit"}, {"watermark": "04"}]
        assert (h.storer.catchups.from_memory, h.storer.catchups.from_log) == (0, 1)
        _sub, ds = subscribe(h, "04")  # held again from the next transaction on
        assert [m[0] for m in await collect(ds, 1)] == ["status"]
        assert h.storer.catchups.from_memory == 1
    finally:
        await h.close()


async def test_a_new_stream_from_another_end_of_the_log_empties_the_tail(harness: Harness) -> None:
    harness.feed(txn("02"))
    await harness.until_durable("02")
    harness.storer.reset_for_stream("05")  # another owner stored 03..05 meanwhile
    _sub, ds = subscribe(harness, "02")
    assert [m[0] for m in await collect(ds, 1)] == ["status"]
    assert (harness.storer.catchups.from_memory, harness.storer.catchups.from_log) == (0, 1)


async def test_batches_from_memory_ramp_up_as_reads_of_the_log_do() -> None:
    from app.streamer.catchup import _ramped

    transactions = [rows("02", 3), rows("03", 100), rows("04", 1)]
    sizes = [len(b) async for b in _ramped(transactions, 4, 32)]
    assert sizes == [4, 8, 16, 32, 32, 12]
    flat = [r async for b in _ramped(transactions, 4, 32) for r in b]
    assert flat == [r for t in transactions for r in t]
