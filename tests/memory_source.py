"""An in-process change source for tests: the test scripts what each stream delivers.

Every ``start_stream`` creates a :class:`MemoryChangeStream`, recorded in
``source.streams`` with the arguments it was started with. The test pushes messages
into a stream, ends it cleanly or fails it, and reads the acks the service sent.
Messages pushed as tuples are validated with :func:`parse_change_source_message`,
so a stream yields exactly what a real source would.

``end()`` and ``fail()`` take effect after the messages already pushed, so a test
can script "three messages, then the connection breaks" in one go.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any, Final

from app.protocol.messages import (
    Begin,
    ChangeSourceMessage,
    Commit,
    Control,
    Data,
    Rollback,
    Status,
    parse_change_source_message,
)
from app.sources.base import BackfillRequest, ChangeSource, ChangeStream

__all__ = ["MemoryChangeSource", "MemoryChangeStream", "StreamQueueFullError"]

DEFAULT_MAX_QUEUED: Final = 10_000
_MESSAGE_TYPES: Final = (Begin, Data, Commit, Rollback, Status, Control)


class StreamQueueFullError(RuntimeError):
    """A test pushed more messages than the stream's bound without reading them."""


class MemoryChangeStream(ChangeStream):
    """A scripted stream: yields pushed messages, waits when there are none."""

    def __init__(
        self,
        after_watermark: str,
        backfill_requests: list[BackfillRequest],
        *,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ) -> None:
        self.after_watermark = after_watermark
        self.backfill_requests = backfill_requests
        self.acks: list[list[Any]] = []
        self._max_queued = max_queued
        self._queue: deque[ChangeSourceMessage] = deque()
        self._ended = False
        self._error: BaseException | None = None
        self._closed = False
        self._changed = asyncio.Event()  # something to read, an end, or close
        self._acked = asyncio.Event()

    @property
    def closed(self) -> bool:
        """True once the consumer called ``close()``."""
        return self._closed

    @property
    def queued(self) -> int:
        """Messages pushed but not read yet."""
        return len(self._queue)

    def push(self, message: ChangeSourceMessage | Sequence[Any]) -> None:
        """Queues a message (a parsed one or a tuple to validate); dropped once closed."""
        parsed = (
            message if isinstance(message, _MESSAGE_TYPES) else parse_change_source_message(message)
        )
        if self._closed:
            return  # the consumer is gone, as with a real connection
        if self._ended or self._error is not None:
            raise RuntimeError("cannot push to a stream that was ended or failed")
        if len(self._queue) >= self._max_queued:
            raise StreamQueueFullError(f"stream already holds {self._max_queued} unread messages")
        self._queue.append(parsed)
        self._changed.set()

    def push_all(self, messages: Sequence[ChangeSourceMessage | Sequence[Any]]) -> None:
        for message in messages:
            self.push(message)

    def end(self) -> None:
        """The source closes the connection cleanly after the queued messages."""
        self._ended = True
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        """The connection breaks with ``error`` after the queued messages."""
        self._error = error
        self._changed.set()

    def __aiter__(self) -> MemoryChangeStream:
        return self

    async def __anext__(self) -> ChangeSourceMessage:
        while True:
            if self._closed:
                raise StopAsyncIteration
            if self._queue:
                return self._queue.popleft()
            if self._error is not None:
                raise self._error
            if self._ended:
                raise StopAsyncIteration
            self._changed.clear()
            await self._changed.wait()

    def ack(self, status: list[Any]) -> None:
        self.acks.append(status)
        self._acked.set()

    async def wait_for_acks(self, count: int) -> list[list[Any]]:
        """Waits until at least ``count`` acks arrived; returns all of them."""
        while len(self.acks) < count:
            self._acked.clear()
            await self._acked.wait()
        return self.acks

    async def close(self) -> None:
        self._closed = True
        self._queue.clear()
        self._changed.set()


class MemoryChangeSource(ChangeSource):
    """Creates scripted streams; can be told to refuse the next starts."""

    upstream_type = "memory"  # /statz upstream group

    def __init__(self, *, max_queued: int = DEFAULT_MAX_QUEUED) -> None:
        self.streams: list[MemoryChangeStream] = []
        self.start_calls: list[str] = []  # after_watermark of every call, failed ones too
        self.stopped = False
        self._max_queued = max_queued
        self._start_failures: deque[BaseException] = deque()
        self._started = asyncio.Event()

    @property
    def current(self) -> MemoryChangeStream:
        """The most recently started stream."""
        if not self.streams:
            raise LookupError("no stream has been started")
        return self.streams[-1]

    def push(self, message: ChangeSourceMessage | Sequence[Any]) -> None:
        """Pushes into the most recently started stream."""
        self.current.push(message)

    def fail_next_starts(self, error: BaseException, n: int = 1) -> None:
        """The next ``n`` calls of ``start_stream`` raise ``error`` (after the queued ones)."""
        self._start_failures.extend([error] * n)

    async def start_stream(
        self, after_watermark: str, backfill_requests: list[BackfillRequest]
    ) -> MemoryChangeStream:
        self.start_calls.append(after_watermark)
        if self._start_failures:
            raise self._start_failures.popleft()
        stream = MemoryChangeStream(
            after_watermark, list(backfill_requests), max_queued=self._max_queued
        )
        self.streams.append(stream)
        self._started.set()
        return stream

    async def wait_for_stream(self, count: int = 1) -> MemoryChangeStream:
        """Waits until ``count`` streams were started in total; returns the ``count``-th."""
        while len(self.streams) < count:
            self._started.clear()
            await self._started.wait()
        return self.streams[count - 1]

    async def stop(self) -> None:
        self.stopped = True
