"""``GET /metrics``: the streamer's state in the Prometheus text format (0.0.4).

Written by hand (no client library): a scrape reads the service's counters and
gauges as they are at that moment, so there is no registry to keep. Metrics:

================================================  =======  =================================
``changestreamer_running``                        gauge    1 while the change stream runs
``changestreamer_subscribers{state}``             gauge    ``active`` / ``queued`` subscribers
``changestreamer_event_loop_lag_seconds``         gauge    worst event-loop lateness, last 60 s
``changestreamer_subscriber_backlog_bytes``       gauge    bytes buffered for subscribers, sum
``changestreamer_subscriber_max_backlog_bytes``   gauge    … of the most backlogged subscriber
``changestreamer_subscriber_pending_messages``    gauge    sent but not yet acked, sum
``changestreamer_storer_queued_bytes``            gauge    waiting to be written to the log
``changestreamer_flow_control_waits_total{mode}`` counter  broadcasts released, by release mode
``changestreamer_flow_control_wait_seconds_total`` counter time spent waiting for releases
``changestreamer_transactions_total``             counter  upstream transactions committed
``changestreamer_changes_total``                  counter  upstream data changes
``changestreamer_change_log_rows``                gauge    rows in the change log (cached)
``changestreamer_lag_seconds``                    gauge    now − newest lag report's commit
``changestreamer_backup_lag_seconds``             gauge    age of the oldest unbacked commit
``changestreamer_backup_wedged``                  gauge    1 while the backup is wedged
``changestreamer_backup_write_lag_seconds``       gauge    replica write time − backup time
``changestreamer_snapshot_reservations_open``     gauge    open reservations (purge waits)
``changestreamer_change_log_purged_rows_total``   counter  rows purged from the change log
``changestreamer_change_log_bytes``               gauge    bytes of the change log (cached)
``changestreamer_purge_floor_info{held_by}``      gauge    what held the last purge floor
``changestreamer_connections_pending``            gauge    connections whose request is arriving
``changestreamer_handshakes_waiting``             gauge    websocket handshakes held for their turn
``changestreamer_handshakes_held_total``          counter  handshakes that had to wait
``changestreamer_connections_refused_total{status}`` counter  connections refused (503, 408, 414…)
``changestreamer_slot_retained_wal_bytes{slot}``  gauge    WAL Postgres keeps for the slot (pg)
``changestreamer_slot_unconfirmed_wal_bytes{slot}`` gauge  WAL past the slot's confirmed flush (pg)
``changestreamer_lag_report_retries_total``       counter  lag reports sent again (pg)
================================================  =======  =================================

Counters restart from zero with the process (Prometheus' ``rate`` handles that).
``changestreamer_lag_seconds`` appears once a lag report with timings arrived; it
is computed at scrape time (now − the report's upstream commit time), so it rises
between reports (every ``ZERO_REPLICATION_LAG_REPORT_INTERVAL_MS``) and keeps
rising when replication stalls, which is what an alert wants.

The ``(pg)`` metrics come from the change source (``ChangeSource.metrics``): the
Postgres source reports every slot of the shard (an old replica's slot pins WAL
too), read with one bounded query that is reused for a few seconds
(``SlotWalProbe``), so frequent scrapes do not load the upstream.
``changestreamer_backup_lag_seconds`` appears once a backup watermark is known: how
long the oldest durable commit that no backup covers yet has been durable (0 when
the backup is caught up).

``changestreamer_change_log_rows`` is a ``COUNT(*)``: it runs at most once per
``change_log_rows_ttl_s`` (scrapes in between reuse the value), one at a time,
with a timeout; on failure the sample is left out.

No authentication: like the replication port itself, ``/metrics`` must only be
reachable from the internal network (the scraper's).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import Response

from app.server.http_protocol import PendingLimits
from app.sources.base import SourceMetric
from app.storage import ChangeLog
from app.streamer.service import ChangeStreamerService
from app.timeouts import within

log = logging.getLogger(__name__)

# A scrape waits at most this long for the change source's metrics (its own reads
# are bounded and cached; this guards against a source that is not).
SOURCE_METRICS_TIMEOUT_S = 5.0

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

MetricType = Literal["gauge", "counter"]


# ----------------------------------------------------------------------
# The text format.


@dataclass(slots=True)
class MetricFamily:
    name: str
    type: MetricType
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> MetricFamily:
        self.samples.append((labels, value))
        return self


def render(families: Iterable[MetricFamily]) -> str:
    """The exposition text: ``# HELP``, ``# TYPE``, then one line per sample."""
    lines: list[str] = []
    for family in families:
        lines.append(f"# HELP {family.name} {escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.type}")
        for labels, value in family.samples:
            if labels:
                text = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())
                lines.append(f"{family.name}{{{text}}} {format_value(value)}")
            else:
                lines.append(f"{family.name} {format_value(value)}")
    return "\n".join(lines) + "\n" if lines else ""


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def escape_label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(value: float) -> str:
    if isinstance(value, int) or (math.isfinite(value) and value.is_integer()):
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


