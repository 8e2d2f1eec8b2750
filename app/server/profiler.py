"""cProfile captures of the event loop, one at a time, for ``/profz`` and ``/profile``."""

from __future__ import annotations

import asyncio
import cProfile
import marshal
from collections.abc import Awaitable, Callable


class ProfilerBusy(Exception):
    """A profile is already being captured."""


class LoopProfiler:
    """Captures cProfile data of the calling (event loop) thread, one capture at a time."""

    def __init__(self) -> None:
        self._busy = False

    @property
    def busy(self) -> bool:
        return self._busy

    async def capture(
        self, seconds: float, window: Callable[[float], Awaitable[object]] = asyncio.sleep
    ) -> bytes:
        """Profiles for ``seconds`` (``window(seconds)`` is the wait, which may end
        early); returns the data in ``pstats`` (marshal) format."""
        if self._busy:
            raise ProfilerBusy("a profile is already being captured")
        self._busy = True
        try:
            profiler = cProfile.Profile()
            try:
                profiler.enable()
            except ValueError as e:  # another profiler owns the thread
                raise ProfilerBusy(str(e)) from e
            try:
                await window(seconds)
            finally:
                profiler.disable()
            profiler.create_stats()
            # What Profile.dump_stats writes, without a temporary file.
            return marshal.dumps(profiler.stats)
        finally:
            self._busy = False
