"""The one high/low-water gate (app/flow_gate.py) that the storer's queue, a
catching-up subscriber's backlog, the upstream pump and the replication socket's
reads pause on."""

from __future__ import annotations

import asyncio

import pytest

from app.flow_gate import HighLowGate


async def test_it_closes_at_high_water_and_opens_only_back_at_low_water() -> None:
    gate = HighLowGate(10, 4)
    assert not gate.rise(9)
    assert gate.wait() is None
    assert gate.rise(10)
    waiter = gate.wait()
    assert waiter is not None
    assert gate.wait() is waiter  # one future per closing
    assert not gate.fall(5)  # between the marks: still closed
    assert gate.rise(6)
    assert not waiter.done()
    assert gate.fall(4)
    assert waiter.done()
    assert waiter.result() is None
    assert not gate.closed
    assert gate.wait() is None
    assert not gate.fall(0)  # already open: nothing opened now


async def test_opening_by_force_and_failing_the_waiter() -> None:
    gate = HighLowGate(2, 1)
    gate.rise(3)
    first = gate.wait()
    gate.open()
    assert first is not None
    assert first.done()
    assert not gate.closed
    gate.rise(2)
    second = gate.wait()
    assert second is not None
    assert second is not first
    gate.fail(TimeoutError("wedged"))
    with pytest.raises(TimeoutError, match="wedged"):
        await second
    assert not gate.closed  # whoever comes next closes it anew


async def test_opened_returns_when_the_level_is_back_at_low_water() -> None:
    gate = HighLowGate(2, 0)
    gate.rise(2)
    waiting = asyncio.create_task(gate.opened())
    await asyncio.sleep(0)  # the task is now waiting on the gate
    assert not waiting.done()
    gate.fall(0)
    await asyncio.wait_for(waiting, 1)
    await asyncio.wait_for(gate.opened(), 1)  # open: at once


def test_marks_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="low water 5 must be between 0 and high water 4"):
        HighLowGate(4, 5)
