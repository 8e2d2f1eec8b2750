"""Waiting on a condition in a test: polled, bounded, and named when it times out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.01


async def eventually(check: Callable[[], T | None], what: str, timeout_s: float = 10.0) -> T:
    """Polls ``check()`` until it returns something truthy, and returns that; fails
    with ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(POLL_S)
