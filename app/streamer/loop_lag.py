"""How late the event loop runs what is due: the stall a subscriber's ping sees.

Every ``INTERVAL_S`` a sleep is scheduled; it wakes ``lag`` late when something
held the loop (a big value's copy, a long callback). ``LoopLag`` keeps the latest
lag and the largest of the last ``WINDOW_S``, for ``/statz`` (group ``os``) and
``/metrics`` (``changestreamer_event_loop_lag_seconds``). Costs one wake-up per
interval. The service runs one while it streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Final

__all__ = ["LoopLag"]

INTERVAL_S: Final = 0.05
WINDOW_S: Final = 60.0


class LoopLag:
    def __init__(self) -> None:
        self.latest_s = 0.0
        self._samples: deque[tuple[float, float]] = deque()  # (monotonic, lag), bounded
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def max_s(self, within_s: float = WINDOW_S) -> float:
        """The largest lag of the last ``within_s`` (at most ``WINDOW_S``)."""
        if not self._samples:
            return 0.0
        since = self._samples[-1][0] - within_s  # samples come every INTERVAL_S
        return max(lag for at, lag in self._samples if at >= since)

    def record(self, now: float, lag: float) -> None:
        self.latest_s = lag
        samples = self._samples
        samples.append((now, lag))
        while samples and samples[0][0] < now - WINDOW_S:
            samples.popleft()

    async def _run(self) -> None:
        while True:
            due = time.monotonic() + INTERVAL_S
            await asyncio.sleep(INTERVAL_S)
            now = time.monotonic()
            self.record(now, max(0.0, now - due))