# ----------------------------------------------------------------------
# Reading the service.


def latest_lag_report(service: ChangeStreamerService) -> dict[str, Any] | None:
    """The newest lag report the service has seen (what subscribers receive).

    The service keeps it in a private attribute; this is the one place that
    reads it, until the service exposes it.
    """
    report: dict[str, Any] | None = service._latest_lag_report
    return report


async def source_metrics(service: ChangeStreamerService) -> list[SourceMetric]:
    """What the change source adds (``ChangeSource.metrics``); nothing if that fails.

    Like ``latest_lag_report``, the one place that reads the service's source.
    """
    try:
        metrics: list[SourceMetric] = await within(
            service._source.metrics(), SOURCE_METRICS_TIMEOUT_S
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
    """The change log's row count, recomputed at most once per ``ttl_s``."""

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
        async with self._lock:  # concurrent scrapes share one query
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


async def collect(
    service: ChangeStreamerService | None, rows: ChangeLogRows, now_s: float
) -> list[MetricFamily]:
    running = MetricFamily(
        "changestreamer_running", "gauge", "1 while the change stream is running, else 0."
    )
    running.add(1 if service is not None and service.running else 0)
    if service is None:
        return [running]
    forwarder = service.forwarder
    subscribers = [*forwarder.active, *forwarder.queued]
    backlogs = [s.buffered_bytes for s in subscribers]
    families = [
        running,
        MetricFamily(
            "changestreamer_subscribers",
            "gauge",
            "Connected subscribers: active, or queued until the current transaction ends.",
        )
        .add(len(forwarder.active), state="active")
        .add(len(forwarder.queued), state="queued"),
        MetricFamily(
            "changestreamer_event_loop_lag_seconds",
            "gauge",
            "The longest the event loop ran late in the last 60 s (a stall subscribers see).",
        ).add(service.loop_lag.max_s()),
        MetricFamily(
            "changestreamer_subscriber_backlog_bytes",
            "gauge",
            "Bytes of changes buffered for catching-up subscribers, summed over subscribers.",
        ).add(sum(backlogs)),
        MetricFamily(
            "changestreamer_subscriber_max_backlog_bytes",
            "gauge",
            "Bytes of changes buffered for the most backlogged subscriber.",
        ).add(max(backlogs, default=0)),
        MetricFamily(
            "changestreamer_subscriber_pending_messages",
            "gauge",
            "Messages sent to subscribers and not yet acked, summed over subscribers.",
        ).add(sum(s.downstream.pending for s in subscribers)),
        MetricFamily(
            "changestreamer_storer_queued_bytes",
            "gauge",
            "Bytes of changes queued to be written to the change log.",
        ).add(service.storer.queued_bytes),
        _waits_family(forwarder.stats.waits),
        MetricFamily(
            "changestreamer_flow_control_wait_seconds_total",
            "counter",
            "Seconds the stream waited for flow-control broadcasts to be released.",
        ).add(forwarder.stats.wait_seconds),
        MetricFamily(
            "changestreamer_transactions_total",
            "counter",
            "Upstream transactions committed (received) since the process started.",
        ).add(service.transactions),
        MetricFamily(
            "changestreamer_changes_total",
            "counter",
            "Upstream data changes received since the process started.",
        ).add(service.changes),
    ]
    count = await rows.get(service.change_log)
    if count is not None:
        families.append(
            MetricFamily(
                "changestreamer_change_log_rows",
                "gauge",
                "Rows in the change log (recounted at most every few seconds).",
            ).add(count)
        )
    lag = lag_seconds(latest_lag_report(service), now_s)
    if lag is not None:
        families.append(
            MetricFamily(
                "changestreamer_lag_seconds",
                "gauge",
                "Seconds since the upstream commit of the newest replication lag report.",
            ).add(lag)
        )
    for metric in await source_metrics(service):
        family = MetricFamily(metric.name, metric.type, metric.help)
        for labels, value in metric.samples:
            family.add(value, **labels)
        families.append(family)
    families.append(
        MetricFamily(
            "changestreamer_backup_wedged",
            "gauge",
            "1 while the backup has made no progress for too long behind the replica.",
        ).add(1 if service.backup_problem is not None else 0)
    )
    families.append(
        MetricFamily(
            "changestreamer_snapshot_reservations_open",
            "gauge",
            "Snapshot reservations open now (change log purges wait for them).",
        ).add(len(service.reservations.open_tasks))
    )
    families.append(
        MetricFamily(
            "changestreamer_change_log_purged_rows_total",
            "counter",
            "Change log rows deleted by purges since start.",
        ).add(service.purger.deleted)
    )
    if rows.bytes is not None:
        families.append(
            MetricFamily(
                "changestreamer_change_log_bytes",
                "gauge",
                "Bytes the change log takes (refreshed with the row count).",
            ).add(rows.bytes)
        )
    write_lag = service.backup_state.stats().get("lag_seconds") if service.backup_state else None
    if isinstance(write_lag, float):
        families.append(
            MetricFamily(
                "changestreamer_backup_write_lag_seconds",
                "gauge",
                "zero's backup_lag: the replica's last write time minus the backup's time.",
            ).add(write_lag)
        )
    holder = service.purger.floor_holder
    if holder is not None:
        families.append(
            MetricFamily(
                "changestreamer_purge_floor_info",
                "gauge",
                "1, labelled with what held the last purge pass's floor.",
            ).add(1, held_by=holder)
        )
    backup_lag = service.backup_lag_seconds()
    if backup_lag is not None:
        families.append(
            MetricFamily(
                "changestreamer_backup_lag_seconds",
                "gauge",
                "Seconds the oldest durable commit not yet covered by a backup has waited.",
            ).add(backup_lag)
        )
    return families


def _waits_family(waits: dict[str, int]) -> MetricFamily:
    family = MetricFamily(
        "changestreamer_flow_control_waits_total",
        "counter",
        "Flow-control broadcasts released, by how they were released.",
    )
    for mode in _modes(waits):
        family.add(waits[mode], mode=mode)
    return family


def _modes(waits: dict[str, int]) -> Sequence[str]:
    known = ["all-subscribers", "consensus-timeout"]
    return [m for m in known if m in waits] + sorted(set(waits) - set(known))


# ----------------------------------------------------------------------
# The route.


def connection_families(limits: PendingLimits) -> list[MetricFamily]:
    """What the HTTP protocol's bounds did (app/server/http_protocol.py)."""
    refused = MetricFamily(
        "changestreamer_connections_refused_total",
        "counter",
        "Connections answered with an error status before their request was served.",
    )
    for status in sorted(limits.refused):
        refused.add(limits.refused[status], status=str(status))
    admission = limits.admission
    return [
        MetricFamily(
            "changestreamer_connections_pending",
            "gauge",
            "Connections whose request has not fully arrived.",
        ).add(limits.pending),
        MetricFamily(
            "changestreamer_handshakes_waiting",
            "gauge",
            "Websocket handshakes held for their turn (the handshake rate limit).",
        ).add(admission.waiting),
        MetricFamily(
            "changestreamer_handshakes_held_total",
            "counter",
            "Websocket handshakes that had to wait for their turn.",
        ).add(admission.held_total),
        refused,
    ]


def metrics_router(
    service_getter: Callable[[], ChangeStreamerService | None],
    *,
    connection_limits: PendingLimits | None = None,
    change_log_rows_ttl_s: float = 30.0,
    change_log_timeout_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
) -> APIRouter:
    """``GET /metrics``; ``service_getter`` returns None before the service exists."""
    router = APIRouter()
    rows = ChangeLogRows(ttl_s=change_log_rows_ttl_s, timeout_s=change_log_timeout_s, clock=clock)

    @router.get("/metrics")
    async def metrics() -> Response:
        families = await collect(service_getter(), rows, wall_clock())
        if connection_limits is not None:
            families += connection_families(connection_limits)
        return Response(render(families), media_type=CONTENT_TYPE)

    return router
