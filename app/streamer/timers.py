"""Clocks and timers, injected so that every timing rule can be tested exactly.

Production code uses ``LoopTimers`` (the event loop's monotonic clock and
``call_later``). Tests use ``ManualTimers``: time stands still until the test
calls ``advance``, which fires due callbacks in deadline order.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards."""
        ...

    def wall_ms(self) -> float:
        """Milliseconds since the Unix epoch (for lag reports and logs)."""
        ...

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> TimerHandle:
        """Runs ``callback`` (synchronously, on the loop) after ``delay_s`` seconds."""
        ...


class LoopTimers:
    """The running event loop's clock and timers."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall_ms(self) -> float:
        return time.time() * 1000.0

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> TimerHandle:
        return asyncio.get_running_loop().call_later(max(0.0, delay_s), callback)


class _ManualHandle:
    __slots__ = ("cancelled", "deadline", "delay_s")

    def __init__(self, deadline: float, delay_s: float) -> None:
        self.deadline = deadline
        self.delay_s = delay_s
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualTimers:
    """Deterministic timers for tests: nothing fires until ``advance``."""

    def __init__(self, start_wall_ms: float = 1_700_000_000_000.0) -> None:
        self._now = 0.0
        self._wall0 = start_wall_ms
        self._seq = itertools.count()
        self._heap: list[tuple[float, int, _ManualHandle, Callable[[], None]]] = []
        self.armed: list[float] = []  # every delay ever armed, in order (for assertions)

    def monotonic(self) -> float:
        return self._now

    def wall_ms(self) -> float:
        return self._wall0 + self._now * 1000.0

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> TimerHandle:
        delay = max(0.0, delay_s)
        handle = _ManualHandle(self._now + delay, delay)
        heapq.heappush(self._heap, (handle.deadline, next(self._seq), handle, callback))
        self.armed.append(delay)
        return handle

    def pending(self) -> list[float]:
        """Delays (from now) of the timers still armed."""
        return sorted(h.deadline - self._now for _, _, h, _ in self._heap if not h.cancelled)

    def advance(self, seconds: float) -> int:
        """Moves time forward, firing due timers in order; returns how many fired."""
        target = self._now + seconds
        fired = 0
        while self._heap and self._heap[0][0] <= target:
            deadline, _, handle, callback = heapq.heappop(self._heap)
            if handle.cancelled:
                continue
            self._now = deadline
            callback()
            fired += 1
        self._now = target
        return fired
