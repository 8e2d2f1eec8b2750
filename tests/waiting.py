"""Waiting on a condition in a test: polled, bounded, and named when it times out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

POLL_S = 0.01


async def eventually(
    check: Callable[[], Any | Awaitable[Any]],
    what: str | Callable[[], str],
    timeout_s: float = 10.0,
    *,
    poll_s: float = POLL_S,
) -> Any:
    """Polls ``check()`` (sync or async) until it returns something truthy, and
    returns that; fails naming ``what`` after ``timeout_s`` (a callable ``what``
    is asked then: what the last check saw, a child's output)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = await _checked(check)
        if value:
            return value
        assert loop.time() < deadline, f"timed out after {timeout_s} s waiting for {_named(what)}"
        await asyncio.sleep(poll_s)


async def stays(
    check: Callable[[], Any | Awaitable[Any]],
    seconds: float,
    what: str,
    *,
    poll_s: float = POLL_S,
) -> None:
    """Observes that ``check()`` (sync or async) stays truthy for ``seconds``:
    checked every ``poll_s`` and failing at once, naming ``what``, if it breaks.
    For the tests that assert something does NOT happen: the window is the
    claim's bound, stated, not a sleep hoping something has finished."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        value = await _checked(check)
        assert value, f"{what} broke within {seconds} s"
        if loop.time() >= deadline:
            return
        await asyncio.sleep(min(poll_s, max(0.0, deadline - loop.time())))


def eventually_blocking(
    check: Callable[[], Any],
    what: str | Callable[[], str],
    timeout_s: float = 10.0,
    *,
    poll_s: float = POLL_S,
) -> Any:
    """``eventually`` for a synchronous test: the condition is another process's
    (a child's files, its HTTP answers), polled from the test's own thread."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, (
            f"timed out after {timeout_s} s waiting for {_named(what)}"
        )
        time.sleep(poll_s)


async def _checked(check: Callable[[], Any | Awaitable[Any]]) -> Any:
    """``check()``, awaited if it is a coroutine."""
    value = check()
    return await value if asyncio.iscoroutine(value) else value


def _named(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()
