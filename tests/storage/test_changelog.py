"""The change log on SQLite and Postgres: group commit, catch-up reads, purge, ownership."""

from __future__ import annotations

import asyncio

import pytest

from app.storage import (
    ChangeDb,
    ChangeLog,
    ChangeRow,
    DuplicateChangeError,
    OwnershipLostError,
    PurgeLockedError,
    Replication,
    StoredRow,
    SubscriptionState,
)
from tests.waiting import stays

OWNER = "task-a"


def tx(watermark: str, *changes: str) -> list[ChangeRow]:
    """The rows the storer writes for one upstream transaction."""
    rows = [ChangeRow(watermark, 0, '{"tag":"begin"}')]
    rows += [ChangeRow(watermark, i, c) for i, c in enumerate(changes, start=1)]
    rows.append(ChangeRow(watermark, len(changes) + 1, '{"tag":"commit"}', watermark))
    return rows


def insert(n: int) -> str:
    return f'{{"tag":"insert","relation":{{"schema":"public","name":"t"}},"new":{{"id":{n}}}}}'


@pytest.fixture
async def log(db: ChangeDb) -> ChangeLog:
    return await owned_log(db)


async def owned_log(db: ChangeDb) -> ChangeLog:
    replication = Replication(db)
    await replication.ensure_config(SubscriptionState("01", ("pub",), "01"), auto_reset=False)
    await replication.assume_ownership(OWNER, "127.0.0.1:4849")
    return ChangeLog(db)


async def read_all(
    log: ChangeLog, start: str = "00", up_to: str = "zz", **kw: int
) -> list[StoredRow]:
    out: list[StoredRow] = []
    async for batch in log.read(start, up_to, **kw):
        assert 0 < len(batch) <= kw.get("batch_size", 2000)
        out.extend(batch)
    return out


async def test_group_commit_stores_many_transactions_in_key_order(log: ChangeLog) -> None:
    # Two group commits, each with several upstream transactions.
    async with log.write(OWNER) as w:
        await w.append(tx("02", insert(1), insert(2)) + tx("03", insert(3)))
        w.set_last_watermark("03")
    async with log.write(OWNER) as w:
        await w.append(tx("04") + tx("0a", insert(4), insert(5), insert(6)))
        w.set_last_watermark("0a")

    # The seed rows of ensure_config come first: a bare begin/commit at the replica version.
    expected: list[tuple[object, ...]] = [
        ("01", 0, '{"tag":"begin"}', None),
        ("01", 1, '{"tag":"commit"}', None),
    ]
    for rows in (
        tx("02", insert(1), insert(2)),
        tx("03", insert(3)),
        tx("04"),
        tx("0a", insert(4), insert(5), insert(6)),
    ):
        expected += [tuple(r) for r in rows]
    for batch_size in (1, 2, 3, 7, 2000):
        assert await read_all(log, batch_size=batch_size) == expected
    state = await Replication(log.db).state()
    assert state is not None
    assert state.last_watermark == "0a"


async def test_a_first_batch_size_starts_small_and_doubles_up_to_the_batch_size(
    log: ChangeLog,
) -> None:
    async with log.write(OWNER) as w:
        await w.append(tx("02", *(insert(i) for i in range(40))))
        w.set_last_watermark("02")
    expected = await read_all(log)
    assert len(expected) == 44  # the seed's begin/commit, then begin, 40 inserts, commit
    sizes = []
    rows: list[StoredRow] = []
    async for batch in log.read("00", "zz", batch_size=12, first_batch=3):
        sizes.append(len(batch))
        rows.extend(batch)
    assert sizes == [3, 6, 12, 12, 11]
    assert rows == expected
    with pytest.raises(ValueError, match="first_batch must be at least 1"):
        await read_all(log, first_batch=0)


