"""``within``: a bounded wait whose task can always be cancelled."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

import pytest

from app.timeouts import within


async def outcome(wait: Callable[[Awaitable[bool], float], Awaitable[bool]]) -> str:
    """Cancels a task in the same turn of the loop in which what it waits for
    completes: the race Python 3.11's ``wait_for`` loses."""
    event = asyncio.Event()

    async def waiter() -> str:
        await wait(event.wait(), 10)
        return "returned"

    task = asyncio.create_task(waiter())
    for _ in range(3):
        await asyncio.sleep(0)
    event.set()
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


async def test_a_cancel_that_meets_completion_is_not_lost() -> None:
    assert await outcome(within) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for was fixed in 3.12")
async def test_wait_for_loses_that_cancel_here() -> None:
    """Why ``within`` exists: the same race with ``asyncio.wait_for``."""
    assert await outcome(asyncio.wait_for) == "returned"


async def test_a_timeout_and_a_result() -> None:
    with pytest.raises(TimeoutError):
        await within(asyncio.Event().wait(), 0.01)
    assert await within(asyncio.sleep(0, "done"), None) == "done"
