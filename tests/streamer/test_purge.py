"""Purger: when change-log entries are purged and how far (core.md §5.7, §7 items 8-10)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.storage import (
    ChangeLog,
    ChangeRow,
    OwnershipLostError,
    PurgeLockedError,
    Replication,
    Shard,
    create_change_db,
    parse_change_db_url,
)
from app.streamer.purge import BACKUP_HISTORY, CLEANUP_DELAY_S, CommitClock, Purger
from app.streamer.timers import ManualTimers
from tests.change_dbs import migrated

# What a purge pass logs when something older holds it back (it names the holder).
BEHIND = ("purging only up to",)


class FakePurge:
    """Records purge calls; can fail or hold a call open until released."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.errors: list[Exception] = []
        self.gate: asyncio.Event | None = None
        self.cancelled = False

    async def __call__(self, watermark: str) -> int:
        self.calls.append(watermark)
        if self.errors:
            raise self.errors.pop(0)
        if self.gate is not None:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        return 1


class World:
    """A purger with a fake purge, settable subscriber acks and reservations."""

    def __init__(self) -> None:
        self.timers = ManualTimers()
        self.purge = FakePurge()
        self.acks: list[str] = []
        self.reserved: list[str] = []
        self.fatal: list[BaseException] = []
        self.purger = Purger(
            self.purge,
            lambda: self.acks,
            lambda: self.reserved,
            self.timers,
            on_fatal=self.fatal.append,
        )

    async def fire(self) -> None:
        """Lets the armed delay pass and the purge it starts finish."""
        assert self.timers.advance(CLEANUP_DELAY_S) >= 1
        await self.purger.idle()


@pytest.fixture
async def world() -> AsyncIterator[World]:
    w = World()
    yield w
    await w.purger.stop()


def behind_logs(caplog: pytest.LogCaptureFixture) -> int:
    return sum(r.getMessage().startswith(BEHIND) for r in caplog.records)


# -- trackBackupWatermark ----------------------------------------------------------


async def test_a_backup_watermark_arms_one_30_s_timer(world: World) -> None:
    world.purger.track_backup_watermark("05")
    world.purger.track_backup_watermark("06")
    world.purger.track_backup_watermark("07")
    assert world.timers.armed == [30.0]
    assert world.timers.pending() == [30.0]
    assert world.timers.advance(29.9) == 0
    assert world.purge.calls == []


async def test_no_subscribers_purges_to_the_backup_watermark_and_is_not_rearmed(
    world: World,
) -> None:
    world.purger.track_backup_watermark("06")
    await world.fire()
    assert world.purge.calls == ["06"]
    assert world.purger.purged_watermark == "06"
    assert world.timers.pending() == []
    assert world.timers.armed == [30.0]

    world.purger.track_backup_watermark("06")  # nothing new
    assert world.timers.pending() == []


async def test_purge_floor_respects_the_slowest_subscriber(world: World) -> None:
    world.acks[:] = ["07", "03"]
    world.purger.track_backup_watermark("08")
    await world.fire()
    assert world.purge.calls == ["03"]
    # The backup is still ahead of the purge: try again later.
    assert world.timers.pending() == [30.0]

    world.acks[:] = ["07", "09"]
    await world.fire()
    assert world.purge.calls == ["03", "07"]

    world.acks[:] = ["09", "0a"]
    await world.fire()
    assert world.purge.calls == ["03", "07", "08"]  # never beyond the backup
    assert world.timers.pending() == []
    assert world.timers.armed == [30.0, 30.0, 30.0]


async def test_a_newer_backup_reschedules_the_purge(world: World) -> None:
    world.purger.track_backup_watermark("05")
    await world.fire()
    assert world.timers.pending() == []

    world.purger.track_backup_watermark("09")
    assert world.timers.pending() == [30.0]
    await world.fire()
    assert world.purge.calls == ["05", "09"]