async def test_read_bounds_are_inclusive_on_both_ends(log: ChangeLog) -> None:
    async with log.write(OWNER) as w:
        await w.append(tx("02", insert(1)) + tx("03", insert(2)) + tx("04", insert(3)))
        w.set_last_watermark("04")
    rows = await read_all(log, "02", "03", batch_size=2)
    assert {r[0] for r in rows} == {"02", "03"}
    assert [(r[0], r[1]) for r in rows] == [
        ("02", 0),
        ("02", 1),
        ("02", 2),
        ("03", 0),
        ("03", 1),
        ("03", 2),
    ]
    assert await read_all(log, "05", "zz") == []


async def test_stored_change_text_comes_back_byte_for_byte(log: ChangeLog) -> None:
    tricky = [
        '{"tag":"insert","new":{"s":"nul \\u0000 end"}}',
        '{"tag":"insert","new":{"big":123456789012345678901234567890,"neg":-9007199254740993}}',
        '{"tag":"insert","new":{"q":"say \\"hi\\" \\\\ back\\\\slash","t":"a\\tb\\nc"}}',
        '{"tag":"insert","new":{"u":"ünïcødé ✓ 😀 \u2028"}}',
        '{"tag":"insert","new":{},"old":[],"x":{"a":[{}]}}',
        '{"new":{"id":1},"tag":"update","key":null}',
    ]
    async with log.write(OWNER) as w:
        await w.append(tx("02", *tricky))
        w.set_last_watermark("02")
    rows = await read_all(log, "02")
    assert [r[2] for r in rows[1:-1]] == tricky


async def test_an_exception_inside_a_write_stores_nothing(log: ChangeLog) -> None:
    with pytest.raises(RuntimeError, match="upstream broke"):
        async with log.write(OWNER) as w:
            await w.append(tx("02", insert(1)))
            w.set_last_watermark("02")
            raise RuntimeError("upstream broke")
    assert await log.max_watermark() == "01"
    state = await Replication(log.db).state()
    assert state is not None
    assert state.last_watermark == "01"


async def test_a_duplicate_row_fails_the_whole_group(log: ChangeLog) -> None:
    async with log.write(OWNER) as w:
        await w.append(tx("02", insert(1)))
        w.set_last_watermark("02")
    with pytest.raises(
        DuplicateChangeError, match=r"already stored at the same \(watermark, pos\)"
    ):
        async with log.write(OWNER) as w:
            await w.append(tx("03", insert(2)) + tx("02", insert(1)))
            w.set_last_watermark("03")
    assert await log.max_watermark() == "02"
    assert await log.count() == 2 + 3


async def test_a_writer_that_lost_ownership_stores_nothing(log: ChangeLog) -> None:
    await Replication(log.db).assume_ownership("task-b", "10.0.0.2:4849")
    with pytest.raises(OwnershipLostError, match="assumed by task-b"):
        async with log.write(OWNER) as w:
            await w.append(tx("02", insert(1)))
            w.set_last_watermark("02")
    assert await log.max_watermark() == "01"


# On SQLite a group is written by statements of 2048 rows, then 1024, 512, ... 1
# for the rest: sizes around those edges, and one that takes every statement size.
@pytest.mark.parametrize("count", [1, 2, 3, 255, 256, 257, 2047, 2048, 2049, 6143])
async def test_commit_rows_stores_rows_and_moves_the_head_in_one_call(
    log: ChangeLog, count: int
) -> None:
    rows = [ChangeRow("02", pos, insert(pos)) for pos in range(count)]
    await log.commit_rows(OWNER, rows, "02")
    assert await read_all(log, "02") == [tuple(r) for r in rows]
    state = await Replication(log.db).state()
    assert state is not None
    assert state.last_watermark == "02"


async def test_commit_rows_of_a_former_owner_stores_nothing(log: ChangeLog) -> None:
    await Replication(log.db).assume_ownership("task-b", "10.0.0.2:4849")
    with pytest.raises(OwnershipLostError, match="assumed by task-b"):
        await log.commit_rows(OWNER, tx("02", insert(1)), "02")
    assert await log.max_watermark() == "01"
    state = await Replication(log.db).state()
    assert state is not None
    assert state.last_watermark == "01"


