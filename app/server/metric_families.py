"""The service's metric families, built from one reading of it (``MetricValues``).

``/metrics`` (``app/server/metrics.py``) serves them in the Prometheus text format,
and the OTLP export (``app/server/otel.py``) reads the very same families: each is
built here once. Every family, its type and unit, and the zero-cache OpenTelemetry
name it maps to are listed in ``docs/metrics.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from app.server.metric_values import ConnectionReadings, Readings, StreamerReadings
from app.sources.base import SourceMetric
from app.streamer.histogram import HistogramReading

__all__ = ["families"]

# Flow-control release modes, in the order they are listed.
RELEASE_MODES = ("all-subscribers", "consensus-timeout")


def families(readings: Readings) -> list[Metric]:
    """The service's metric families (the process and Python ones aside)."""
    running = GaugeMetricFamily(
        "changestreamer_running",
        "1 while the change stream is running, else 0.",
        value=1 if readings.running else 0,
    )
    out: list[Metric] = [running]
    if readings.streamer is not None:
        out += _streamer_families(readings.streamer)
    if readings.connections is not None:
        out += _connection_families(readings.connections)
    return out


def _streamer_families(r: StreamerReadings) -> list[Metric]:
    subscribers = GaugeMetricFamily(
        "changestreamer_subscribers",
        "Connected subscribers: active, or queued until the current transaction ends.",
        labels=["state"],
    )
    subscribers.add_metric(["active"], r.active_subscribers)
    subscribers.add_metric(["queued"], r.queued_subscribers)
    modes = [m for m in RELEASE_MODES if m in r.flow_control_waits]
    modes += sorted(set(r.flow_control_waits) - set(RELEASE_MODES))
    waits = CounterMetricFamily(
        "changestreamer_flow_control_waits",
        "Flow-control broadcasts released, by how they were released.",
        labels=["mode"],
    )
    wait_durations = HistogramMetricFamily(
        "changestreamer_flow_control_wait_duration_seconds",
        "Seconds the stream waited at each flow-control checkpoint, by release mode.",
        labels=["mode"],
    )
    for mode in modes:
        waits.add_metric([mode], r.flow_control_waits[mode].count)
        _add_histogram(wait_durations, [mode], r.flow_control_waits[mode])
    out: list[Metric] = [
        subscribers,
        _gauge(
            "changestreamer_event_loop_lag_seconds",
            "The longest the event loop ran late in the last 60 s (a stall subscribers see).",
            r.event_loop_lag_s,
        ),
        _gauge(
            "changestreamer_subscriber_backlog_bytes",
            "Bytes of changes buffered for catching-up subscribers, summed over subscribers.",
            r.backlog_bytes,
        ),
        _gauge(
            "changestreamer_subscriber_max_backlog_bytes",
            "Bytes of changes buffered for the most backlogged subscriber.",
            r.max_backlog_bytes,
        ),
        _gauge(
            "changestreamer_subscriber_backlog_messages",
            "Live messages buffered while subscribers catch up, summed over subscribers.",
            r.backlog_messages,
        ),
        _gauge(
            "changestreamer_subscriber_pending_messages",
            "Messages sent to subscribers and not yet acked, summed over subscribers.",
            r.pending_messages,
        ),
        _gauge(
            "changestreamer_storer_queued_bytes",
            "Bytes of changes queued to be written to the change log.",
            r.storer_queued_bytes,
        ),
        waits,
        CounterMetricFamily(
            "changestreamer_flow_control_wait_seconds",
            "Seconds the stream waited for flow-control broadcasts to be released.",
            value=sum(h.sum for h in r.flow_control_waits.values()),
        ),
        wait_durations,
        CounterMetricFamily(
            "changestreamer_transactions",
            "Upstream transactions committed (received) since the process started.",
            value=r.transactions,
        ),
        CounterMetricFamily(
            "changestreamer_changes",
            "Upstream data changes received since the process started.",
            value=r.changes,
        ),
        _histogram(
            "changestreamer_commit_forward_latency_seconds",
            "Seconds from an upstream commit (its commitTimeMs, the upstream's clock) "
            "to its forwarding to the subscribers.",
            r.commit_forward_s,
        ),
        _histogram(
            "changestreamer_change_log_group_commit_rows",
            "Rows written by each change-log group commit.",
            r.group_commit_rows,
        ),
        _histogram(
            "changestreamer_catchup_duration_seconds",
            "Seconds from a subscription to the end of its catch-up read of the change log.",
            r.catchup_s,
        ),
    ]
    if r.change_log_rows is not None:
        out.append(
            _gauge(
                "changestreamer_change_log_rows",
                "Rows in the change log (recounted at most every 30 s).",
                r.change_log_rows,
            )
        )
    if r.change_log_bytes is not None:
        out.append(
            _gauge(
                "changestreamer_change_log_bytes",
                "Bytes the change log takes (refreshed with the row count).",
                r.change_log_bytes,
            )
        )
    if r.lag_s is not None:
        out.append(
            _gauge(
                "changestreamer_lag_seconds",
                "Seconds since the upstream commit of the newest replication lag report.",
                r.lag_s,
            )
        )
    out += [_source_family(m) for m in r.source]
    out += [
        _gauge(
            "changestreamer_backup_wedged",
            "1 while the backup has made no progress for too long behind the replica.",
            1 if r.backup_wedged else 0,
        ),
        _gauge(
            "changestreamer_snapshot_reservations_open",
            "Snapshot reservations open now (change log purges wait for them).",
            r.reservations_open,
        ),
        CounterMetricFamily(
            "changestreamer_change_log_purged_rows",
            "Change log rows deleted by purges since start.",
            value=r.purged_rows,
        ),
    ]
    if r.backup_write_lag_s is not None:
        out.append(
            _gauge(
                "changestreamer_backup_write_lag_seconds",
                "zero's backup_lag: the replica's last write time minus the backup's time.",
                r.backup_write_lag_s,
            )
        )
    if r.purge_floor_holder is not None:
        holder = GaugeMetricFamily(
            "changestreamer_purge_floor_info",
            "1, labelled with what held the last purge pass's floor.",
            labels=["held_by"],
        )
        holder.add_metric([r.purge_floor_holder], 1)
        out.append(holder)
    if r.backup_lag_s is not None:
        out.append(
            _gauge(
                "changestreamer_backup_lag_seconds",
                "Seconds the oldest durable commit not yet covered by a backup has waited.",
                r.backup_lag_s,
            )
        )
    return out


