"""What ``/metrics``, the OTLP export and the dashboard read of the running service.

One set of values, read when asked (a scrape, an export, a dashboard tick): the
streaming path itself only counts, in plain ints and the bucket arrays of
``app/streamer/histogram.py``. ``MetricValues.read`` takes the service's snapshot
(``app/streamer/snapshot.py``), so it is synchronous and must run on the service's
event loop; the two readings that cost a query, the change log's size and the
change source's own metrics, are cached and brought up to date by
``MetricValues.refresh`` (awaited before a read that wants them fresh).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.server.http_protocol import PendingLimits
from app.sources.base import SourceMetric
from app.storage import ChangeLog
from app.streamer.histogram import HistogramReading
from app.streamer.service import ChangeStreamerService
from app.streamer.snapshot import ServiceSnapshot
from app.timeouts import within

__all__ = [
    "ChangeLogRows",
    "ConnectionReadings",
    "MetricValues",
    "Readings",
    "StreamerReadings",
    "lag_seconds",
    "read_connections",
    "source_metrics",
]

log = logging.getLogger(__name__)

# A read waits at most this long for the change source's metrics (its own reads
# are bounded and cached; this guards against a source that is not).
SOURCE_METRICS_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class StreamerReadings:
    """The change streamer's values at one moment (None: not known yet)."""

    active_subscribers: int
    queued_subscribers: int  # waiting for the current transaction to end
    event_loop_lag_s: float  # the worst lateness of the last 60 s
    backlog_bytes: int  # buffered for catching-up subscribers, summed
    max_backlog_bytes: int  # … of the most backlogged one
    backlog_messages: int  # live messages buffered while subscribers catch up
    pending_messages: int  # sent to subscribers, not yet acked
    storer_queued_bytes: int  # waiting to be written to the change log
    flow_control_waits: dict[str, HistogramReading]  # by release mode, in seconds
    transactions: int
    changes: int
    commit_forward_s: HistogramReading  # upstream commit → forwarded
    group_commit_rows: HistogramReading
    catchup_s: HistogramReading  # catch-up asked for → read to its end
    change_log_rows: int | None  # cached (refresh)
    change_log_bytes: int | None  # cached (refresh)
    lag_s: float | None  # now − the newest lag report's upstream commit
    backup_wedged: bool
    backup_lag_s: float | None  # how long the oldest unbacked commit has been durable
    backup_write_lag_s: float | None  # zero's backup_lag: replica write − backup time
    reservations_open: int
    purged_rows: int
    purge_floor_holder: str | None
    source: tuple[SourceMetric, ...]  # the change source's own (cached: refresh)


@dataclass(frozen=True, slots=True)
class ConnectionReadings:
    """What the HTTP protocol's bounds did (``app/server/http_protocol.py``)."""

    pending: int
    handshakes_waiting: int
    handshakes_held: int
    refused: dict[int, int]  # by status


@dataclass(frozen=True, slots=True)
class Readings:
    running: bool
    streamer: StreamerReadings | None  # None before the service exists
    connections: ConnectionReadings | None  # None without connection bounds


async def source_metrics(service: ChangeStreamerService) -> list[SourceMetric]:
    """What the change source adds (``ChangeSource.metrics``); nothing if that fails."""
    try:
        metrics: list[SourceMetric] = await within(
            service.upstream_metrics(), SOURCE_METRICS_TIMEOUT_S
        )
    except Exception as e:
        log.warning("metrics: the change source's metrics failed: %r", e)
        return []
    return metrics


def lag_seconds(report: dict[str, Any] | None, now_s: float) -> float | None:
    """``now`` minus the commit time of the report's upstream message, if it has one."""
    if report is None:
        return None
    timings = report.get("lastTimings")
    if not isinstance(timings, dict):
        return None
    commit_ms = timings.get("commitTimeMs")
    if isinstance(commit_ms, bool) or not isinstance(commit_ms, int | float):
        return None
    return now_s - commit_ms / 1000


