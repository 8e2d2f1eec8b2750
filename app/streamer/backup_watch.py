"""What the service knows of its backups: the backed-up watermark, the coverage
gate, and when commits became durable (the lags and the retention floor).

Backups (``app.backup.monitor``) feed one stream of backed-up watermarks into
``track``, which keeps the newest and hands each one to ``listeners`` (the service
registers the acker, the purger and the snapshot reservations, in that order).
The storer's durable commits come in through ``on_durable``: the last
``DURABLE_HISTORY`` of them with the time each became durable give the backup lag
and a subscriber's ack lag (``durable_wait_s``); the coarse ``commit_clock`` gives
the purger its time-based retention floor.

``covered`` is ``/ready``'s gate and the takeover's: with backups configured, a
backup must reach ``coverage_target`` — the replica's ``stateVersion`` when the
backup monitor started (seed 000: a restored replica is covered by the backup it came
from as soon as this node's own destination holds it), or None when the monitor
cannot read it, and then the first backup opens the gate — before a view-syncer may
restore from it, and before this node takes the change log over. Until the monitor
has set the target (``wait_target``) the gate is closed.

Backups are watched from the start, but the listeners hear of them only once this
task owns the change log (``activate``): a node that does not own it yet must not
purge, ack or confirm anything (a purge checks ownership and would stop it).
"""

from __future__ import annotations

import asyncio
import bisect
import os
from collections import deque
from collections.abc import Callable
from typing import Final, Protocol

from app.streamer.purge import CommitClock

__all__ = ["DURABLE_HISTORY", "BackupState", "BackupWatch"]

# Durable commits remembered for the lags (older ones count as the oldest).
DURABLE_HISTORY: Final = 10_000


class BackupState(Protocol):
    """What the backups show of themselves (``app.runtime.backups.Backups``)."""

    @property
    def problem(self) -> str | None: ...

    def stats(self) -> dict[str, object]: ...

    async def stop(self) -> None: ...


class BackupWatch:
    def __init__(
        self,
        *,
        backup_url: str | None,
        replica_file: str | None,
        clock: Callable[[], float],
        retention_s: float = 0.0,
    ) -> None:
        """``retention_s``: the change log kept at least this long (0: no commit clock)."""
        self.backup_url = backup_url
        self.replica_file = replica_file
        # Set by the backup monitor once it read the replica (``set_coverage_target``).
        self.coverage_target: str | None = None
        self._target_set = asyncio.Event()
        # The newest backed-up watermark (None: no backup seen yet).
        self.watermark: str | None = None
        # The running backups (set by app.runtime.backups; the service stops them).
        self.state: BackupState | None = None
        # Called with each backed-up watermark, newer or not (each deduplicates).
        self.listeners: list[Callable[[str], None]] = []
        self.commit_clock = CommitClock(retention_s, clock) if retention_s > 0 else None
        self._clock = clock
        # (commit watermark, when it became durable, change-log bytes stored up to it)
        self._durable_at: deque[tuple[str, float, int]] = deque(maxlen=DURABLE_HISTORY)
        self._durable_bytes = 0
        self._active = False  # listeners hear of watermarks (this task owns the log)
        self._covered = asyncio.Event()
        self._check_covered()

    def on_durable(self, watermark: str, stored_bytes: int = 0) -> None:
        """The storer made the commit at ``watermark`` durable, having stored
        ``stored_bytes`` of change text in all so far."""
        self._durable_bytes = stored_bytes
        self._durable_at.append((watermark, self._clock(), stored_bytes))
        if self.commit_clock is not None:
            self.commit_clock.record(watermark)

    def track(self, watermark: str) -> None:
        """A backup holds everything up to ``watermark``."""
        if self.watermark is None or watermark > self.watermark:
            self.watermark = watermark
        self._check_covered()
        if self._active:
            for listener in self.listeners:
                listener(watermark)

    def activate(self) -> None:
        """This task owns the change log now: the listeners hear of the newest
        watermark at once, and of every one after it."""
        self._active = True
        if self.watermark is not None:
            for listener in self.listeners:
                listener(self.watermark)

    def set_coverage_target(self, target: str | None) -> None:
        """The replica's position the gate waits for (None: the first backup)."""
        self.coverage_target = target
        self._target_set.set()
        self._check_covered()

    async def wait_target(self) -> None:
        """Returns once the monitor set the coverage target (at once without backups)."""
        if self.backup_url is not None:
            await self._target_set.wait()

    def covered(self) -> bool:
        """No backups configured, or one has reached the coverage target (once it
        has, the gate stays open)."""
        return self._covered.is_set()

    async def wait_covered(self) -> None:
        """Returns once :meth:`covered` is true."""
        await self._covered.wait()

    def _check_covered(self) -> None:
        if self._covered.is_set():
            return
        reached = (
            self._target_set.is_set()
            and self.watermark is not None
            and (self.coverage_target is None or self.watermark >= self.coverage_target)
        )
        if self.backup_url is None or reached:
            self._covered.set()

    def problem(self) -> str | None:
        """Why the backups are not healthy (wedged), or None."""
        return self.state.problem if self.state is not None else None

    def stats(self) -> dict[str, object] | None:
        """What the running backups say of themselves (None: none started)."""
        return self.state.stats() if self.state is not None else None

    def lag_s(self) -> float | None:
        """How long the oldest commit not yet in a backup has been durable; None if unknown."""
        if self.watermark is None:
            return None
        return self.durable_wait_s(self.watermark)

    def durable_wait_s(self, watermark: str) -> float:
        """How long the oldest durable commit after ``watermark`` (a backup's, a
        subscriber's ack) has been durable: 0 if none is after it, and at least that
        of the oldest commit remembered when ``watermark`` is older."""
        history = self._durable_at
        after = bisect.bisect_right(history, watermark, key=_watermark_of)
        if after == len(history):
            return 0.0
        return max(0.0, self._clock() - history[after][1])

    def bytes_after(self, watermark: str) -> int:
        """Change-log bytes stored after ``watermark`` (at least that many when it is
        older than the commits remembered)."""
        history = self._durable_at
        at = bisect.bisect_right(history, watermark, key=_watermark_of)
        before = history[at - 1][2] if at else (history[0][2] if history else 0)
        return self._durable_bytes - before

    def last_commit_age_s(self) -> float | None:
        """Seconds since the newest commit became durable (None before the first)."""
        if not self._durable_at:
            return None
        return max(0.0, self._clock() - self._durable_at[-1][1])

    def replica_size(self) -> int | None:
        """The replica file's size, for snapshot reservations' statuses (None: unknown)."""
        if self.replica_file is None:
            return None
        try:
            return os.stat(self.replica_file).st_size
        except OSError:
            return None

    async def stop(self) -> None:
        """Stops the backups: their children (litestream, the VFS probe) must not
        outlive the service."""
        if self.state is not None:
            await self.state.stop()


def _watermark_of(entry: tuple[str, float, int]) -> str:
    return entry[0]
