"""The handshake admission rule (app/server/admission.py), on a clock the test moves.

The bucket's timer runs on the real event loop; the test's clock decides how many
tokens a release finds, so every expectation is exact (the rate is a power of two
and the clock moves by multiples of its inverse: no rounding)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from app.server.admission import HandshakeAdmission
from tests.waiting import eventually, stays

RATE = 1024.0  # tokens a second: the timer re-checks about every millisecond


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Waiter:
    name: str
    order: list[str] = field(default_factory=list)
    waiting: bool = True

    def admitted(self) -> None:
        assert self.waiting, f"{self.name} admitted twice or after it left"
        self.waiting = False
        self.order.append(self.name)


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    await eventually(check, "the admissions", timeout_s, poll_s=0.005)


async def test_a_burst_goes_at_once_then_one_per_token_in_arrival_order() -> None:
    clock = Clock()
    admission = HandshakeAdmission(rate=RATE, burst=3, max_waiting=10, clock=clock)
    order: list[str] = []
    waiters = [Waiter(f"w{i}", order) for i in range(6)]
    for w in waiters:
        assert admission.offer(w)
    assert order == ["w0", "w1", "w2"]  # the burst
    assert admission.waiting == 3
    clock.now += 2 / RATE  # two tokens' worth
    await until(lambda: len(order) == 5)
    assert order == ["w0", "w1", "w2", "w3", "w4"]
    clock.now += 1.0  # plenty: the rest, and the bucket refills only to the burst
    await until(lambda: len(order) == 6)
    assert admission.admitted_total == 6
    assert admission.held_total == 3
    assert admission.waiting == 0


async def test_a_waiter_that_left_is_skipped_and_costs_no_token() -> None:
    clock = Clock()
    admission = HandshakeAdmission(rate=RATE, burst=1, max_waiting=10, clock=clock)
    order: list[str] = []
    first, gone, third, fourth = (Waiter(n, order) for n in ("first", "gone", "third", "fourth"))
    for w in (first, gone, third, fourth):
        admission.offer(w)
    gone.waiting = False  # closed, or timed out, while it waited
    clock.now += 1 / RATE  # one token
    await until(lambda: len(order) == 2)
    await stays(lambda: order == ["first", "third"], 0.01, "no third admission")
    assert order == ["first", "third"]
    assert fourth.waiting


async def test_beyond_max_waiting_an_offer_is_refused() -> None:
    clock = Clock()
    admission = HandshakeAdmission(rate=1.0, burst=1, max_waiting=2, clock=clock)
    assert admission.offer(Waiter("a"))
    assert admission.offer(Waiter("b"))
    assert admission.offer(Waiter("c"))
    refused = Waiter("d")
    assert not admission.offer(refused)
    assert refused.waiting  # never admitted: the caller refuses it


async def test_a_full_queue_makes_room_by_dropping_those_that_left() -> None:
    admission = HandshakeAdmission(rate=1.0, burst=1, max_waiting=2, clock=Clock())
    assert admission.offer(Waiter("a"))  # the burst
    b, c = Waiter("b"), Waiter("c")
    assert admission.offer(b)
    assert admission.offer(c)
    c.waiting = False  # left, behind b (the head)
    assert admission.offer(Waiter("d"))
    assert admission.waiting == 2
    assert not admission.offer(Waiter("e"))


@pytest.mark.parametrize(
    ("rate", "burst", "max_waiting"), [(0.0, 1.0, 1), (1.0, 0.5, 1), (1.0, 1.0, -1)]
)
def test_bad_bounds_are_refused(rate: float, burst: float, max_waiting: int) -> None:
    with pytest.raises(ValueError, match="bad admission bounds"):
        HandshakeAdmission(rate, burst, max_waiting)