async def test_a_backup_arriving_during_a_purge_is_handled_after_it(world: World) -> None:
    world.purge.gate = asyncio.Event()
    world.purger.track_backup_watermark("05")
    world.timers.advance(CLEANUP_DELAY_S)
    await asyncio.sleep(0)
    assert world.purge.calls == ["05"]

    world.purger.track_backup_watermark("09")
    assert world.timers.pending() == []  # one purge at a time
    world.purge.gate.set()
    await world.purger.idle()
    assert world.timers.pending() == [30.0]
    await world.fire()
    assert world.purge.calls == ["05", "09"]


async def test_an_unchanged_floor_is_not_purged_again(world: World) -> None:
    world.acks[:] = ["03"]
    world.purger.track_backup_watermark("08")
    await world.fire()
    await world.fire()
    await world.fire()
    assert world.purge.calls == ["03"]


async def test_an_unchanged_behind_backup_floor_is_logged_once(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.streamer.purge")
    world.acks[:] = ["03"]
    world.purger.track_backup_watermark("08")
    await world.fire()
    await world.fire()
    assert behind_logs(caplog) == 1

    world.acks[:] = ["04"]  # the floor moves: log again
    await world.fire()
    await world.fire()
    assert behind_logs(caplog) == 2
    assert world.purge.calls == ["03", "04"]


async def test_confirmed_reservations_hold_the_floor(world: World) -> None:
    world.acks[:] = ["09"]
    world.reserved[:] = ["04", "06"]
    world.purger.track_backup_watermark("08")
    await world.fire()
    assert world.purge.calls == ["04"]

    world.reserved[:] = []
    await world.fire()
    assert world.purge.calls == ["04", "08"]


async def test_purge_errors_are_logged_swallowed_and_retried(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world.purge.errors[:] = [RuntimeError("connection reset"), PurgeLockedError("restoring")]
    world.purger.track_backup_watermark("05")
    await world.fire()
    assert "connection reset" in caplog.text
    assert world.purger.purged_watermark == ""
    await world.fire()  # purge-locked: retried later too
    assert world.purger.purged_watermark == ""
    await world.fire()
    assert world.purge.calls == ["05", "05", "05"]
    assert world.purger.purged_watermark == "05"
    assert world.fatal == []


async def test_a_failing_constraint_does_not_stop_purging() -> None:
    calls = 0

    def acks() -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("forwarder gone")
        return []

    timers, purge = ManualTimers(), FakePurge()
    purger = Purger(purge, acks, list, timers)
    purger.track_backup_watermark("05")
    timers.advance(CLEANUP_DELAY_S)
    await purger.idle()
    assert purge.calls == []
    timers.advance(CLEANUP_DELAY_S)
    await purger.idle()
    assert purge.calls == ["05"]
    await purger.stop()


async def test_ownership_loss_goes_to_on_fatal_and_stops_purging(world: World) -> None:
    lost = OwnershipLostError("task-b", "ownership has been taken by task-b")
    world.purge.errors[:] = [lost]
    world.acks[:] = ["09"]
    world.purger.track_backup_watermark("05")
    await world.fire()
    assert world.fatal == [lost]
    assert world.purge.calls == ["05"]
    assert world.timers.pending() == []

    world.purger.track_backup_watermark("09")
    assert world.timers.pending() == []


async def test_stop_cancels_the_armed_timer(world: World) -> None:
    world.purger.track_backup_watermark("05")
    await world.purger.stop()
    assert world.timers.pending() == []
    world.timers.advance(CLEANUP_DELAY_S)
    await asyncio.sleep(0)
    assert world.purge.calls == []


async def test_stop_cancels_a_running_purge(world: World) -> None:
    world.purge.gate = asyncio.Event()
    world.purger.track_backup_watermark("05")
    world.timers.advance(CLEANUP_DELAY_S)
    await asyncio.sleep(0)
    assert world.purge.calls == ["05"]

    await world.purger.stop()
    assert world.purge.cancelled
    assert world.purger.purged_watermark == ""
    assert world.timers.pending() == []


# -- against a real change DB ---------------------------------------------------------

OWNER = "task-a"


def stored_tx(watermark: str) -> list[ChangeRow]:
    return [
        ChangeRow(watermark, 0, '{"tag":"begin"}'),
        ChangeRow(watermark, 1, '{"tag":"insert"}'),
        ChangeRow(watermark, 2, '{"tag":"commit"}', watermark),
    ]


async def test_purges_a_real_change_log_but_keeps_the_newest_transaction(
    tmp_path: Path,
) -> None:
    db = create_change_db(parse_change_db_url(str(tmp_path / "cdc.db")), Shard())
    try:
        await migrated(db, publications=("pub",), owner=OWNER)
        replication = Replication(db)
        log = ChangeLog(db)
        for w in ("02", "03", "04"):
            async with log.write(OWNER) as tx:
                await tx.append(stored_tx(w))
                tx.set_last_watermark(w)

        timers = ManualTimers()
        acks = ["03"]
        fatal: list[BaseException] = []
        purger = Purger(
            lambda w: log.purge_before(w, OWNER),
            lambda: acks,
            list,
            timers,
            on_fatal=fatal.append,
        )
        purger.track_backup_watermark("05")
        timers.advance(CLEANUP_DELAY_S)
        await purger.idle()
        assert await log.min_watermark() == "03"  # the seed rows and 02 are gone
        assert await log.count() == 6

        acks.clear()  # the subscriber left: purge up to the backup
        timers.advance(CLEANUP_DELAY_S)
        await purger.idle()
        assert purger.purged_watermark == "05"
        assert await log.min_watermark() == "04"  # the newest transaction stays
        assert await log.count() == 3
        assert timers.pending() == []

        # Another change-streamer takes over: the next purge deletes nothing and
        # reports the loss.
        async with log.write(OWNER) as tx:
            await tx.append(stored_tx("06"))
            tx.set_last_watermark("06")
        await replication.assume_ownership("task-b", "127.0.0.1:4850")
        purger.track_backup_watermark("07")
        timers.advance(CLEANUP_DELAY_S)
        await purger.idle()
        assert [type(e) for e in fatal] == [OwnershipLostError]
        assert await log.count() == 6
        await purger.stop()
    finally:
        await db.dispose()


# -- reservations hold the floor each at its own; the delay grows; the floor is named --


async def test_open_reservations_each_hold_the_floor_at_their_own_watermark() -> None:
    # View-syncers restoring one after the other: while any is open the log still
    # shrinks, to the oldest watermark one of them still needs.
    timers = ManualTimers()
    purge = FakePurge()
    reserved: list[str] = ["03"]
    purger = Purger(purge, lambda: [], lambda: list(reserved), timers)
    try:
        purger.track_backup_watermark("05")
        timers.advance(CLEANUP_DELAY_S)
        await purger.idle()
        assert purge.calls == ["03"]
        assert (purger.floor, purger.floor_holder) == ("03", "reservation")
        reserved[:] = ["07", "04"]  # the first subscribed; two more restore
        purger.track_backup_watermark("09")
        timers.advance(CLEANUP_DELAY_S)
        await purger.idle()
        assert purge.calls == ["03", "04"]
        reserved[:] = ["07", "08"]
        timers.advance(CLEANUP_DELAY_S)  # level-triggered: the backup is still ahead
        await purger.idle()
        assert purge.calls == ["03", "04", "07"]
        reserved.clear()
        timers.advance(CLEANUP_DELAY_S)
        await purger.idle()
        assert purge.calls == ["03", "04", "07", "09"]
        assert (purger.floor, purger.floor_holder) == ("09", "backup")
    finally:
        await purger.stop()


async def test_the_delay_is_read_at_each_arming() -> None:
    timers = ManualTimers()
    purge = FakePurge()
    delay = [CLEANUP_DELAY_S]
    purger = Purger(purge, lambda: [], list, timers, delay_s=lambda: delay[0])
    try:
        purger.track_backup_watermark("05")
        timers.advance(CLEANUP_DELAY_S)
        await purger.idle()
        assert purge.calls == ["05"]
        delay[0] = 120.0  # a reservation took two minutes from open to subscribe
        purger.track_backup_watermark("06")
        assert timers.advance(CLEANUP_DELAY_S) == 0
        timers.advance(120.0 - CLEANUP_DELAY_S)
        await purger.idle()
        assert purge.calls == ["05", "06"]
    finally:
        await purger.stop()


async def test_the_floor_names_the_subscriber_that_holds_it() -> None:
    timers = ManualTimers()
    purge = FakePurge()
    acks = [("view-syncer-1", "07"), ("view-syncer-2", "04")]
    purger = Purger(purge, lambda: [w for _, w in acks], list, timers, named_acks=lambda: acks)
    try:
        purger.track_backup_watermark("09")
        timers.advance(CLEANUP_DELAY_S)
        await purger.idle()
        assert purge.calls == ["04"]
        assert (purger.floor, purger.floor_holder) == ("04", "subscriber view-syncer-2")
        assert (purger.passes, purger.deleted) == (1, 1)
    finally:
        await purger.stop()


# -- time-based retention ------------------------------------------------------------


def test_the_commit_clock_floor_is_the_newest_sample_older_than_the_retention() -> None:
    now = [0.0]
    clock = CommitClock(100.0, lambda: now[0])
    assert clock.floor() is None
    for i in range(300):  # one commit per second for five minutes
        now[0] = float(i)
        clock.record(f"{i:04d}")
    assert clock.floor() == "0199"  # committed at t=199, 100 s before t=299
    assert len(clock._samples) <= 110  # bounded: older samples are dropped
    now[0] = 1000.0
    assert clock.floor() == "0299"


async def test_retention_holds_the_floor_until_commits_are_old_enough() -> None:
    timers = ManualTimers()
    purge = FakePurge()
    retention = CommitClock(60.0, timers.monotonic)
    purger = Purger(purge, lambda: [], list, timers, retention=retention)
    try:
        retention.record("03")
        purger.track_backup_watermark("05")
        timers.advance(CLEANUP_DELAY_S)
        await purger.idle()
        assert purge.calls == []  # nothing is 60 s old yet
        assert purger.floor_holder == "retention of 60 s"
        retention.record("05")
        timers.advance(CLEANUP_DELAY_S)  # t=60: "03" is old enough
        await purger.idle()
        assert purge.calls == ["03"]
        assert purger.floor_holder == "retention of 60 s"
    finally:
        await purger.stop()


# -- the delay counts from each backup (seed 001: zero-cache 0.26's BackupMonitor) ----


async def test_a_backup_seen_just_before_the_timer_fires_is_not_purged_to(
    world: World,
) -> None:
    world.purger.track_backup_watermark("05")  # t=0: arms the 30 s timer
    world.timers.advance(29.0)
    world.purger.track_backup_watermark("09")  # t=29: only 1 s old when the timer fires
    world.timers.advance(1.0)
    await world.purger.idle()
    assert world.purge.calls == ["05"]  # not "09": it has not been backed up for 30 s
    assert (world.purger.floor, world.purger.floor_holder) == ("05", "backup")
    # Re-armed for the moment "09" is 30 s old, not a whole delay from now.
    assert world.timers.pending() == [29.0]
    assert world.timers.advance(28.5) == 0
    assert world.purge.calls == ["05"]
    assert world.timers.advance(0.5) == 1
    await world.purger.idle()
    assert world.purge.calls == ["05", "09"]
    assert world.purger.purged_watermark == "09"
    assert world.timers.pending() == []


async def test_a_backup_held_back_by_a_subscriber_waits_for_the_delay_not_the_backup(
    world: World,
) -> None:
    world.acks[:] = ["03"]
    world.purger.track_backup_watermark("05")
    await world.fire()
    assert world.purge.calls == ["03"]
    world.purger.track_backup_watermark("09")  # t=30, while the retry is armed
    assert world.timers.pending() == [30.0]  # one timer, never two
    world.acks[:] = []
    await world.fire()  # t=60: "09" is exactly 30 s old
    assert world.purge.calls == ["03", "09"]


async def test_a_delay_grown_between_arming_and_firing_is_honoured() -> None:
    timers = ManualTimers()
    purge = FakePurge()
    delay = [CLEANUP_DELAY_S]
    purger = Purger(purge, lambda: [], list, timers, delay_s=lambda: delay[0])
    try:
        purger.track_backup_watermark("05")  # t=0, armed for 30 s
        timers.advance(10.0)
        delay[0] = 120.0  # a reservation took two minutes from open to subscribe
        assert timers.advance(20.0) == 1  # t=30: the old timer fires ...
        await purger.idle()
        assert purge.calls == []  # ... but "05" is only 30 of the 120 s old
        assert timers.pending() == [90.0]  # re-armed for t=120
        assert timers.advance(89.5) == 0
        assert timers.advance(0.5) == 1
        await purger.idle()
        assert purge.calls == ["05"]
    finally:
        await purger.stop()


async def test_the_backup_history_is_bounded_and_never_purges_a_young_backup() -> None:
    timers = ManualTimers()
    step = 1 / 16  # 16 backups a second: 480 per delay, exact in binary
    seen: list[tuple[float, str]] = []  # (seen at, watermark), as fed
    violations: list[str] = []

    async def purge(watermark: str) -> int:
        # The newest backup that had been known for the whole delay must cover it.
        cutoff = timers.monotonic() - CLEANUP_DELAY_S
        old = [w for t, w in seen if t <= cutoff]
        if not old or watermark > old[-1]:
            violations.append(f"{watermark} at t={timers.monotonic()}")
        return 1

    acks = ["000000"]
    purger = Purger(purge, lambda: acks, list, timers)
    n = 0
    most = 0

    async def feed(count: int) -> None:
        nonlocal n, most
        for _ in range(count):
            n += 1
            seen.append((timers.monotonic(), f"{n:06d}"))
            purger.track_backup_watermark(f"{n:06d}")
            timers.advance(step)
            await purger.idle()
            most = max(most, len(purger._backups))
            assert len(timers.pending()) <= 1

    try:
        # A subscriber holds the floor for 3000 backups (187.5 s): the history thins.
        await feed(3000)
        assert purger.purged_watermark == "000000"
        assert most == BACKUP_HISTORY
        first_seen = {w: t for t, w in seen}
        kept = purger._backups
        assert all(first_seen[w] == t for w, t in kept)  # nobody's time was moved
        assert kept[0][0] == "000001"
        assert kept[-1][0] == f"{n:06d}"
        # The thinning spreads: no gap is far above the average one.
        gaps = [b[1] - a[1] for a, b in itertools.pairwise(kept)]
        assert max(gaps) <= 2 * (kept[-1][1] - kept[0][1]) / (BACKUP_HISTORY - 1)

        # It lets go: the purge follows the backups, exactly one delay behind.
        acks.clear()
        await feed(3000)
        assert most == BACKUP_HISTORY
        cutoff = timers.monotonic() - CLEANUP_DELAY_S
        assert purger.purged_watermark == [w for t, w in seen if t <= cutoff][-1]
        assert len(purger._backups) <= CLEANUP_DELAY_S / step + 1

        # The backups stop: one delay later the purge reaches the last one.
        timers.advance(CLEANUP_DELAY_S)
        await purger.idle()
        assert purger.purged_watermark == f"{n:06d}"
        assert purger._backups == []
        assert timers.pending() == []
        assert violations == []
    finally:
        await purger.stop()