async def test_commit_rows_with_a_duplicate_stores_nothing(log: ChangeLog) -> None:
    await log.commit_rows(OWNER, tx("02", insert(1)), "02")
    with pytest.raises(
        DuplicateChangeError, match=r"already stored at the same \(watermark, pos\)"
    ):
        await log.commit_rows(OWNER, tx("03", insert(2)) + tx("02", insert(1)), "03")
    assert await log.max_watermark() == "02"
    state = await Replication(log.db).state()
    assert state is not None
    assert state.last_watermark == "02"
    # The connection is usable again: the failed transaction was rolled back.
    await log.commit_rows(OWNER, tx("03", insert(2)), "03")
    assert await log.count() == 2 + 3 + 3  # the initial transaction at 01, then 02 and 03


async def test_takeover_waits_for_the_open_write_and_is_seen_by_the_next(log: ChangeLog) -> None:
    replication = Replication(log.db)
    async with log.write(OWNER) as w:
        await w.append(tx("02", insert(1)))
        w.set_last_watermark("02")
        takeover = asyncio.create_task(replication.assume_ownership("task-b", "b:4849"))
        # The open write holds the ownership lock, so the takeover cannot land yet.
        await stays(lambda: not takeover.done(), 0.3, "the takeover held back")
        assert not takeover.done()
    await asyncio.wait_for(takeover, 10)
    assert await log.max_watermark() == "02"
    with pytest.raises(OwnershipLostError):
        async with log.write(OWNER) as w:
            await w.append(tx("03", insert(2)))
    state = await replication.state()
    assert state is not None
    assert (state.owner, state.owner_address, state.last_watermark) == ("task-b", "b:4849", "02")


async def test_min_and_max_watermark(log: ChangeLog) -> None:
    assert (await log.min_watermark(), await log.max_watermark()) == ("01", "01")
    async with log.write(OWNER) as w:
        await w.append(tx("02") + tx("0z"))
    assert (await log.min_watermark(), await log.max_watermark()) == ("01", "0z")


async def test_purge_removes_transactions_below_the_watermark(log: ChangeLog) -> None:
    async with log.write(OWNER) as w:
        await w.append(tx("02", insert(1)) + tx("03", insert(2)) + tx("04", insert(3)))
    deleted = await log.purge_before("03", OWNER)
    assert deleted == 2 + 3
    assert await log.min_watermark() == "03"
    assert {r[0] for r in await read_all(log)} == {"03", "04"}


async def test_purge_always_keeps_the_newest_transaction(log: ChangeLog) -> None:
    async with log.write(OWNER) as w:
        await w.append(tx("02", insert(1)) + tx("03", insert(2)))
    # A backup may be ahead of the log; the newest transaction stays as the
    # catch-up boundary.
    assert await log.purge_before("zz", OWNER) == 2 + 3
    assert [r[:2] for r in await read_all(log)] == [("03", 0), ("03", 1), ("03", 2)]


async def test_purge_by_a_former_owner_deletes_nothing(log: ChangeLog) -> None:
    async with log.write(OWNER) as w:
        await w.append(tx("02", insert(1)) + tx("03"))
    await Replication(log.db).assume_ownership("task-b", None)
    with pytest.raises(
        OwnershipLostError, match="purge to 03 because ownership has been taken by task-b"
    ):
        await log.purge_before("03", OWNER)
    assert await log.min_watermark() == "01"


async def test_purge_of_an_empty_log_is_a_no_op(db: ChangeDb) -> None:
    assert await ChangeLog(db).purge_before("05", OWNER) == 0


async def test_purge_fails_fast_while_a_restore_holds_the_purge_lock(pg_db: ChangeDb) -> None:
    # The row-level purge lock exists on Postgres only; SQLite is single-node.
    log = await owned_log(pg_db)
    table = log.db.table_name("changeLog")
    async with log.db.reader.connect() as holder, holder.begin():
        await holder.exec_driver_sql(
            f"SELECT watermark FROM {table} ORDER BY watermark, pos LIMIT 1 FOR SHARE"
        )
        with pytest.raises(PurgeLockedError):
            await log.purge_before("zz", OWNER)
    assert await log.count() == 2
