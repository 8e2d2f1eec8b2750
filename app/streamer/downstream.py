"""The outbound channel of one subscriber, between the streamer and a transport.

The streamer ``push``es pre-serialized JSON messages; each push returns a future
that resolves ``True`` when the subscriber has *consumed* the message (its ack
arrived) or ``False`` if the channel closed first. The transport (a websocket
sender, or a test) takes messages with ``get`` in order, sends them without
waiting for acks (pipelining), and reports acks with ``ack_next``, which must
come in order.

Bounded: if the bytes pushed but not yet consumed exceed ``max_unconsumed_bytes``
the channel closes itself (the subscriber is dropped and resumes from the change
log later); flow control and the backlog gate normally keep it far below.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Literal, overload

DEFAULT_MAX_UNCONSUMED_BYTES = 64 * 1024 * 1024


class DownstreamClosed(Exception):
    """The channel is closed; nothing more will be delivered."""


class Downstream:
    def __init__(self, *, max_unconsumed_bytes: int = DEFAULT_MAX_UNCONSUMED_BYTES) -> None:
        self._max = max_unconsumed_bytes
        self._unsent: deque[tuple[str, asyncio.Future[bool] | None]] = deque()
        self._sent: deque[tuple[int, asyncio.Future[bool] | None]] = deque()
        self._unconsumed_bytes = 0
        self._wakeup: asyncio.Event = asyncio.Event()
        self._closed = False
        self._close_reason: str | None = None
        self._on_close: list[Callable[[], None]] = []
        self.pushed = 0
        self.consumed = 0

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def close_reason(self) -> str | None:
        return self._close_reason

    @property
    def unconsumed_bytes(self) -> int:
        return self._unconsumed_bytes

    @property
    def pending(self) -> int:
        """Messages pushed and not yet consumed."""
        return len(self._unsent) + len(self._sent)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Runs ``callback`` once when the channel closes (at once if it already has)."""
        if self._closed:
            callback()
        else:
            self._on_close.append(callback)

    @overload
    def push(self, message: str) -> asyncio.Future[bool]: ...
    @overload
    def push(self, message: str, *, track: Literal[True]) -> asyncio.Future[bool]: ...
    @overload
    def push(self, message: str, *, track: bool) -> asyncio.Future[bool] | None: ...

    def push(self, message: str, *, track: bool = True) -> asyncio.Future[bool] | None:
        """Queues a message; with ``track``, returns the future of its consumption.

        Untracked pushes skip the future: most forwarded changes have nobody
        waiting on them, and a future per change is a measurable cost.
        """
        future: asyncio.Future[bool] | None = None
        if track:
            future = asyncio.get_running_loop().create_future()
        if self._closed:
            if future is not None:
                future.set_result(False)
            return future
        self._unsent.append((message, future))
        self._unconsumed_bytes += len(message)
        self.pushed += 1
        self._wakeup.set()
        if self._unconsumed_bytes > self._max:
            self.close(f"more than {self._max} bytes sent but not acknowledged")
        return future

    async def get(self) -> str:
        """The next message to send; raises ``DownstreamClosed`` once closed."""
        while not self._unsent:
            if self._closed:
                raise DownstreamClosed(self._close_reason or "closed")
            self._wakeup.clear()
            await self._wakeup.wait()
        if self._closed:
            raise DownstreamClosed(self._close_reason or "closed")
        message, future = self._unsent.popleft()
        self._sent.append((len(message), future))
        return message

    def get_nowait(self) -> str | None:
        """Like ``get`` but returns None when nothing is ready (for batching senders)."""
        if self._closed or not self._unsent:
            return None
        message, future = self._unsent.popleft()
        self._sent.append((len(message), future))
        return message

    def ack_next(self) -> None:
        """The subscriber consumed the oldest sent message."""
        if not self._sent:
            raise ValueError("ack for a message that was not sent")
        size, future = self._sent.popleft()
        self._unconsumed_bytes -= size
        self.consumed += 1
        if future is not None and not future.done():
            future.set_result(True)

    @property
    def sent_unacked(self) -> int:
        return len(self._sent)

    def close(self, reason: str | None = None) -> None:
        """Closes the channel: outstanding pushes resolve ``False``; cleanups run once."""
        if self._closed:
            return
        self._closed = True
        self._close_reason = reason
        for _, future in self._unsent:
            if future is not None and not future.done():
                future.set_result(False)
        for _, pending in self._sent:
            if pending is not None and not pending.done():
                pending.set_result(False)
        self._unsent.clear()
        self._sent.clear()
        self._unconsumed_bytes = 0
        self._wakeup.set()
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()
