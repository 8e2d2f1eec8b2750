"""ensureReplicationConfig, ownership, start parameters and the change-log state."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, select, text

from app.stop_signals import AutoResetSignal
from app.storage import ChangeDb, ChangeLog, ChangeRow, Replication, SubscriptionState
from app.storage import replication as replication_module
from app.storage.backfill import UpsertBackfill, UpsertTableMetadata
from app.storage.engine import APPLICATION_NAME
from app.storage.tables import backfilling, change_log, table_metadata

FRESH = SubscriptionState("01", ("zero_data", "zero_meta"), "01")


async def rows(db: ChangeDb, table: object) -> int:
    async with db.reader.connect() as conn:
        return int(await conn.scalar(select(func.count()).select_from(table)) or 0)  # type: ignore[arg-type]


async def seed_some_history(db: ChangeDb) -> None:
    """A stored transaction plus backfill bookkeeping, owned by task-a."""
    replication = Replication(db)
    await replication.assume_ownership("task-a", None)
    async with ChangeLog(db).write("task-a") as w:
        await w.append(
            [
                ChangeRow("05", 0, '{"tag":"begin"}'),
                ChangeRow("05", 1, '{"tag":"insert"}'),
                ChangeRow("05", 2, '{"tag":"commit"}', "05"),
            ]
        )
        await w.apply(UpsertTableMetadata("public", "t", {"rowKey": {"id": {"attNum": 1}}}))
        await w.apply(UpsertBackfill("public", "t", "c", {"attNum": 2}))
        w.set_last_watermark("05")


async def test_an_empty_change_db_gets_config_state_and_seed_rows(db: ChangeDb) -> None:
    replication = Replication(db)
    config = await replication.ensure_config(FRESH, auto_reset=True)
    assert config.replica_version == "01"
    assert config.publications == ("zero_data", "zero_meta")
    assert config.reset_required is False
    state = await replication.state()
    assert state is not None
    assert (state.last_watermark, state.owner, state.owner_address) == ("01", None, None)
    seeded = [r async for batch in ChangeLog(db).read("00", "zz") for r in batch]
    assert seeded == [("01", 0, '{"tag":"begin"}', None), ("01", 1, '{"tag":"commit"}', None)]


async def test_same_replica_with_publications_in_another_order_changes_nothing(
    db: ChangeDb,
) -> None:
    replication = Replication(db)
    await replication.ensure_config(FRESH, auto_reset=True)
    await seed_some_history(db)
    again = SubscriptionState("01", ("zero_meta", "zero_data"), "05")
    config = await replication.ensure_config(again, auto_reset=True)
    assert config.publications == ("zero_data", "zero_meta")
    assert await ChangeLog(db).max_watermark() == "05"
    assert await rows(db, backfilling) == 1


async def test_reset_required_with_auto_reset_raises(db: ChangeDb) -> None:
    replication = Replication(db)
    await replication.ensure_config(FRESH, auto_reset=True)
    await replication.set_reset_required()
    with pytest.raises(AutoResetSignal, match="reset required by replication stream"):
        await replication.ensure_config(FRESH, auto_reset=True)


async def test_reset_required_without_auto_reset_only_reports_it(
    db: ChangeDb, caplog: pytest.LogCaptureFixture
) -> None:
    replication = Replication(db)
    await replication.ensure_config(FRESH, auto_reset=False)
    await replication.set_reset_required()
    config = await replication.ensure_config(FRESH, auto_reset=False)
    assert config.reset_required is True
    assert "auto-reset is off" in caplog.text


@pytest.mark.parametrize(
    "new_replica",
    [
        SubscriptionState("0a", ("zero_data", "zero_meta"), "0a"),
        SubscriptionState("01", ("other_pub",), "01"),
    ],
    ids=["new-replica-version", "new-publications"],
)
async def test_a_fresh_replica_of_another_version_wipes_all_five_tables(
    db: ChangeDb, new_replica: SubscriptionState
) -> None:
    replication = Replication(db)
    await replication.ensure_config(FRESH, auto_reset=True)
    await seed_some_history(db)

    config = await replication.ensure_config(new_replica, auto_reset=True)
    assert (config.replica_version, config.publications) == (
        new_replica.replica_version,
        tuple(sorted(new_replica.publications)),
    )
    assert await rows(db, backfilling) == 0
    assert await rows(db, table_metadata) == 0
    assert await rows(db, change_log) == 2  # the new seed rows only
    state = await replication.state()
    assert state is not None
    assert (state.last_watermark, state.owner) == (new_replica.replica_version, None)


async def test_an_advanced_replica_of_another_version_needs_a_reset(db: ChangeDb) -> None:
    replication = Replication(db)
    await replication.ensure_config(FRESH, auto_reset=True)
    await seed_some_history(db)
    advanced = SubscriptionState("0a", ("zero_data", "zero_meta"), "0f")
    with pytest.raises(AutoResetSignal, match=r"Cannot reset change db@01 to service replica@0a"):
        await replication.ensure_config(advanced, auto_reset=True)
    assert await ChangeLog(db).max_watermark() == "05"


async def test_a_reset_ends_change_streamer_sessions_that_block_it(
    pg_db: ChangeDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only Postgres has other sessions holding row locks; SQLite has one writer.
    db = pg_db
    monkeypatch.setattr(replication_module, "TRUNCATE_LOCK_TIMEOUT_S", 0.3)
    replication = Replication(db)
    await replication.ensure_config(FRESH, auto_reset=True)
    await seed_some_history(db)

    # Another change-streamer (same application_name) sits inside a storer
    # transaction holding the ownership row lock.
    blocker_engine_conn = await db.writer.connect()
    blocker = await blocker_engine_conn.begin()
    await blocker_engine_conn.execute(
        text(f"SELECT owner FROM {db.table_name('replicationState')} FOR UPDATE")
    )
    name = await blocker_engine_conn.scalar(text("SELECT current_setting('application_name')"))
    assert name == APPLICATION_NAME

    new_replica = SubscriptionState("0a", ("zero_data",), "0a")
    config = await asyncio.wait_for(replication.ensure_config(new_replica, auto_reset=True), 20)
    assert config.replica_version == "0a"
    assert await rows(db, change_log) == 2
    with pytest.raises(Exception, match="terminat"):
        await blocker.commit()
    await blocker_engine_conn.invalidate()
    await blocker_engine_conn.close()


async def test_start_parameters_give_the_head_and_pending_backfills(db: ChangeDb) -> None:
    replication = Replication(db)
    await replication.ensure_config(FRESH, auto_reset=True)
    await seed_some_history(db)
    params = await replication.start_parameters()
    assert params.last_watermark == "05"
    assert params.backfill_requests == [
        {
            "table": {
                "schema": "public",
                "name": "t",
                "metadata": {"rowKey": {"id": {"attNum": 1}}},
            },
            "columns": {"c": {"attNum": 2}},
        }
    ]


async def test_change_log_state_is_the_oldest_stored_watermark(db: ChangeDb) -> None:
    replication = Replication(db)
    await replication.ensure_config(FRESH, auto_reset=True)
    await seed_some_history(db)
    state = await replication.change_log_state()
    assert (state.replica_version, state.min_watermark) == ("01", "01")
    await ChangeLog(db).purge_before("05", "task-a")
    state = await replication.change_log_state()
    assert (state.replica_version, state.min_watermark) == ("01", "05")


async def test_change_log_state_of_an_emptied_log_falls_back_to_the_replica_version(
    db: ChangeDb,
) -> None:
    replication = Replication(db)
    await replication.ensure_config(FRESH, auto_reset=True)
    async with db.writer.begin() as conn:
        await conn.execute(change_log.delete())
    state = await replication.change_log_state()
    assert (state.replica_version, state.min_watermark) == ("01", "01")
    assert await replication.last_watermark_from_log() == "01"


async def test_last_watermark_from_log_is_the_newest_stored_watermark(db: ChangeDb) -> None:
    replication = Replication(db)
    await replication.ensure_config(FRESH, auto_reset=True)
    await seed_some_history(db)
    assert await replication.last_watermark_from_log() == "05"


async def test_ownership_address_is_readable_for_discovery(db: ChangeDb) -> None:
    replication = Replication(db)
    await replication.ensure_config(FRESH, auto_reset=True)
    await replication.assume_ownership("task-z", "192.0.2.7:4849")
    state = await replication.state()
    assert state is not None
    assert (state.owner, state.owner_address) == ("task-z", "192.0.2.7:4849")
