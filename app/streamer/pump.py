"""Reads an upstream stream ahead into a small bounded buffer.

The main loop must notice that the upstream ended or failed even while it is
waiting for something else (a flow-control release, the storer's gate): a dead
upstream must trigger the synthetic rollback at once, even if the storer is
wedged (spec/core.md §8.1). So a pump task reads the stream, and the loop takes
messages from the buffer and can race any wait against ``ended``.

A deque and two events rather than an asyncio.Queue: this runs once per change.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from app.protocol.messages import ChangeSourceMessage
from app.sources.base import ChangeStream

DEFAULT_LIMIT = 256


class Pump:
    def __init__(self, stream: ChangeStream, *, limit: int = DEFAULT_LIMIT) -> None:
        self._stream = stream
        self._limit = limit
        self.buffer: deque[ChangeSourceMessage] = deque()
        self.readable = asyncio.Event()
        self._space = asyncio.Event()
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(), name="upstream-pump")

    async def _run(self) -> None:
        try:
            async for message in self._stream:
                self.buffer.append(message)
                self.readable.set()
                while len(self.buffer) >= self._limit:
                    self._space.clear()
                    await self._space.wait()
            if not self.ended.done():
                self.ended.set_result(None)
        except asyncio.CancelledError:
            if not self.ended.done():
                self.ended.set_result(None)
            raise
        except Exception as e:
            if not self.ended.done():
                self.ended.set_exception(e)
        finally:
            self.readable.set()

    def take_all(self) -> list[ChangeSourceMessage]:
        """Every buffered message (empty if none): the main loop works in batches."""
        if not self.buffer:
            return []
        batch = list(self.buffer)
        self.buffer.clear()
        self._space.set()
        return batch

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self.ended.done() and not self.ended.cancelled():
            self.ended.exception()  # mark retrieved; the loop reports it
