"""The backup monitor: backed-up watermarks → the streamer, readiness, wedge alarm.

``BackupMonitor.run`` consumes one poller's stream (``watermarks``). For each
watermark newer than the last it calls ``track`` (the service's
``backups.track``: purge floor, reservation confirmation); older and
repeated ones are ignored.

**Coverage gate** (wire.md §4.3 [s000]): ``covered`` is set once a backed-up
watermark reaches ``coverage_target``: the replica's ``stateVersion`` read when the
monitor starts — a destination that is being filled again from scratch reports
real but old watermarks first, and a view-syncer restoring it then would be far
behind. Every node backs up into a destination of its own
(``app/backup/destinations.py``), empty when it starts, so reaching the target also
proves that this node's own backups work; a restored replica reaches it with the
first upload, which the node forces at start instead of waiting for the backup
interval. If the replica cannot be read the first watermark opens the gate, with a
warning.

**Wedge alarm**: every ``check_interval_s`` the monitor compares the local
position with the newest backed-up watermark. Behind for ``wedged_after_s``
without progress → ``problem`` says so (``/ready`` answers 503 with it, metrics
and the log show it); it clears at the next progress. Purge is unaffected: it
never goes past what the backup verifiably holds, wedged or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, Callable
from typing import Final

from app.backup.watermarks import BackedUpWatermark, LocalState

__all__ = ["BackupMonitor"]

log = logging.getLogger(__name__)

DEFAULT_CHECK_INTERVAL_S: Final = 5.0


class BackupMonitor:
    def __init__(
        self,
        watermarks: AsyncIterable[BackedUpWatermark],
        track: Callable[[str], None],
        read_local: Callable[[], LocalState | None],
        *,
        wedged_after_s: float,
        check_interval_s: float = DEFAULT_CHECK_INTERVAL_S,
        on_coverage_target: Callable[[str | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        backups: bool = True,
    ) -> None:
        self._watermarks = watermarks
        # False: no backups are configured and the watermarks are the local replica's
        # position (ReplicaPoller), so the log says that instead of "backup".
        self._backups = backups
        self._track = track
        self._read_local = read_local
        self._wedged_after_s = wedged_after_s
        self._check_interval_s = check_interval_s
        self._clock = clock
        self._on_coverage_target = on_coverage_target
        self.latest: BackedUpWatermark | None = None
        self.coverage_target: str | None = None
        self.covered = asyncio.Event()
        self.problem: str | None = None
        self.received = 0
        self._started_at = clock()
        self._progress_at = self._started_at
        self._local: LocalState | None = None

    async def run(self) -> None:
        """Reads the stream until it ends; checks for a wedged backup meanwhile."""
        local = await asyncio.to_thread(self._read_local)
        self._local = local
        self.coverage_target = local.watermark if local is not None else None
        if self.coverage_target is None:
            log.warning("cannot read the replica's state: the first backup opens readiness")
        elif self._backups:
            log.info("waiting for a backup that covers the replica at %s", self.coverage_target)
        if self._on_coverage_target is not None:
            # /ready and the takeover wait for what this monitor waits for.
            self._on_coverage_target(self.coverage_target)
        checker = asyncio.create_task(self._check_loop(), name="backup wedge check")
        try:
            async for backed_up in self._watermarks:
                self.offer(backed_up)
        finally:
            checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checker
        log.info("the backup watermark stream ended")

    def offer(self, backed_up: BackedUpWatermark) -> None:
        """Takes one watermark from the stream (public for tests of the rules)."""
        latest = self.latest
        if latest is not None and backed_up.watermark <= latest.watermark:
            if backed_up.watermark < latest.watermark:
                log.warning(
                    "ignoring an earlier backup watermark %s (have %s)",
                    backed_up.watermark,
                    latest.watermark,
                )
            return
        self.latest = backed_up
        self.received += 1
        self._progress_at = self._clock()
        log.debug("backup reaches %s", backed_up.watermark)
        self._track(backed_up.watermark)
        if not self.covered.is_set() and (
            self.coverage_target is None or backed_up.watermark >= self.coverage_target
        ):
            if self._backups:
                log.info("the backup covers the replica (backup at %s)", backed_up.watermark)
            else:
                log.info(
                    "no backups configured: the replica's position (%s) is the purge floor",
                    backed_up.watermark,
                )
            self.covered.set()
        if self.problem is not None:
            log.info("the backup is moving again (at %s)", backed_up.watermark)
            self.problem = None

    def check(self, local: LocalState | None) -> None:
        """Sets or clears ``problem`` from the local position (public for tests)."""
        if local is not None:
            self._local = local
        behind = self._local is not None and (
            self.latest is None or self.latest.watermark < self._local.watermark
        )
        stalled_s = self._clock() - self._progress_at
        if behind and stalled_s >= self._wedged_after_s:
            if self.problem is None:
                reached = self.latest.watermark if self.latest else "nothing"
                at = self._local.watermark if self._local else "?"
                self.problem = (
                    f"backup wedged: no progress for {stalled_s:.0f} s "
                    f"(backup at {reached}, replica at {at})"
                )
                log.error("%s", self.problem)
        elif not behind:
            # Idle and caught up is healthy, however long it lasts.
            self._progress_at = self._clock()
            if self.problem is not None:
                log.info("the backup caught up")
            self.problem = None

    def lag_seconds(self) -> float | None:
        """zero's ``backup_lag``: the replica's last write time − the backup's time.

        0 while the backup holds the replica's position; None before both are known.
        """
        latest, local = self.latest, self._local
        if latest is None or local is None or local.write_time_ms is None:
            return None
        if latest.watermark >= local.watermark:
            return 0.0
        return max(0.0, (local.write_time_ms - latest.backup_time_ms) / 1000)

    def stats(self) -> dict[str, object]:
        latest = self.latest
        return {
            "lag_seconds": self.lag_seconds(),
            "coverage_target": self.coverage_target,
            "covered": self.covered.is_set(),
            "watermark": latest.watermark if latest else None,
            "backup_time_ms": latest.backup_time_ms if latest else None,
            "received": self.received,
            "problem": self.problem,
            "seconds_since_progress": round(self._clock() - self._progress_at, 3),
        }

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self._check_interval_s)
            self.check(await asyncio.to_thread(self._read_local))
