"""The service's backup watch: backed-up watermarks, the coverage gate, the lags."""

from __future__ import annotations

import asyncio

import pytest

from app.streamer.backup_watch import DURABLE_HISTORY, BackupWatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


_UNSET = "unset"


def watch(
    clock: Clock, backup_url: str | None = "file:///b", target: str | None = "05", **kwargs: float
) -> BackupWatch:
    """A watch whose monitor read the replica at ``target`` (``_UNSET``: not yet)."""
    w = BackupWatch(backup_url=backup_url, replica_file=None, clock=clock, **kwargs)
    if target != _UNSET:
        w.set_coverage_target(target)
    return w


def test_each_backed_up_watermark_reaches_every_listener_in_order_even_an_older_one() -> None:
    w = watch(Clock())
    heard: list[tuple[str, str]] = []
    w.listeners += [lambda m: heard.append(("a", m)), lambda m: heard.append(("b", m))]
    w.activate()
    w.track("07")
    w.track("06")  # older: the listeners deduplicate, the watch keeps the newest
    assert heard == [("a", "07"), ("b", "07"), ("a", "06"), ("b", "06")]
    assert w.watermark == "07"


def test_without_backups_the_gate_is_open_with_them_a_backup_must_reach_the_target() -> None:
    assert watch(Clock(), backup_url=None).covered()
    w = watch(Clock())
    assert not w.covered()
    w.track("04")
    assert not w.covered()
    w.set_coverage_target("04")  # the monitor read the replica's position
    assert w.covered()


def test_before_this_task_owns_the_log_backups_reach_the_gate_but_no_listener() -> None:
    # Purges, acks and reservation confirmations are the owner's: a node waiting to
    # take over only watches the gate. Taking over hands the listeners the newest.
    w = watch(Clock())
    heard: list[str] = []
    w.listeners.append(heard.append)
    w.track("04")
    w.track("06")
    assert heard == []
    assert w.covered()
    w.activate()
    assert heard == ["06"]
    w.track("08")
    assert heard == ["06", "08"]


async def test_no_backup_opens_the_gate_before_the_monitor_read_the_replica() -> None:
    w = watch(Clock(), target=_UNSET)
    waiter = asyncio.ensure_future(w.wait_target())
    w.track("09")
    await asyncio.sleep(0)
    assert not w.covered()
    assert not waiter.done()
    w.set_coverage_target("07")  # the newest backup already covers it
    await asyncio.wait_for(waiter, 1)
    assert w.covered()
    await asyncio.wait_for(watch(Clock(), backup_url=None, target=_UNSET).wait_target(), 1)


def test_without_a_replica_position_the_first_backup_opens_the_gate() -> None:
    w = watch(Clock())
    w.set_coverage_target(None)  # the monitor could not read the replica
    assert not w.covered()
    w.track("01")
    assert w.covered()


async def test_wait_covered_returns_once_the_gate_opens_and_stays_open() -> None:
    w = watch(Clock())
    waiter = asyncio.ensure_future(w.wait_covered())
    await asyncio.sleep(0)
    assert not waiter.done()
    w.track("05")
    await asyncio.wait_for(waiter, 1)
    w.set_coverage_target("09")  # the gate does not close again
    assert w.covered()
    await asyncio.wait_for(w.wait_covered(), 1)


def test_a_subscriber_s_ack_lag_is_the_wait_of_the_oldest_durable_commit_after_it() -> None:
    clock = Clock()
    w = watch(clock)
    assert w.last_commit_age_s() is None
    w.on_durable("02")
    clock.now = 3.0
    w.on_durable("03")
    clock.now = 4.0
    assert w.durable_wait_s("01") == pytest.approx(4.0)
    assert w.durable_wait_s("02") == pytest.approx(1.0)
    assert w.durable_wait_s("03") == 0.0
    assert w.last_commit_age_s() == pytest.approx(1.0)


def test_the_history_is_bounded_and_an_older_watermark_waits_at_least_the_oldest_kept() -> None:
    clock = Clock()
    w = watch(clock)
    for i in range(DURABLE_HISTORY + 10):
        clock.now = float(i)
        w.on_durable(f"{i:08d}")
    assert w.durable_wait_s("") == pytest.approx(clock.now - 10)


def test_the_commit_clock_exists_only_with_a_retention() -> None:
    assert watch(Clock()).commit_clock is None
    clock = Clock()
    w = watch(clock, retention_s=10.0)
    assert w.commit_clock is not None
    w.on_durable("02")
    clock.now = 11.0
    assert w.commit_clock.floor() == "02"


def test_no_backups_started_means_no_problem_and_no_stats() -> None:
    w = watch(Clock())
    assert (w.problem(), w.stats(), w.lag_s()) == (None, None, None)
