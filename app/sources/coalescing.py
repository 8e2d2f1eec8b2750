"""A one-slot outbox: the writer sends the newest item, older unsent ones are dropped.

Upstream acks are monotonic (an ack for W covers everything up to W), so when the
socket is back-pressured only the latest pending ack is worth sending. ``offer``
never blocks: it replaces whatever is waiting. ``run`` is the writer loop; its
owner runs it in a task and cancels it when the connection ends. At most one item
is being written and at most one is waiting, whatever the peer's pace.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class CoalescingSender:
    """Keeps at most one pending item and writes it with ``send``."""

    def __init__(self, send: Callable[[str], Awaitable[None]]) -> None:
        self._send = send
        self._pending: str | None = None
        self._ready = asyncio.Event()
        self.coalesced = 0  # items replaced before they were sent (for logs and tests)

    @property
    def pending(self) -> str | None:
        """The item waiting to be written, if any."""
        return self._pending

    def offer(self, item: str) -> None:
        """Queues ``item``, replacing an unsent older one; never blocks."""
        if self._pending is not None:
            self.coalesced += 1
        self._pending = item
        self._ready.set()

    async def run(self) -> None:
        """Writes pending items one at a time until cancelled or ``send`` raises."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            item = self._pending
            if item is None:
                continue
            self._pending = None
            # While this await is blocked by back-pressure, new offers replace each other.
            await self._send(item)