class ChangeLogRows:
    """The change log's row count and bytes, recomputed at most once per ``ttl_s``."""

    def __init__(
        self, *, ttl_s: float, timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._cached: tuple[ChangeLog, int, float] | None = None
        # The log's bytes, refreshed with the count (None until known).
        self.bytes: int | None = None

    async def get(self, change_log: ChangeLog) -> int | None:
        async with self._lock:  # concurrent reads share one query
            cached = self._cached
            if (
                cached is not None
                and cached[0] is change_log
                and self._clock() - cached[2] < self._ttl_s
            ):
                return cached[1]
            try:
                rows = await within(change_log.count(), self._timeout_s)
            except Exception as e:
                log.warning("metrics: counting the change log failed: %r", e)
                self._cached = None
                return None
            self._cached = (change_log, rows, self._clock())
            try:
                self.bytes = await within(change_log.size_bytes(), self._timeout_s)
            except Exception as e:
                log.warning("metrics: sizing the change log failed: %r", e)
                self.bytes = None
            return rows

    def last(self, change_log: ChangeLog) -> int | None:
        """The last count of ``change_log`` (None: never counted, or the count failed)."""
        cached = self._cached
        return cached[1] if cached is not None and cached[0] is change_log else None


def read_connections(limits: PendingLimits) -> ConnectionReadings:
    admission = limits.admission
    return ConnectionReadings(
        pending=limits.pending,
        handshakes_waiting=admission.waiting,
        handshakes_held=admission.held_total,
        refused=dict(limits.refused),
    )


class MetricValues:
    """The values of the service ``service_getter`` returns (None before it exists)."""

    def __init__(
        self,
        service_getter: Callable[[], ChangeStreamerService | None],
        *,
        connection_limits: PendingLimits | None = None,
        change_log_rows_ttl_s: float = 30.0,
        change_log_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._service_getter = service_getter
        self._limits = connection_limits
        self._wall_clock = wall_clock
        self.rows = ChangeLogRows(
            ttl_s=change_log_rows_ttl_s, timeout_s=change_log_timeout_s, clock=clock
        )
        self._source: tuple[ChangeStreamerService, tuple[SourceMetric, ...]] | None = None

    async def refresh(self) -> None:
        """Brings the cached readings up to date (each bounded, each cached in turn)."""
        service = self._service_getter()
        if service is None:
            return
        await self.rows.get(service.change_log)
        self._source = (service, tuple(await source_metrics(service)))

    async def read_fresh(self) -> Readings:
        """``refresh``, then ``read``."""
        await self.refresh()
        return self.read()

    def read(self) -> Readings:
        """The values now (on the service's event loop), with the cached ones as of
        the last ``refresh``."""
        service = self._service_getter()
        connections = read_connections(self._limits) if self._limits is not None else None
        if service is None:
            return Readings(running=False, streamer=None, connections=connections)
        snap = service.snapshot()
        return Readings(snap.running, self._read_streamer(service, snap), connections)

    def _read_streamer(
        self, service: ChangeStreamerService, snap: ServiceSnapshot
    ) -> StreamerReadings:
        subscribers = snap.subscribers
        backlogs = [s.buffered_bytes for s in subscribers]
        monitor = snap.backup.monitor
        write_lag = monitor.get("lag_seconds") if monitor is not None else None
        source = self._source
        rows = self.rows.last(service.change_log)
        return StreamerReadings(
            active_subscribers=snap.active_subscribers,
            queued_subscribers=snap.queued_subscribers,
            event_loop_lag_s=snap.loop_lag.max_60s_s,
            backlog_bytes=sum(backlogs),
            max_backlog_bytes=max(backlogs, default=0),
            backlog_messages=sum(s.backlog_messages for s in subscribers),
            pending_messages=sum(s.pending_messages for s in subscribers),
            storer_queued_bytes=snap.storer_queued_bytes,
            flow_control_waits=snap.flow_control_waits,
            transactions=snap.transactions,
            changes=snap.changes,
            commit_forward_s=snap.commit_forward_s,
            group_commit_rows=snap.group_commit_rows,
            catchup_s=snap.catchup_s,
            change_log_rows=rows,
            change_log_bytes=self.rows.bytes if rows is not None else None,
            lag_s=lag_seconds(snap.lag_report, self._wall_clock()),
            backup_wedged=snap.backup.problem is not None,
            backup_lag_s=snap.backup.lag_s,
            backup_write_lag_s=write_lag if isinstance(write_lag, float) else None,
            reservations_open=len(snap.reservations.open_tasks),
            purged_rows=snap.purge.rows_deleted,
            purge_floor_holder=snap.purge.floor_holder,
            source=source[1] if source is not None and source[0] is service else (),
        )
