"""One tracked broadcast: the flow-control checkpoint (spec/core.md §4).

Every 64 KiB of forwarded JSON the main loop sends one change as a *tracked*
broadcast and waits until it is released. Waiting for every subscriber would
let the slowest one set the pace for all; not waiting at all would let memory
grow without bound. The consensus timeout sits between: once a majority
(``n // 2 + 1``) has consumed the change, a timer is armed for
``ceil(elapsed × proportion)`` — the time the majority took, scaled — and when
it fires the broadcast is released even if some subscribers are still behind.
A subscriber that keeps missing that deadline is a laggard (see
``Forwarder``), and is eventually disconnected.

A caught-up backup subscriber (the replica this node backs up) must always
respond before the timer may be armed: it can never be left behind, since it
is the replica that backups restore.
"""

from __future__ import annotations

import asyncio
import logging
import math
from functools import partial
from typing import Any, Literal

from app.logs import log_extra
from app.streamer.subscriber import Subscriber
from app.streamer.timers import TimerHandle, Timers

log = logging.getLogger(__name__)

ReleaseMode = Literal["all-subscribers", "consensus-timeout"]


class Broadcast:
    """Tracks one checkpoint: ``sent`` pairs each subscriber it went to with what
    ``Subscriber.send(..., track=True)`` returned (its consumption, a backlog gate,
    or None: nothing to wait for); ``done`` resolves with the release mode."""

    def __init__(
        self,
        sent: list[tuple[Subscriber, asyncio.Future[Any] | None]],
        *,
        timers: Timers,
        timeout_proportion: float | None,
        watermark: str = "",
    ) -> None:
        self._timers = timers
        self.watermark = watermark  # of the checkpoint's change (the log line's)
        self._proportion = timeout_proportion
        self._start = timers.monotonic()
        self._timer: TimerHandle | None = None
        self.done: asyncio.Future[ReleaseMode] = asyncio.get_running_loop().create_future()
        self.total = len(sent)
        self.majority = self.total // 2 + 1
        self.completed = 0
        self._pending: set[Subscriber] = {sub for sub, _ in sent}
        self._awaiting_backup = any(s.mode == "backup" and not s.backlogged for s, _ in sent)
        if not sent:
            self.done.set_result("all-subscribers")
            return
        for sub, result in sent:
            if result is None or result.done():
                self._complete(sub)
            else:
                result.add_done_callback(partial(self._on_sent, sub))

    @property
    def pending(self) -> frozenset[Subscriber]:
        return frozenset(self._pending)

    @property
    def age_s(self) -> float:
        """Seconds since the checkpoint was sent."""
        return self._timers.monotonic() - self._start

    def forget(self, sub: Subscriber) -> None:
        """``sub`` was dropped: nothing waits for it any more (its channel may take
        a while to close, e.g. while its client does not read)."""
        self._complete(sub)

    def _on_sent(self, sub: Subscriber, _result: asyncio.Future[Any]) -> None:
        self._complete(sub)

    def _complete(self, sub: Subscriber) -> None:
        if self.done.done() or sub not in self._pending:
            return
        self._pending.discard(sub)
        self.completed += 1
        sub.missed_last_timeout = False
        if sub.mode == "backup":
            self._awaiting_backup = False
        if not self._pending:
            self._release("all-subscribers")
            return
        if (
            self._timer is None
            and self._proportion is not None
            and self._proportion >= 0
            and self.completed >= self.majority
            and not self._awaiting_backup
        ):
            elapsed_ms = (self._timers.monotonic() - self._start) * 1000.0
            delay_ms = math.ceil(elapsed_ms * self._proportion)
            self._timer = self._timers.call_later(delay_ms / 1000.0, self._on_timeout)

    def _on_timeout(self) -> None:
        if not self.done.done():
            for sub in self._pending:
                sub.missed_last_timeout = True
                sub.missed_releases += 1
            # As zero logs it: who made the majority, who is still behind.
            log.info(
                "continuing with %d subscriber(s) still pending (%.3f ms)",
                len(self._pending),
                self.age_s * 1000.0,
                extra=log_extra({"watermark": self.watermark, **self.describe()}),
            )
            self._release("consensus-timeout")

    def _release(self, mode: ReleaseMode) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self.done.done():
            self.done.set_result(mode)

    def cancel(self) -> None:
        """Releases the waiter (e.g. the stream ended); nothing is marked late."""
        self._release("all-subscribers")

    def describe(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "majority": self.majority,
            "completed": self.completed,
            "pending": sorted(s.id for s in self._pending),
            "elapsedMs": round((self._timers.monotonic() - self._start) * 1000.0),
        }
