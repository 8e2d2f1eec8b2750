"""``asyncio.wait_for`` without Python 3.11's lost cancel.

On Python 3.11 ``asyncio.wait_for`` returns the awaited result, instead of raising
``CancelledError``, when its task is cancelled just as the awaited thing completes
(bpo-42130, fixed in 3.12 by reimplementing it on ``asyncio.timeout``). A task
stopped with ``cancel()`` then runs on: that is how the Postgres pump and a
benchmark's reader each hung for good (docs/reliability.md, the disk_full stall).
``within`` is the same wait on ``asyncio.timeout``, which delivers the cancel;
every bounded wait in the service goes through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["within"]

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """``await awaitable``, or ``TimeoutError`` after ``timeout_s`` (None: no limit)."""
    async with asyncio.timeout(timeout_s):
        return await awaitable
