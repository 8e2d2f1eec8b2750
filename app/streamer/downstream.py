"""The outbound channel of one subscriber, between the streamer and a transport.

The streamer ``push``es pre-serialized JSON messages, a batch at a time; a
*tracked* push returns a future that resolves ``True`` when the subscriber has
*consumed* the batch's last message (its ack arrived) or ``False`` if the channel
closed first, and ``on_consumed`` hears the consumed count after every ack. The
transport (a websocket sender, or a test) takes messages with ``get``/``take`` in
order, sends them without waiting for acks (pipelining), and reports acks with
``ack_next``/``ack_many``, in order.

Bounded: if the bytes pushed but not yet consumed exceed ``max_unconsumed_bytes``
the channel closes itself (the subscriber is dropped and resumes from the change
log later); flow control and the backlog gate normally keep it far below.
*Large* messages (over a quarter of the bound: a change with a 50 MB value, say)
do not count against it while unconsumed: flow control already limits them (a
checkpoint each, at most two in flight), and counting them would drop the
subscriber at every attempt for good.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import Literal, overload

from app import speedups
from app.logs import log_extra
from app.protocol.pieces import Text

log = logging.getLogger(__name__)

DEFAULT_MAX_UNCONSUMED_BYTES = 64 * 1024 * 1024


def _running_totals_py(ends: list[int], messages: list[Text], total: int) -> int:
    """Appends the running byte total after each message to ``ends``; returns the
    last. ``app/streamer/_fanout.c`` is the same in C (it runs per change per
    subscriber)."""
    for message in messages:
        total += len(message)
        ends.append(total)
    return total


running_totals: Callable[[list[int], list[Text], int], int]
# C unless not built here or CHANGESTREAMER_SPEEDUPS=0 (same results, slower).
_fanout = speedups.module("fanout")
running_totals = _running_totals_py if _fanout is None else _fanout.running_totals


class DownstreamClosed(Exception):
    """The channel is closed; nothing more will be delivered."""


class Downstream:
    def __init__(
        self,
        *,
        max_unconsumed_bytes: int = DEFAULT_MAX_UNCONSUMED_BYTES,
        log_fields: Mapping[str, object] | None = None,
    ) -> None:
        self._max = max_unconsumed_bytes
        # Whom it serves, for the log line of an overflow (logged from the forwarder's task).
        self._log_fields = log_fields or {}
        # Large messages not yet consumed, (message number, size), oldest first, and
        # their total: what the bound does not count.
        self._large: deque[tuple[int, int]] = deque()
        self._allowance = 0
        self._unsent: deque[Text] = deque()
        # Byte accounting without a per-message record to pop: ``_ends[i]`` is the
        # running total of pushed bytes at the end of message ``_head + i + 1``
        # (numbered from 1), so consuming n messages is one index step.
        self._ends: list[int] = []
        self._head = 0
        self._pushed_bytes = 0
        self._consumed_bytes = 0
        # Consumption futures of tracked pushes, by message number, in order.
        self._trackers: deque[tuple[int, asyncio.Future[bool]]] = deque()
        self._on_consumed: Callable[[int], None] | None = None
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
        return self._pushed_bytes - self._consumed_bytes

    @property
    def pending(self) -> int:
        """Messages pushed and not yet consumed."""
        return self.pushed - self.consumed

    @property
    def sent_unacked(self) -> int:
        return self.pushed - len(self._unsent) - self.consumed

    def on_close(self, callback: Callable[[], None]) -> None:
        """Runs ``callback`` once when the channel closes (at once if it already has)."""
        if self._closed:
            callback()
        else:
            self._on_close.append(callback)

    def on_consumed(self, callback: Callable[[int], None]) -> None:
        """Calls ``callback(consumed)`` after each ack (one listener: the subscriber)."""
        self._on_consumed = callback

    @overload
    def push(self, messages: list[Text]) -> None: ...
    @overload
    def push(self, messages: list[Text], *, track: Literal[True]) -> asyncio.Future[bool]: ...
    @overload
    def push(self, messages: list[Text], *, track: bool) -> asyncio.Future[bool] | None: ...

    def push(self, messages: list[Text], *, track: bool = False) -> asyncio.Future[bool] | None:
        """Queues messages in order; with ``track``, returns the future of the last
        one's consumption.

        Untracked pushes skip the future: most forwarded changes have nobody
        waiting on them, and a future per change is a measurable cost. A message's
        number (``pushed`` once it is queued) identifies it to ``on_consumed``.
        """
        future: asyncio.Future[bool] | None = None
        if track:
            future = asyncio.get_running_loop().create_future()
            if self._closed or not messages:
                future.set_result(not self._closed)
            else:  # before pushing: an overflow closes the channel and resolves it
                self._trackers.append((self.pushed + len(messages), future))
        if self._closed or not messages:
            return future
        self._unsent.extend(messages)
        before = self._pushed_bytes
        total = running_totals(self._ends, messages, before)
        self._pushed_bytes = total
        self.pushed += len(messages)
        self._wakeup.set()
        large = self._max // 4
        if total - before > large:  # rare: the push may hold a large message
            first = self.pushed - len(messages) + 1
            for number, message in enumerate(messages, first):
                if len(message) > large:
                    self._large.append((number, len(message)))
                    self._allowance += len(message)
        if total - self._consumed_bytes > self._max + self._allowance:
            reason = f"more than {self._max} bytes sent but not acknowledged"
            log.warning(
                "dropping subscriber %s: %s",
                self._log_fields.get("subscriber", "?"),
                reason,
                extra=log_extra(self._log_fields),
            )
            self.close(reason)
        return future

    async def get(self) -> Text:
        """The next message to send; raises ``DownstreamClosed`` once closed."""
        while not self._unsent:
            if self._closed:
                raise DownstreamClosed(self._close_reason or "closed")
            self._wakeup.clear()
            await self._wakeup.wait()
        if self._closed:
            raise DownstreamClosed(self._close_reason or "closed")
        return self._unsent.popleft()

    def get_nowait(self) -> Text | None:
        """Like ``get`` but returns None when nothing is ready (for batching senders)."""
        if self._closed or not self._unsent:
            return None
        return self._unsent.popleft()

    def take(self, limit: int) -> list[Text]:
        """Up to ``limit`` more ready messages, without waiting (for batching senders)."""
        unsent = self._unsent
        if self._closed or not unsent:
            return []
        if len(unsent) <= limit:
            taken = list(unsent)
            unsent.clear()
            return taken
        return [unsent.popleft() for _ in range(limit)]

    def ack_next(self) -> None:
        """The subscriber consumed the oldest sent message."""
        self.ack_many(1)

    def ack_many(self, n: int) -> None:
        """The subscriber consumed the ``n`` oldest sent messages."""
        if n <= 0:
            return
        if n > self.sent_unacked:
            raise ValueError("ack for a message that was not sent")
        self.consumed += n
        head = self._head + n
        self._consumed_bytes = self._ends[head - 1]
        if head >= 1024 and head * 2 >= len(self._ends):
            del self._ends[:head]
            head = 0
        self._head = head
        large = self._large
        while large and large[0][0] <= self.consumed:
            self._allowance -= large.popleft()[1]
        trackers = self._trackers
        while trackers and trackers[0][0] <= self.consumed:
            future = trackers.popleft()[1]
            if not future.done():
                future.set_result(True)
        if self._on_consumed is not None:
            self._on_consumed(self.consumed)

    def close(self, reason: str | None = None) -> None:
        """Closes the channel: outstanding pushes resolve ``False``; cleanups run once."""
        if self._closed:
            return
        self._closed = True
        self._close_reason = reason
        for _, future in self._trackers:
            if not future.done():
                future.set_result(False)
        self._trackers.clear()
        self._unsent.clear()
        self._ends.clear()
        self._head = 0
        self._consumed_bytes = self._pushed_bytes
        self._large.clear()
        self._allowance = 0
        self._wakeup.set()
        # Drop the listeners: each refers back to its subscriber, which refers to
        # this channel, and a cycle waits for a full collector pass (rare with
        # app/runtime/gc_tuning.py's thresholds) to free the subscriber's buffers.
        self._on_consumed = None
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()
