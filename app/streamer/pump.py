"""Reads an upstream stream ahead into a small bounded buffer.

The main loop must notice that the upstream ended or failed even while it is
waiting for something else (a flow-control release, the storer's gate): a dead
upstream must trigger the synthetic rollback at once, even if the storer is
wedged (spec/core.md §8.1). So a pump task reads the stream, and the loop takes
messages from the buffer and can race any wait against ``ended``.

A deque, an event and a waiter future rather than an asyncio.Queue: this runs once
per change, and ``wait_readable`` wakes the main loop itself (one task switch from a
buffered message to the main loop, not two through a helper task).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any

from app.flow_gate import HighLowGate
from app.protocol.messages import ChangeSourceMessage
from app.sources.base import ChangeStream

DEFAULT_LIMIT = 256


class Pump:
    def __init__(self, stream: ChangeStream, *, limit: int = DEFAULT_LIMIT) -> None:
        self._stream = stream
        self._limit = limit
        self.buffer: deque[ChangeSourceMessage] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # Closed at the limit, open again once the main loop took the buffer.
        self._space = HighLowGate(limit, 0)
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(), name="upstream-pump")

    async def _run(self) -> None:
        try:
            async for message in self._stream:
                self.buffer.append(message)
                del message  # not held here while the next one is awaited
                if self._waiter is not None:
                    self._wake()
                if len(self.buffer) >= self._limit:  # inline: this runs per message
                    self._space.rise(len(self.buffer))
                    await self._space.opened()
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
            self._wake()

    async def wait_readable(self, *, also: asyncio.Future[Any]) -> None:
        """Returns once a message is buffered or the stream ended — or ``also`` is done
        (the storer failed: the caller checks)."""
        if self.buffer or self.ended.done() or also.done():
            return
        self._waiter = asyncio.get_running_loop().create_future()
        also.add_done_callback(self._on_also_done)
        try:
            await self._waiter
        finally:
            also.remove_done_callback(self._on_also_done)
            self._waiter = None

    def _on_also_done(self, _done: asyncio.Future[Any]) -> None:
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take_all(self) -> list[ChangeSourceMessage]:
        """Every buffered message (empty if none): the main loop works in batches."""
        if not self.buffer:
            return []
        batch = list(self.buffer)
        self.buffer.clear()
        self._space.fall(0)
        return batch

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self.ended.done() and not self.ended.cancelled():
            self.ended.exception()  # mark retrieved; the loop reports it
