"""Waiting on a condition in a test: polled, bounded, and named when it times out."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

POLL_S = 0.01


async def eventually(
    check: Callable[[], Any | Awaitable[Any]],
    what: str,
    timeout_s: float = 10.0,
    *,
    poll_s: float = POLL_S,
) -> Any:
    """Polls ``check()`` (sync or async) until it returns something truthy, and
    returns that; fails naming ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        assert loop.time() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(poll_s)
