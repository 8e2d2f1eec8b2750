"""Broadcast (consensus timeout) and Forwarder (transaction-aligned joins, laggards)."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import pytest

from app.protocol.errors import ErrorType
from app.streamer.broadcast import Broadcast, ReleaseMode
from app.streamer.downstream import Downstream
from app.streamer.forwarder import FIRST_ACK_TIMEOUT_S, Forwarder
from app.streamer.subscriber import Change, Subscriber
from app.streamer.timers import ManualTimers

from .helpers import drain, make_sub, settle, tx

CHANGE = Change("02", "insert", '["data",{"tag":"insert"}]')


# Read afresh: mypy keeps an attribute narrowed by an ``assert`` across the calls
# that change it.
def lagging_since(sub: Subscriber) -> float | None:
    return sub.lagging_since


def started(sub: Subscriber) -> bool:
    return sub.started


def broadcast(
    subs: list[Subscriber],
    change: Change,
    *,
    timers: ManualTimers,
    timeout_proportion: float | None,
) -> Broadcast:
    """``change`` sent to ``subs`` as a checkpoint, as the forwarder does."""
    sent = [(sub, sub.send([change], track=True)) for sub in subs]
    return Broadcast(sent, timers=timers, timeout_proportion=timeout_proportion)


def checkpoint(fwd: Forwarder, change: Change) -> asyncio.Future[ReleaseMode]:
    """Forwards ``change`` as a checkpoint; the release to wait for (done: none)."""
    released = fwd.forward([change], checkpoint=True)
    if released is None:
        done: asyncio.Future[ReleaseMode] = asyncio.get_running_loop().create_future()
        done.set_result("all-subscribers")
        return done
    return released


async def live_subs(n: int, **kw: Any) -> list[tuple[Subscriber, Downstream]]:
    subs = []
    for i in range(n):
        sub, ds = make_sub("01", id=f"s{i}", **kw)
        sub.set_caught_up()
        subs.append((sub, ds))
    await settle()
    for _, ds in subs:
        drain(ds)  # the initial status
    return subs


async def test_no_subscribers_means_done_at_once() -> None:
    b = Broadcast([], timers=ManualTimers(), timeout_proportion=2.0)
    assert b.done.result() == "all-subscribers"


async def test_a_tracked_broadcast_is_done_only_when_everyone_consumed() -> None:
    subs = await live_subs(2)
    timers = ManualTimers()
    b = broadcast([s for s, _ in subs], CHANGE, timers=timers, timeout_proportion=2.0)
    drain(subs[0][1])
    await settle()
    assert not b.done.done()  # n=2: the majority is both
    assert timers.pending() == []
    drain(subs[1][1])
    await settle()
    assert b.done.result() == "all-subscribers"


async def test_majority_arms_one_proportional_timer_and_releases_at_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    subs = await live_subs(5)
    timers = ManualTimers()
    b = broadcast([s for s, _ in subs], CHANGE, timers=timers, timeout_proportion=2.0)
    timers.advance(0.1)
    drain(subs[0][1])
    drain(subs[1][1])
    await settle()
    assert timers.pending() == []  # 2 of 5: below the majority of 3
    timers.advance(0.15)
    drain(subs[2][1])
    await settle()
    assert timers.pending() == pytest.approx([0.5])  # ceil(250 ms × 2.0)
    drain(subs[3][1])
    await settle()
    assert timers.pending() == pytest.approx([0.5])  # later completions do not re-arm
    with caplog.at_level(logging.INFO, logger="app.streamer.broadcast"):
        timers.advance(0.5)
        await settle()
    assert b.done.result() == "consensus-timeout"
    # Said as zero says it, with who completed and who is still pending.
    (line,) = [r for r in caplog.records if r.name == "app.streamer.broadcast"]
    assert line.getMessage() == "continuing with 1 subscriber(s) still pending (750.000 ms)"
    fields = line.__dict__["log_fields"]
    assert (fields["completed"], fields["pending"]) == (4, [subs[4][0].id])
    assert subs[4][0].missed_last_timeout
    assert not subs[0][0].missed_last_timeout
    # Counted for /statz and /dashboard: releases that went on without it.
    assert [sub.missed_releases for sub, _ in subs] == [0, 0, 0, 0, 1]


async def test_everyone_completing_first_wins_and_clears_the_timer() -> None:
    subs = await live_subs(3)
    timers = ManualTimers()
    b = broadcast([s for s, _ in subs], CHANGE, timers=timers, timeout_proportion=2.0)
    timers.advance(0.01)
    for _, ds in subs[:2]:
        drain(ds)
    await settle()
    assert timers.pending() == pytest.approx([0.02])
    drain(subs[2][1])
    await settle()
    assert b.done.result() == "all-subscribers"
    assert timers.pending() == []
    timers.advance(1)  # a late timer is a no-op
    assert b.done.result() == "all-subscribers"


async def test_zero_elapsed_releases_on_a_zero_delay_timer() -> None:
    subs = await live_subs(3)
    timers = ManualTimers()
    b = broadcast([s for s, _ in subs], CHANGE, timers=timers, timeout_proportion=2.0)
    for _, ds in subs[:2]:
        drain(ds)
    await settle()
    assert timers.pending() == [0.0]
    timers.advance(0)
    assert b.done.result() == "consensus-timeout"


@pytest.mark.parametrize("proportion", [None, -1.0])  # -1: a negative 1.9 padding
async def test_without_a_proportion_only_everyone_releases(proportion: float | None) -> None:
    subs = await live_subs(3)
    timers = ManualTimers()
    b = broadcast([s for s, _ in subs], CHANGE, timers=timers, timeout_proportion=proportion)
    for _, ds in subs[:2]:
        drain(ds)
    await settle()
    timers.advance(3600)
    assert not b.done.done()


async def test_a_caught_up_backup_subscriber_must_respond_before_the_timer() -> None:
    subs = await live_subs(2)
    backup, backup_ds = make_sub("01", id="backup", mode="backup")
    backup.set_caught_up()
    await settle()
    drain(backup_ds)
    timers = ManualTimers()
    b = broadcast([backup] + [s for s, _ in subs], CHANGE, timers=timers, timeout_proportion=2.0)
    timers.advance(0.1)
    for _, ds in subs:
        drain(ds)
    await settle()
    assert timers.pending() == []  # majority reached, but the backup has not answered
    timers.advance(0.2)
    drain(backup_ds)
    await settle()
    assert b.done.result() == "all-subscribers"


async def test_a_catching_up_subscriber_holds_flow_control_once_its_backlog_is_full() -> None:
    sub, _ = make_sub("01", high_water=100)
    timers = ManualTimers()
    small = broadcast([sub], CHANGE, timers=timers, timeout_proportion=None)
    assert small.done.result() == "all-subscribers"  # backlog below high water
    # Past high water, below the hard bound (twice high water: there it is dropped).
    big = Change("02", "insert", '["data","' + "z" * 140 + '"]')
    b = broadcast([sub], big, timers=timers, timeout_proportion=None)
    await settle()
    assert not b.done.done()


async def test_subscribers_added_mid_transaction_start_at_the_next_transaction() -> None:
    fwd = Forwarder(timers=ManualTimers())
    early, early_ds = make_sub("01", id="early")
    fwd.add(early)
    early.set_caught_up()
    first, second = tx("02"), tx("03")
    fwd.forward([first[0]])
    late, late_ds = make_sub("01", id="late")
    late.set_caught_up()
    fwd.add(late)
    assert late in fwd.queued
    for change in first[1:]:
        fwd.forward([change])
    assert late in fwd.active
    for change in second:
        fwd.forward([change])
    await settle()
    early_msgs = [m[0] for m in drain(early_ds)]
    late_msgs = [m for m in drain(late_ds)]
    assert early_msgs == ["status"] + ["begin", "data", "commit"] * 2
    assert [m[0] for m in late_msgs] == ["status", "begin", "data", "commit"]
    assert late_msgs[-1] == ["commit", {"tag": "commit"}, {"watermark": "03"}]


async def test_subscribers_added_mid_transaction_join_after_a_rollback_too() -> None:
    fwd = Forwarder(timers=ManualTimers())
    fwd.forward([tx("02")[0]])
    late, _ = make_sub("01")
    fwd.add(late)
    assert late in fwd.queued
    fwd.forward([Change("02", "rollback", '["rollback",{"tag":"rollback"}]')])
    assert late in fwd.active


async def laggard_setup(
    grace_s: float, version: int = 7
) -> tuple[Forwarder, ManualTimers, list[tuple[Subscriber, Downstream]]]:
    timers = ManualTimers()
    fwd = Forwarder(timers=timers, timeout_proportion=2.0, grace_period_s=grace_s)
    subs = await live_subs(3, version=version)
    for sub, _ in subs:
        fwd.add(sub)
    fwd.start_progress_monitor()
    return fwd, timers, subs


async def run_ticks(
    fwd: Forwarder,
    timers: ManualTimers,
    subs: list[tuple[Subscriber, Downstream]],
    seconds: int,
    *,
    slow_consumes: bool,
) -> None:
    """Each second: a tracked broadcast that the first two consume at once."""
    for _ in range(seconds):
        task = checkpoint(fwd, CHANGE)
        await settle()
        for _, ds in subs[:2]:
            drain(ds)
        if slow_consumes:
            drain(subs[2][1])
        await settle()
        timers.advance(1.0)
        await settle()
        await task


async def test_a_chronic_laggard_is_disconnected_only_after_the_grace_period() -> None:
    fwd, timers, subs = await laggard_setup(grace_s=5)
    slow, slow_ds = subs[2]
    await run_ticks(fwd, timers, subs, 4, slow_consumes=False)
    assert not slow.closed
    assert slow.lagging_since is not None
    await run_ticks(fwd, timers, subs, 4, slow_consumes=False)
    assert slow not in fwd.active
    errors = [m for m in drain(slow_ds) if m[0] == "error"]
    assert errors
    assert errors[0][1]["type"] == int(ErrorType.STREAM_TOO_FAR_BEHIND)
    assert errors[0][1]["message"].startswith("lagging for over 5000ms")
    fwd.stop_progress_monitor()


async def test_a_v6_laggard_is_closed_without_an_error_type_v6_does_not_know() -> None:
    # zero 1.9's clients know error types 1 and 2: a v6 laggard is closed plainly,
    # and reconnects to resume, which is what StreamTooFarBehind asks of v7 ones.
    fwd, timers, subs = await laggard_setup(grace_s=5, version=6)
    slow, slow_ds = subs[2]
    await run_ticks(fwd, timers, subs, 8, slow_consumes=False)
    assert slow not in fwd.active
    assert slow_ds.closed
    assert [m for m in drain(slow_ds) if m[0] == "error"] == []
    fwd.stop_progress_monitor()


async def test_recovering_resets_the_lagging_clock_and_no_grace_disables_eviction() -> None:
    fwd, timers, subs = await laggard_setup(grace_s=5)
    slow = subs[2][0]
    await run_ticks(fwd, timers, subs, 3, slow_consumes=False)
    assert lagging_since(slow) is not None
    await run_ticks(fwd, timers, subs, 3, slow_consumes=True)
    assert slow.lagging_since is None
    fwd.stop_progress_monitor()

    fwd, timers, subs = await laggard_setup(grace_s=0)
    await run_ticks(fwd, timers, subs, 10, slow_consumes=False)
    assert subs[2][0] in fwd.active
    fwd.stop_progress_monitor()


async def test_a_subscriber_dropped_while_forwarding_does_not_break_the_fan_out() -> None:
    fwd = Forwarder(timers=ManualTimers())
    subs = []
    channels = []
    for i in range(3):
        sub, ds = make_sub("01", id=f"s{i}", max_unconsumed_bytes=400)
        ds.on_close(functools.partial(fwd.remove, sub))
        sub.set_caught_up()
        fwd.add(sub)
        subs.append(sub)
        channels.append(ds)
    await settle()
    for ds in channels:
        # Filled to within 10 bytes of a bound of 400 (no message near a quarter of
        # it): the next change overflows, dropped mid-iteration.
        ds.push(["x" * 10] * ((390 - ds.unconsumed_bytes) // 10))
    for change in tx("02"):
        fwd.forward([change])  # must not raise "set changed size during iteration"
    assert fwd.active == set()
    assert all(s.closed for s in subs)


async def test_checkpoints_are_pipelined_one_deep() -> None:
    """The main loop waits for the checkpoint before the newest, never the newest
    itself, and an ended stream leaves nothing for the next one to wait on."""
    fwd = Forwarder(timers=ManualTimers(), timeout_proportion=None)
    [(sub, ds)] = await live_subs(1)
    fwd.add(sub)
    first = checkpoint(fwd, CHANGE)
    await settle()
    assert first.result() == "all-subscribers"  # nothing before it to wait on
    second = checkpoint(fwd, CHANGE)
    await settle()
    assert not second.done()  # waits until the first checkpoint is consumed...
    assert ds.get_nowait() is not None
    ds.ack_next()
    await settle()
    assert second.result() == "all-subscribers"  # ...not the second one
    third = checkpoint(fwd, CHANGE)
    await settle()
    assert not third.done()
    fwd.release_current()  # the upstream ended
    await settle()
    assert third.done()
    fourth = checkpoint(fwd, CHANGE)
    await settle()
    assert fourth.done()


async def test_subscribers_holding_the_waited_checkpoint_past_the_grace_are_dropped() -> None:
    # One on time, two that never consume: no majority, so no consensus timer.
    fwd, timers, subs = await laggard_setup(grace_s=5)
    (good, good_ds), (stuck1, ds1), (stuck2, ds2) = subs
    checkpoint(fwd, CHANGE)  # nothing before it: not waited on
    waited = checkpoint(fwd, CHANGE)
    await settle()
    drain(good_ds)
    await settle()
    assert not waited.done()
    for _ in range(4):
        timers.advance(1.0)
        await settle()
    assert fwd.active == {good, stuck1, stuck2}  # 4 s: within the grace period
    timers.advance(1.0)
    await settle()
    assert fwd.active == {good}
    assert waited.result() == "all-subscribers"  # nobody left to wait for
    for ds in (ds1, ds2):
        errors = [m for m in drain(ds) if m[0] == "error"]
        assert errors[0][1]["type"] == int(ErrorType.STREAM_TOO_FAR_BEHIND)
        assert errors[0][1]["message"].startswith("held up flow control for over 5000ms")
    fwd.stop_progress_monitor()


async def test_a_sole_stuck_subscriber_is_dropped_and_no_grace_period_keeps_it() -> None:
    for grace_s, kept in ((3.0, False), (0.0, True)):
        timers = ManualTimers()
        fwd = Forwarder(timers=timers, timeout_proportion=2.0, grace_period_s=grace_s)
        [(sub, _ds)] = await live_subs(1)
        fwd.add(sub)
        fwd.start_progress_monitor()
        checkpoint(fwd, CHANGE)
        waited = checkpoint(fwd, CHANGE)
        for _ in range(10):
            timers.advance(1.0)
            await settle()
        assert (sub in fwd.active) is kept
        assert waited.done() is not kept
        fwd.stop_progress_monitor()


async def test_the_first_ack_clock_starts_when_the_first_message_is_sent() -> None:
    """A subscriber still waiting for its catch-up to start (the log to become
    durable, a catch-up turn) was sent nothing, so it is not dropped for acking
    nothing; once sent its status, it has FIRST_ACK_TIMEOUT_S to ack it."""
    timers = ManualTimers()
    fwd = Forwarder(timers=timers)
    waiting, ds = make_sub("01", id="waiting")
    fwd.add(waiting)
    fwd.start_progress_monitor()
    for _ in range(3 * int(FIRST_ACK_TIMEOUT_S)):
        timers.advance(1.0)
    assert waiting in fwd.active
    assert not started(waiting)
    waiting.set_caught_up()  # its status goes out now
    assert waiting.started
    assert [m[0] for m in drain(ds, ack=False)] == ["status"]
    for _ in range(int(FIRST_ACK_TIMEOUT_S) - 1):
        timers.advance(1.0)
    assert waiting in fwd.active
    for _ in range(2):
        timers.advance(1.0)
    assert waiting not in fwd.active
    assert waiting.closed
    fwd.stop_progress_monitor()
