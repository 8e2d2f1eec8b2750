"""Change-log purging: when old entries may go, and how far (core.md §5.7, wire.md §6.4).

``Purger`` owns the purge timers and the single task that runs purges. It knows
nothing about storage: it calls ``purge(watermark)`` (normally
``ChangeLog.purge_before(watermark, owner)``, which always keeps the newest
transaction and checks ownership) and reads the purge constraints through
callables: the acked watermarks of connected subscribers and the watermarks held by
confirmed snapshot reservations.

One trigger, ``track_backup_watermark``, level-triggered: each backed-up watermark
is remembered with the time it was first seen, and a purge goes down to the lowest of
the newest backup watermark seen at least ``delay_s`` ago, every subscriber's ack and
every reserved watermark. While a remembered backup is ahead of what was purged, one
timer is armed, for when the oldest backup not yet old enough becomes so (or
``delay_s`` later, when the floor was held back). (Zero 1.9's second trigger,
``scheduleCleanup``, candidates handed in by its replica monitor, has no caller here:
every configuration's backup monitor feeds this one.)

What the delay guarantees (zero-cache 0.26's BackupMonitor, seed 001): the log is
purged up to a backup's watermark only once that backup has been known for
``delay_s`` (30 s = 3 × the subscribers' maximum reconnect backoff). A subscriber that
just lost its connection can come back and expose its position, and a view-syncer
that started restoring an older backup up to ``delay_s`` ago still finds the changes
after it. ``delay_s`` may be a callable, read at every decision: the service grows it
to the longest time a snapshot reservation took from open to subscribe. The memory of
backups is bounded, and thinning it only ever makes purges later.
An open reservation holds the floor at its own watermark, not purging as a whole:
with many view-syncers restoring in turn, a pause while any is open would never
end. Purges never overlap: they run in one task.

``floor`` and ``floor_holder`` say where the last backup-path pass put the floor
and which constraint held it there (for ``/statz`` and metrics).
"""

from __future__ import annotations

import asyncio
import bisect
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
# (watermark, seen at) backup entries a Purger remembers, at most.
BACKUP_HISTORY: Final = 1024
# A timer armed for the moment a backup becomes old enough may fire a hair before it
# (float rounding, the loop's clock resolution); a microsecond breaks no promise, and
# without the slack such a pass would find nothing to do and re-arm a zero-length timer.
_EARLY_S: Final = 1e-6


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

        # trackBackupWatermark path: (watermark, first seen) above the purged watermark,
        # both strictly increasing (watermarks) / non-decreasing (times).
        self._backups: list[tuple[str, float]] = []
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
        newest = self._backups[-1][0] if self._backups else self._purged
        # One not above the newest remembered (or the purged) watermark adds nothing:
        # that entry is at least as high and was seen no later. A repeated watermark
        # keeps its first sighting: that is when the backup appeared.
        if watermark > newest:
            self._remember(watermark, self._timers.monotonic())
        self._maybe_schedule_backup_purge()

    def _remember(self, watermark: str, seen: float) -> None:
        backups = self._backups
        backups.append((watermark, seen))
        if len(backups) <= BACKUP_HISTORY:
            return
        # Thin the history by dropping one interior entry: the one whose removal leaves
        # the smallest gap in time (newest among equals). Conservative: every kept entry
        # keeps its own watermark and its own seen time, so none becomes a candidate
        # before its own delay; dropping (w[i], t[i]) only means the purge stops at
        # w[i-1] until w[i+1] is old enough, t[i+1] - t[i] later. Merging it into a
        # neighbour under the OLDER time would purge w[i+1] early. The oldest entry
        # stays so that the purge always has something that ages into a candidate
        # (dropping it at a high backup rate would starve purging); the newest stays so
        # it eventually reaches the latest backup. The gap left is at most
        # 2 × span / (bound - 1) (the removal gaps sum to at most 2 × span): a bounded
        # extra wait, however fast backups come.
        drop = min(
            range(1, len(backups) - 1),
            key=lambda i: (backups[i + 1][1] - backups[i - 1][1], -i),
        )
        del backups[drop]

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
        if self._stopped or self._backup_busy or not self._backups:
            return
        self._backup_busy = True
        self._backup_timer = self._timers.call_later(self._next_pass_in(), self._on_backup_timer)

    def _next_pass_in(self) -> float:
        now, delay = self._timers.monotonic(), self._delay()
        old = self._old_enough(now, delay)
        if old < len(self._backups):
            return max(0.0, self._backups[old][1] + delay - now)
        # Every remembered backup is old enough, yet the last pass did not get past
        # them: a subscriber, reservation or the retention held the floor, or the purge
        # failed. Polling sooner than the delay would only spin; retry after it.
        return delay

    def _on_backup_timer(self) -> None:
        self._backup_timer = None
        self._backup_due = True
        self._ensure_runner()

    async def _purge_to_backup_floor(self) -> None:
        # Decide with the delay and the clock as they are now: the delay may have grown
        # since the timer was armed, and backups seen since may have aged enough.
        old = self._old_enough(self._timers.monotonic(), self._delay())
        if not old:
            return  # the delay grew since arming; the re-arm waits for the new one
        backup = self._backups[old - 1][0]
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
            # Backups at or below the floor can never raise it again. (Entries seen
            # during the purge were appended above it: watermarks only grow.)
            del self._backups[: bisect.bisect_right(self._backups, floor, key=lambda e: e[0])]

    def _old_enough(self, now: float, delay: float) -> int:
        """How many remembered backups were seen at least ``delay`` before ``now``."""
        # Seen times never decrease along the history: the old enough ones are a prefix.
        return bisect.bisect_right(self._backups, now + _EARLY_S - delay, key=lambda e: e[1])

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