def _connection_families(c: ConnectionReadings) -> list[Metric]:
    refused = CounterMetricFamily(
        "changestreamer_connections_refused",
        "Connections answered with an error status before their request was served.",
        labels=["status"],
    )
    for status in sorted(c.refused):
        refused.add_metric([str(status)], c.refused[status])
    return [
        _gauge(
            "changestreamer_connections_pending",
            "Connections whose request has not fully arrived.",
            c.pending,
        ),
        _gauge(
            "changestreamer_handshakes_waiting",
            "Websocket handshakes held for their turn (the handshake rate limit).",
            c.handshakes_waiting,
        ),
        CounterMetricFamily(
            "changestreamer_handshakes_held",
            "Websocket handshakes that had to wait for their turn.",
            value=c.handshakes_held,
        ),
        refused,
    ]


def _gauge(name: str, help: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help, value=value)


def _histogram(name: str, help: str, reading: HistogramReading) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, help, labels=[])
    _add_histogram(family, [], reading)
    return family


def _add_histogram(
    family: HistogramMetricFamily, labels: Sequence[str], reading: HistogramReading
) -> None:
    buckets = [("+Inf" if le == math.inf else repr(le), float(n)) for le, n in reading.cumulative()]
    family.add_metric(labels, buckets, reading.sum)


def _source_family(metric: SourceMetric) -> Metric:
    """A change source's metric (``SourceMetric``), its samples' labels as they come."""
    family: Metric
    if metric.type == "counter":
        family = CounterMetricFamily(metric.name, metric.help)
        sample_name = family.name + "_total"
    else:
        family = GaugeMetricFamily(metric.name, metric.help)
        sample_name = family.name
    for labels, value in metric.samples:
        family.add_sample(sample_name, dict(labels), value)
    return family
