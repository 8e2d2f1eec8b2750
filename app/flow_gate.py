"""One high/low-water gate for everything that pauses a producer on a level.

The storer's queue, a catching-up subscriber's backlog, the upstream pump's
read-ahead and the replication socket's complete frames each hold a level (bytes
or messages) that a producer must not push past. The gate closes when the level
reaches high water and opens only once it is back at low water, so a paused
producer resumes with room for a while instead of at every byte that frees
(hysteresis, as uvicorn's ``FlowControl`` and asyncio's transports do it).

The gate only keeps the state: each owner calls :meth:`rise` after its level
grew and :meth:`fall` after it fell, and awaits :meth:`wait` (one future per
closing, made only when someone waits) or reads :attr:`closed`.
"""

from __future__ import annotations

import asyncio

__all__ = ["HighLowGate"]


class HighLowGate:
    __slots__ = ("_closed", "_waiter", "high", "low")

    def __init__(self, high: int, low: int) -> None:
        if not 0 <= low <= high:
            raise ValueError(f"low water {low} must be between 0 and high water {high}")
        self.high = high
        self.low = low
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def rise(self, level: int) -> bool:
        """The level grew to ``level``: the gate closes at high water. True while closed."""
        if level >= self.high:
            self._closed = True
        return self._closed

    def fall(self, level: int) -> bool:
        """The level fell to ``level``: the gate opens at low water. True if it opened now."""
        if self._closed and level <= self.low:
            self.open()
            return True
        return False

    def open(self) -> None:
        """Opens the gate whatever the level (nothing is held back any more)."""
        self._closed = False
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: BaseException) -> None:
        """Fails whoever waits with ``error`` (the consumer is wedged); the gate is
        open again, for whoever comes next to close it anew."""
        self._closed = False
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    async def opened(self) -> None:
        """Returns once the gate is open (at once if it is)."""
        waiter = self.wait()
        if waiter is not None:
            await waiter

    def wait(self) -> asyncio.Future[None] | None:
        """None while open; else the future that completes when the gate opens."""
        if not self._closed:
            return None
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter
