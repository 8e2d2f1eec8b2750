"""Snapshot reservations (core.md §5.8 [new], wire.md §3; §7 items 29 and 66)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

import pytest

from app.protocol.canonical_json import loads
from app.streamer.purge import CLEANUP_DELAY_S, Purger
from app.streamer.reservations import (
    BackupsNotConfiguredError,
    Reservation,
    SnapshotReservations,
    TooManyReservations,
)
from app.streamer.timers import ManualTimers

BACKUP_URL: Final = "s3://bucket/zero/replica"
PENDING: Final = "<pending>"


@dataclass(frozen=True)
class State:
    replica_version: str
    min_watermark: str


class ChangeLogStates:
    """A fake ``Replication.change_log_state``: settable, can fail or block."""

    def __init__(self, min_watermark: str = "01") -> None:
        self.min_watermark = min_watermark
        self.reads = 0
        self.errors: list[Exception] = []
        self.gate: asyncio.Event | None = None

    async def __call__(self) -> State:
        self.reads += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.errors:
            raise self.errors.pop(0)
        return State("01", self.min_watermark)


class World:
    def __init__(self, backup_url: str | None = BACKUP_URL) -> None:
        self.timers = ManualTimers()
        self.states = ChangeLogStates()
        self.reservations = SnapshotReservations(self.states, backup_url, self.timers)


@pytest.fixture
async def world() -> AsyncIterator[World]:
    w = World()
    yield w
    await w.reservations.stop()


async def poll(reservation: Reservation) -> Any:
    """The next message (parsed), None if the reservation ended, PENDING if none yet."""
    task: asyncio.Future[str | None] = asyncio.ensure_future(anext(reservation, None))
    await asyncio.sleep(0)
    if task.done():
        message = task.result()
        return None if message is None else loads(message)
    task.cancel()
    await asyncio.wait({task})
    return PENDING


def status(min_watermark: str) -> list[Any]:
    return [
        "status",
        {
            "tag": "status",
            "backupURL": BACKUP_URL,
            "replicaVersion": "01",
            "minWatermark": min_watermark,
        },
    ]


# -- item 29 -------------------------------------------------------------------------


async def test_open_without_backups_configured_fails() -> None:
    world = World(backup_url=None)
    with pytest.raises(BackupsNotConfiguredError, match="backups are not configured"):
        world.reservations.open("task-1")


async def test_status_is_withheld_until_a_backup_watermark_is_known(world: World) -> None:
    r = world.reservations.open("task-1")
    await world.reservations.idle()
    assert await poll(r) == PENDING
    assert world.states.reads == 0
    assert world.reservations.reserved_watermarks() == []

    world.reservations.track_backup_watermark("08")
    await world.reservations.idle()
    assert await poll(r) == status("08")
    assert world.reservations.reserved_watermarks() == ["08"]


async def test_open_confirms_immediately_when_a_backup_is_known(world: World) -> None:
    world.reservations.track_backup_watermark("08")
    r = world.reservations.open("task-1")
    await world.reservations.idle()
    assert await poll(r) == status("08")


async def test_min_watermark_is_the_backup_watermark_not_the_log_minimum(world: World) -> None:
    world.states.min_watermark = "03"
    world.reservations.track_backup_watermark("0a")
    r = world.reservations.open("task-1")
    await world.reservations.idle()
    assert await poll(r) == status("0a")


async def test_subscribing_closes_the_reservation_cleanly(world: World) -> None:
    world.reservations.track_backup_watermark("08")
    r = world.reservations.open("task-1")
    await world.reservations.idle()
    assert await poll(r) == status("08")

    world.reservations.close_for_task("task-1")
    assert await poll(r) is None
    assert r.closed.done()
    assert r.outcome == "completed"
    assert world.reservations.reserved_watermarks() == []


async def test_a_confirmed_reservation_does_not_hold_purges_below_the_backup(
    world: World,
) -> None:
    timers = ManualTimers()
    purged: list[str] = []

    async def purge(watermark: str) -> int:
        purged.append(watermark)
        return 0

    purger = Purger(purge, list, world.reservations.reserved_watermarks, timers)
    world.reservations.open("task-1")
    world.reservations.track_backup_watermark("08")
    purger.track_backup_watermark("08")
    await world.reservations.idle()
    timers.advance(CLEANUP_DELAY_S)
    await purger.idle()
    assert purged == ["08"]

    # A newer backup: the reservation keeps the floor at its watermark.
    world.reservations.track_backup_watermark("0c")
    purger.track_backup_watermark("0c")
    timers.advance(CLEANUP_DELAY_S)
    await purger.idle()
    assert purged == ["08"]
    await purger.stop()


async def test_no_confirmation_while_the_log_starts_after_the_backup(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world.states.min_watermark = "09"
    r = world.reservations.open("task-1")
    world.reservations.track_backup_watermark("08")
    await world.reservations.idle()
    assert await poll(r) == PENDING
    assert "the change log starts at 09, after the backup at 08" in caplog.text
    assert world.reservations.reserved_watermarks() == []

    world.reservations.track_backup_watermark("0b")  # retried at the next backup
    await world.reservations.idle()
    assert await poll(r) == status("0b")


# -- item 66 -------------------------------------------------------------------------


async def test_confirmation_pushes_exactly_one_status(world: World) -> None:
    r = world.reservations.open("task-1")
    world.reservations.track_backup_watermark("08")
    await world.reservations.idle()
    world.reservations.track_backup_watermark("0a")
    await world.reservations.idle()

    assert await poll(r) == status("08")
    assert await poll(r) == PENDING
    # The reservation stays pinned to its first confirmation.
    assert world.reservations.reserved_watermarks() == ["08"]
    assert world.states.reads == 1


async def test_one_backup_confirms_every_pending_reservation(world: World) -> None:
    r1 = world.reservations.open("task-1")
    r2 = world.reservations.open("task-2")
    world.reservations.track_backup_watermark("08")
    await world.reservations.idle()
    assert await poll(r1) == status("08")
    assert await poll(r2) == status("08")
    assert world.reservations.reserved_watermarks() == ["08", "08"]


async def test_a_later_reservation_is_confirmed_at_the_current_backup(world: World) -> None:
    world.reservations.open("task-1")
    world.reservations.track_backup_watermark("08")
    await world.reservations.idle()
    world.reservations.track_backup_watermark("0a")
    r2 = world.reservations.open("task-2")
    await world.reservations.idle()
    assert await poll(r2) == status("0a")
    assert sorted(world.reservations.reserved_watermarks()) == ["08", "0a"]


async def test_opening_again_for_a_task_cancels_the_previous_reservation(world: World) -> None:
    first = world.reservations.open("task-1")
    second = world.reservations.open("task-1")
    assert await poll(first) is None
    assert first.outcome == "cancelled"

    world.reservations.track_backup_watermark("08")
    await world.reservations.idle()
    assert await poll(second) == status("08")
    assert world.reservations.reserved_watermarks() == ["08"]


async def test_cancelling_a_superseded_reservation_leaves_the_replacement(world: World) -> None:
    world.reservations.track_backup_watermark("08")
    first = world.reservations.open("task-1")
    await world.reservations.idle()
    second = world.reservations.open("task-1")
    await world.reservations.idle()

    first.cancel()
    assert second.is_open
    assert world.reservations.reserved_watermarks() == ["08"]
    world.reservations.close_for_task("task-1")
    assert second.outcome == "completed"


async def test_cancel_removes_the_reservation(world: World) -> None:
    world.reservations.track_backup_watermark("08")
    r = world.reservations.open("task-1")
    await world.reservations.idle()
    r.cancel()
    assert await poll(r) is None  # an undelivered status is dropped
    assert r.outcome == "cancelled"
    assert world.reservations.reserved_watermarks() == []
    world.reservations.close_for_task("task-1")  # gone already: a no-op
    assert r.outcome == "cancelled"


async def test_unknown_task_ids_are_no_ops(world: World) -> None:
    r = world.reservations.open("task-1")
    world.reservations.close_for_task("unknown-task")
    assert r.is_open
    world.reservations.track_backup_watermark("08")  # and no reservation for others
    await world.reservations.idle()
    assert world.reservations.reserved_watermarks() == ["08"]


async def test_backup_with_no_reservations_reads_nothing(world: World) -> None:
    world.reservations.track_backup_watermark("08")
    await world.reservations.idle()
    assert world.states.reads == 0


async def test_the_confirmation_delay_is_noted_once_per_backup(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world.states.min_watermark = "09"
    world.reservations.track_backup_watermark("08")
    world.reservations.open("task-1")
    await world.reservations.idle()
    world.reservations.open("task-2")
    await world.reservations.idle()
    world.reservations.open("task-1")
    await world.reservations.idle()
    delayed = [r for r in caplog.records if "cannot confirm" in r.getMessage()]
    assert len(delayed) == 1
    assert delayed[0].levelno == logging.ERROR
    assert world.states.reads == 3


async def test_the_completion_time_is_noted_once(world: World) -> None:
    r = world.reservations.open("task-1")
    world.timers.advance(12.0)
    world.reservations.close_for_task("task-1")
    world.timers.advance(100.0)
    r.cancel()
    world.reservations.close_for_task("task-1")
    assert world.reservations.longest_completed_s == 12.0

    # A cancelled reservation does not count, however long it was open.
    r2 = world.reservations.open("task-1")
    world.timers.advance(50.0)
    r2.cancel()
    assert world.reservations.longest_completed_s == 12.0


# -- robustness --------------------------------------------------------------------


async def test_a_failing_state_read_is_logged_and_retried_at_the_next_backup(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world.states.errors[:] = [ConnectionError("change db unreachable")]
    world.reservations.track_backup_watermark("08")
    r = world.reservations.open("task-1")
    await world.reservations.idle()
    assert "change db unreachable" in caplog.text
    assert await poll(r) == PENDING
    assert world.reservations.reserved_watermarks() == []

    world.reservations.track_backup_watermark("09")
    await world.reservations.idle()
    assert await poll(r) == status("09")


async def test_the_watermark_is_held_while_it_is_being_confirmed(world: World) -> None:
    world.states.gate = asyncio.Event()
    world.reservations.track_backup_watermark("08")
    r = world.reservations.open("task-1")
    await asyncio.sleep(0)
    assert world.states.reads == 1
    # A purge computed now must not pass the watermark about to be promised.
    assert world.reservations.reserved_watermarks() == ["08"]

    world.states.gate.set()
    await world.reservations.idle()
    assert await poll(r) == status("08")


async def test_a_reservation_closed_during_confirmation_is_not_confirmed(world: World) -> None:
    world.states.gate = asyncio.Event()
    world.reservations.track_backup_watermark("08")
    r = world.reservations.open("task-1")
    await asyncio.sleep(0)
    r.cancel()
    assert world.reservations.reserved_watermarks() == []
    world.states.gate.set()
    await world.reservations.idle()
    assert r.reserved_watermark is None
    assert world.reservations.reserved_watermarks() == []


async def test_stop_cancels_every_reservation_and_the_confirmation(world: World) -> None:
    world.states.gate = asyncio.Event()
    r1 = world.reservations.open("task-1")
    r2 = world.reservations.open("task-2")
    world.reservations.track_backup_watermark("08")
    await asyncio.sleep(0)
    await world.reservations.stop()
    assert (r1.outcome, r2.outcome) == ("cancelled", "cancelled")
    assert r1.closed.done()
    assert r2.closed.done()
    assert world.reservations.reserved_watermarks() == []
    with pytest.raises(RuntimeError, match="stopped"):
        world.reservations.open("task-3")


async def test_iteration_ends_when_the_reservation_ends_while_waiting(world: World) -> None:
    r = world.reservations.open("task-1")
    waiter = asyncio.ensure_future(anext(r, None))
    await asyncio.sleep(0)
    assert not waiter.done()
    world.reservations.close_for_task("task-1")
    assert await waiter is None


# -- replica size, the open-time cap, open tasks ---------------------------------------


async def test_the_status_carries_the_replica_size_when_known() -> None:
    timers = ManualTimers()
    reservations = SnapshotReservations(
        ChangeLogStates(), BACKUP_URL, timers, replica_size=lambda: 123_456
    )
    try:
        r = reservations.open("task-1")
        reservations.track_backup_watermark("08")
        await reservations.idle()
        message = await poll(r)
        assert message == ["status", {**status("08")[1], "replicaSize": 123_456}]
    finally:
        await reservations.stop()


async def test_a_reservation_open_past_the_cap_is_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    timers = ManualTimers()
    reservations = SnapshotReservations(ChangeLogStates(), BACKUP_URL, timers, max_open_s=600)
    try:
        r = reservations.open("task-1")
        assert reservations.open_tasks == ["task-1"]
        timers.advance(599)
        assert r.is_open
        with caplog.at_level(logging.WARNING):
            timers.advance(1)
        assert r.outcome == "cancelled"
        assert reservations.open_tasks == []
        assert reservations.longest_completed_s == 0.0  # not a completed restore
        assert any("open for 600 s" in rec.getMessage() for rec in caplog.records)
    finally:
        await reservations.stop()


async def test_a_completed_reservation_does_not_expire_later() -> None:
    timers = ManualTimers()
    reservations = SnapshotReservations(ChangeLogStates(), BACKUP_URL, timers, max_open_s=600)
    try:
        r = reservations.open("task-1")
        timers.advance(100)
        reservations.close_for_task("task-1")
        assert r.outcome == "completed"
        assert timers.pending() == []  # its expiry timer is gone
        assert reservations.longest_completed_s == 100
    finally:
        await reservations.stop()


async def test_reservations_are_bounded_in_number_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="app.streamer.reservations")
    timers = ManualTimers()
    reservations = SnapshotReservations(ChangeLogStates(), BACKUP_URL, timers, max_open=2)
    try:
        reservations.open("a")
        reservations.open("b")
        with pytest.raises(TooManyReservations, match="at most 2 snapshot reservations"):
            reservations.open("c")
        reservations.open("b")  # a replacement takes no new place
        assert reservations.open_tasks == ["a", "b"]
        lines = [r.getMessage() for r in caplog.records]
        assert "snapshot reservation opened for task a" in lines
        assert any(line.startswith("snapshot reservation of task b replaced") for line in lines)
        assert any("refused a snapshot reservation for task c" in line for line in lines)
    finally:
        await reservations.stop()


async def test_replacing_a_reservation_does_not_extend_its_cap() -> None:
    timers = ManualTimers()
    reservations = SnapshotReservations(ChangeLogStates(), BACKUP_URL, timers, max_open_s=100.0)
    try:
        reservations.open("a")
        timers.advance(60.0)
        reservations.open("a")  # anyone may replace it: the cap still counts from the first
        timers.advance(41.0)
        await asyncio.sleep(0)
        assert not reservations.is_open("a")
    finally:
        await reservations.stop()
