"""Admission of websocket handshakes at a bounded rate, in arrival order.

Every new stream costs the event loop its handshake, the ASGI route, the
subscription, its status and a first catch-up read: a few milliseconds of the one
thread that also forwards every change to every subscriber. A client fleet that
reconnects in a loop (or one client that churns on purpose) would otherwise take
as much of the loop as it asks for, and the subscribers already streaming get what
is left (``bench.churn``: 5 % of their rate at 170 new streams a second).

``HandshakeAdmission`` lets at most ``rate`` handshakes a second proceed, with
bursts of up to ``burst`` (a token bucket), so new streams never take more than
their share, and holds the others in a FIFO: a held connection reads nothing and
costs nothing until its turn. The wait is bounded twice: at most ``max_waiting``
connections wait (one more is refused at once), and none waits longer than the
caller's timeout (then it is refused). Refusals are the caller's (``http_protocol``
answers 503): clients retry, as zero's do after any failed connection.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

__all__ = ["HandshakeAdmission", "Waiter"]


class Waiter(Protocol):
    """A held handshake: ``admitted`` lets it proceed; ``waiting`` is False once it
    has gone (closed, timed out), and the queue then skips it."""

    @property
    def waiting(self) -> bool: ...

    def admitted(self) -> None: ...


class HandshakeAdmission:
    def __init__(
        self,
        rate: float,
        burst: float,
        max_waiting: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0 or burst < 1 or max_waiting < 0:
            raise ValueError(f"bad admission bounds: {rate=}, {burst=}, {max_waiting=}")
        self.rate = rate
        self.burst = burst
        self.max_waiting = max_waiting
        self._clock = clock
        self._tokens = burst
        self._filled_at = clock()
        self._queue: deque[Waiter] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self.admitted_total = 0
        self.held_total = 0

    @property
    def queue_length(self) -> int:
        """Entries in the queue, including those that stopped waiting and are not
        pruned yet (bounded by ``max_waiting``)."""
        return len(self._queue)

    @property
    def waiting(self) -> int:
        """Connections held now (at most ``max_waiting``: a short count)."""
        return sum(1 for w in self._queue if w.waiting)

    def offer(self, waiter: Waiter) -> bool:
        """Admits ``waiter`` now (calls ``admitted``), or holds it for its turn;
        False if the queue is full (the caller refuses the connection)."""
        self._skip_gone()
        if not self._queue and self._take():
            self.admitted_total += 1
            waiter.admitted()
            return True
        if len(self._queue) >= self.max_waiting:
            # Full, counting those that left behind the head: drop them first.
            self._queue = deque(w for w in self._queue if w.waiting)
            if len(self._queue) >= self.max_waiting:
                return False
        self._queue.append(waiter)
        self.held_total += 1
        self._arm()
        return True

    # -- internals ----------------------------------------------------------

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._filled_at) * self.rate)
        self._filled_at = now

    def _take(self) -> bool:
        self._refill()
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False

    def _skip_gone(self) -> None:
        while self._queue and not self._queue[0].waiting:
            self._queue.popleft()

    def _arm(self) -> None:
        if self._timer is not None:
            return
        self._refill()
        delay = max(0.0, (1 - self._tokens) / self.rate)
        self._timer = asyncio.get_running_loop().call_later(delay, self._release)

    def _release(self) -> None:
        self._timer = None
        self._skip_gone()
        while self._queue and self._take():
            waiter = self._queue.popleft()
            self.admitted_total += 1
            waiter.admitted()
            self._skip_gone()
        if self._queue:
            self._arm()
