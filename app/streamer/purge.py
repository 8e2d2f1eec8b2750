"""Change-log purging: when old entries may go, and how far (core.md §5.7, wire.md §6.4).

``Purger`` owns the purge timers and the single task that runs purges. It knows
nothing about storage: it calls ``purge(watermark)`` (normally
``ChangeLog.purge_before(watermark, owner)``, which always keeps the newest
transaction and checks ownership) and reads the purge constraints through
callables: the acked watermarks of connected subscribers and the watermarks held by
confirmed snapshot reservations.

One trigger, ``track_backup_watermark``, level-triggered: whenever the backup is
ahead of what was purged, one purge runs ``delay_s`` later, down to the lowest of
the backup watermark, every subscriber's ack and every reserved watermark. (Zero
1.9's second trigger, ``scheduleCleanup``, candidates handed in by its replica
monitor, has no caller here: every configuration's backup monitor feeds this one.)

The delay (30 s = 3 × the subscribers' maximum reconnect backoff) gives subscribers
that just lost their connection time to come back and expose their position before
anything they need is deleted. ``delay_s`` may be a callable: the service grows it
to the longest time a snapshot reservation took from open to subscribe (seed 001),
so a view-syncer that started restoring an older backup still finds its changes.
An open reservation holds the floor at its own watermark, not purging as a whole:
with many view-syncers restoring in turn, a pause while any is open would never
end. Purges never overlap: they run in one task.

``floor`` and ``floor_holder`` say where the last backup-path pass put the floor
and which constraint held it there (for ``/statz`` and metrics).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Final

from app.stop_signals import AbortError
from app.storage.errors import PurgeLockedError
from app.streamer.timers import TimerHandle, Timers

__all__ = ["CLEANUP_DELAY_S", "CommitClock", "Purger"]

CLEANUP_DELAY_S: Final = 30.0
# Samples a CommitClock keeps over its retention window, at most.
CLOCK_SAMPLES: Final = 1024


class CommitClock:
    """When commits became durable, coarsely: the time-based retention floor.

    ``record`` keeps one ``(time, watermark)`` sample per ``retention / 1024``
    seconds, so memory stays bounded at any commit rate. ``floor`` is the newest
    sampled watermark that is older than the retention: everything below it is
    older too. None until such a sample exists (after a restart the whole log is
    kept for one retention period: the clock does not know older commit times).
    """

    def __init__(self, retention_s: float, clock: Callable[[], float]) -> None:
        self.retention_s = retention_s
        self._clock = clock
        self._spacing_s = retention_s / CLOCK_SAMPLES
        self._samples: deque[tuple[float, str]] = deque()

    def record(self, watermark: str) -> None:
        now = self._clock()
        if self._samples and now - self._samples[-1][0] < self._spacing_s:
            return
        self._samples.append((now, watermark))
        cutoff = now - self.retention_s
        # Keep one sample older than the cutoff: it is the floor.
        while len(self._samples) > 1 and self._samples[1][0] <= cutoff:
            self._samples.popleft()

    def floor(self) -> str | None:
        cutoff = self._clock() - self.retention_s
        if not self._samples or self._samples[0][0] > cutoff:
            return None
        older = [w for t, w in self._samples if t <= cutoff]
        return older[-1]


class Purger:
    """Schedules and runs change-log purges for one service."""

    def __init__(
        self,
        purge: Callable[[str], Awaitable[int]],
        subscriber_acks: Callable[[], Iterable[str]],
        reserved_watermarks: Callable[[], Iterable[str]],
        timers: Timers,
        *,
        delay_s: float | Callable[[], float] = CLEANUP_DELAY_S,
        named_acks: Callable[[], Iterable[tuple[str, str]]] | None = None,
        retention: CommitClock | None = None,
        backup_name: str = "backup",
        on_fatal: Callable[[BaseException], None] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self._purge = purge
        self._subscriber_acks = subscriber_acks
        self._reserved = reserved_watermarks
        self._timers = timers
        self._delay = delay_s if callable(delay_s) else (lambda: float(delay_s))
        self._named_acks = named_acks
        self._retention = retention
        self._backup_name = backup_name  # what the tracked watermark is, for floor_holder
        self._on_fatal = on_fatal
        self._log = logger or logging.getLogger(__name__)
        self._stopped = False

        # trackBackupWatermark path.
        self._backup: str | None = None
        self._purged = ""
        self._last_floor: str | None = None
        self.floor: str | None = None
        self.floor_holder: str | None = None
        self.passes = 0
        self.deleted = 0
        self._backup_timer: TimerHandle | None = None
        self._backup_busy = False  # timer armed, or its pass queued / running
        self._backup_due = False

        self._runner: asyncio.Task[None] | None = None

    # -- inputs ---------------------------------------------------------------

    def track_backup_watermark(self, watermark: str) -> None:
        """The replica backup now durably holds everything up to ``watermark``."""
        if self._backup is None or watermark > self._backup:
            self._backup = watermark
        self._maybe_schedule_backup_purge()

    async def stop(self) -> None:
        """Cancels pending timers and any running purge (its transaction rolls back)."""
        self._halt()
        runner, self._runner = self._runner, None
        if runner is not None and not runner.done():
            runner.cancel()
            await asyncio.wait({runner})

    def _halt(self) -> None:
        self._stopped = True
        if self._backup_timer is not None:
            self._backup_timer.cancel()
        self._backup_timer = None

    async def idle(self) -> None:
        """Waits until no purge is queued or running (timers may still be armed)."""
        while self._runner is not None and not self._runner.done():
            await asyncio.wait({self._runner})

    # -- state ----------------------------------------------------------------

    @property
    def purged_watermark(self) -> str:
        """Everything below this was purged by the backup path ("" = nothing yet)."""
        return self._purged

    # -- trackBackupWatermark path ---------------------------------------------

    def _maybe_schedule_backup_purge(self) -> None:
        if self._stopped or self._backup_busy:
            return
        if self._backup is None or self._purged >= self._backup:
            return
        self._backup_busy = True
        self._backup_timer = self._timers.call_later(self._delay(), self._on_backup_timer)

    def _on_backup_timer(self) -> None:
        self._backup_timer = None
        self._backup_due = True
        self._ensure_runner()

    async def _purge_to_backup_floor(self) -> None:
        backup = self._backup
        assert backup is not None  # armed only once a backup watermark is known
        candidates = [
            (backup, self._backup_name),
            *self._acks_with_names(),
            *((w, "reservation") for w in self._reserved()),
        ]
        if self._retention is not None:
            kept = self._retention.floor()
            # Nothing old enough yet: the retention keeps the whole log.
            candidates.append((kept or "", f"retention of {self._retention.retention_s:g} s"))
        floor, holder = min(candidates)
        self.floor, self.floor_holder = floor, holder
        if floor < backup and floor != self._last_floor:
            self._log.info(
                "purging only up to %s, held by %s (%s at %s)",
                floor,
                holder,
                self._backup_name,
                backup,
            )
        self._last_floor = floor
        if floor <= self._purged:
            return
        if await self._attempt(floor):
            self._purged = floor

    def _acks_with_names(self) -> list[tuple[str, str]]:
        if self._named_acks is not None:
            return [(w, f"subscriber {name}") for name, w in self._named_acks()]
        return [(w, "subscriber") for w in self._subscriber_acks()]

    # -- the runner -------------------------------------------------------------

    def _ensure_runner(self) -> None:
        if self._stopped or (self._runner is not None and not self._runner.done()):
            return  # a running pass picks the due flag up before it exits
        self._runner = asyncio.get_running_loop().create_task(self._run(), name="change-log purge")

    async def _run(self) -> None:
        while not self._stopped and self._backup_due:
            self._backup_due = False
            try:
                await self._guarded(self._purge_to_backup_floor)
            finally:
                self._backup_busy = False
            # Level-triggered: re-arm while the backup is ahead of the purge.
            self._maybe_schedule_backup_purge()

    async def _guarded(self, run_pass: Callable[[], Awaitable[None]]) -> None:
        # A failing constraint callable must not kill the runner; the next pass
        # (re-armed by the caller) tries again.
        try:
            await run_pass()
        except Exception:
            self._log.exception("change log purge pass failed")

    async def _attempt(self, watermark: str) -> bool:
        """Runs one purge; True if it went through. Errors never escape."""
        try:
            deleted = await self._purge(watermark)
        except PurgeLockedError:
            self._log.info(
                "change log purge to %s blocked by a replica restore; will retry", watermark
            )
            return False
        except AbortError as e:
            # Ownership moved to another change-streamer (or a reset is due): this
            # service must stop, and must not purge again.
            self._log.error("aborting change log purges: %s", e)
            self._halt()
            if self._on_fatal is not None:
                self._on_fatal(e)
            return False
        except Exception:
            self._log.exception("change log purge to %s failed; will retry", watermark)
            return False
        self.passes += 1
        self.deleted += deleted
        self._log.info("purged %d change log entries before %s", deleted, watermark)
        return True
