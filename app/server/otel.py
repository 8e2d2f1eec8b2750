"""OTLP export of the service's metrics, under zero-cache's OpenTelemetry names.

Started by ``/metrics``' router when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``) is set, as zero-cache 1.9.0 starts its
SDK (``server/otel-start.ts``); this module, and with it the OpenTelemetry SDK, is
not imported otherwise. The exporter is OTLP/HTTP with protobuf bodies, every
``interval`` (``OTEL_METRIC_EXPORT_INTERVAL``, default 60 s); the SDK reads the
``OTEL_EXPORTER_OTLP_*`` settings (headers, timeout, compression, temporality)
from the process environment itself. zero-cache defaults the protocol to
``http/json``, which the Python exporter does not have: a collector's OTLP/HTTP
port takes both.

One source of values: each collection reads ``MetricValues`` (made of the
service's snapshot, ``app/streamer/snapshot.py``) once, on the service's event
loop (the exporter runs in a thread of its own), turns it into the very families
``/metrics`` serves (``metric_families.families``), and the instruments of
``EXPORTED`` observe their samples: counters and gauges through observable
instruments. OpenTelemetry has no asynchronous histogram, so the histograms
(bucket arrays counted by the streamer) are added to each export as
pre-aggregated cumulative histogram points, in the reader's documented
``_receive_metrics`` hook.

The resource is zero-cache's: ``service.version`` (zero-cache's is
``ZERO_SERVER_VERSION``, a setting this service ignores: here the package's
version), ``process.worker`` = ``change-streamer`` and ``process.worker_index`` = 0,
under what ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` say
(``service.name`` defaults to ``changestreamer``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client.core import Metric as Family

from app.server.metric_families import families
from app.server.metric_values import MetricValues

__all__ = ["EXPORTED", "Exported", "OtlpExport"]

log = logging.getLogger(__name__)

# zero-cache's meter (observability/metrics.ts: metrics.getMeter('zero')).
METER = "zero"
# How long a collection waits for the event loop to read the values.
READ_TIMEOUT_S = 5.0
DEFAULT_INTERVAL_MS = 60_000.0  # OTEL_METRIC_EXPORT_INTERVAL's default, as in zero-cache

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class Exported:
    """One OpenTelemetry metric and the ``/metrics`` family it reads.

    ``where``: only the family's samples with these labels (which are then not
    attributes); ``attributes``: label → attribute renames; ``scale``: a unit
    conversion (zero's ``replica.backup_lag`` is in milliseconds).
    """

    name: str
    kind: Kind
    unit: str
    description: str
    family: str  # as prometheus-client names it: a counter without ``_total``
    where: Mapping[str, str] = field(default_factory=dict)
    attributes: Mapping[str, str] = field(default_factory=dict)
    scale: float = 1.0


_MODE = {"mode": "release.mode"}  # zero's attribute for the release mode

EXPORTED: tuple[Exported, ...] = (
    # zero-cache 1.9.0's names (docs/metrics.md has the table).
    Exported(
        "zero.replication.transactions",
        "counter",
        "",
        "Count of replicated transactions",
        "changestreamer_transactions",
    ),
    Exported(
        "zero.replication.changes",
        "counter",
        "",
        "Count of replicated changes (DML or DDL statements)",
        "changestreamer_changes",
    ),
    Exported(
        "zero.replication.flow_control.waits",
        "counter",
        "",
        "Flow-control checkpoints completed, labeled by release mode.",
        "changestreamer_flow_control_waits",
        attributes=_MODE,
    ),
    Exported(
        "zero.replication.flow_control.wait_duration",
        "histogram",
        "s",
        "Time replication waits at flow-control checkpoints.",
        "changestreamer_flow_control_wait_duration_seconds",
        attributes=_MODE,
    ),
    Exported(
        "zero.replication.flow_control.active_subscribers",
        "gauge",
        "",
        "Active change-stream subscribers receiving live changes.",
        "changestreamer_subscribers",
        where={"state": "active"},
    ),
    Exported(
        "zero.replication.flow_control.queued_subscribers",
        "gauge",
        "",
        "Change-stream subscribers waiting for the current transaction to finish "
        "before activation.",
        "changestreamer_subscribers",
        where={"state": "queued"},
    ),
    Exported(
        "zero.replication.flow_control.pending_messages",
        "gauge",
        "",
        "Downstream change-stream messages not yet acked by subscribers.",
        "changestreamer_subscriber_pending_messages",
    ),
    Exported(
        "zero.replication.flow_control.backlog_messages",
        "gauge",
        "",
        "Live change-stream messages buffered while subscribers catch up.",
        "changestreamer_subscriber_backlog_messages",
    ),
    Exported(
        "zero.replication.flow_control.backlog_bytes",
        "gauge",
        "By",
        "Live change-stream bytes buffered while subscribers catch up.",
        "changestreamer_subscriber_backlog_bytes",
    ),
    Exported(
        "zero.replication.flow_control.max_backlog_bytes",
        "gauge",
        "By",
        "Maximum live change-stream bytes buffered by a single subscriber.",
        "changestreamer_subscriber_max_backlog_bytes",
    ),
    Exported(
        "zero.replication.lag_report_retries",
        "counter",
        "{report}",
        "Number of replication lag reports retried because the expected report was "
        "not received before the next report interval.",
        "changestreamer_lag_report_retries",
    ),
    Exported(
        "zero.replication.slot_retained_wal_bytes",
        "gauge",
        "By",
        "WAL bytes retained by the logical replication slot.",
        "changestreamer_slot_retained_wal_bytes",
    ),
    Exported(
        "zero.replica.backup_lag",
        "gauge",
        "millisecond",
        "Latency from when a change is written to the replica to when it is backed "
        "up to litestream.",
        "changestreamer_backup_write_lag_seconds",
        scale=1000.0,
    ),
    # This service's own, in zero's style under its own prefix.
    Exported(
        "changestreamer.running",
        "gauge",
        "1",
        "1 while the change stream is running, else 0.",
        "changestreamer_running",
    ),
    Exported(
        "changestreamer.event_loop_lag",
        "gauge",
        "s",
        "The longest the event loop ran late in the last 60 s.",
        "changestreamer_event_loop_lag_seconds",
    ),
    Exported(
        "changestreamer.replication.commit_forward_latency",
        "histogram",
        "s",
        "Time from an upstream commit to its forwarding to the subscribers.",
        "changestreamer_commit_forward_latency_seconds",
    ),
    Exported(
        "changestreamer.replication.catchup_duration",
        "histogram",
        "s",
        "Time from a subscription to the end of its catch-up read of the change log.",
        "changestreamer_catchup_duration_seconds",
    ),
    Exported(
        "changestreamer.replication.change_log.group_commit_rows",
        "histogram",
        "{row}",
        "Rows written by each change-log group commit.",
        "changestreamer_change_log_group_commit_rows",
    ),
    Exported(
        "changestreamer.replication.change_log.queued_bytes",
        "gauge",
        "By",
        "Bytes of changes queued to be written to the change log.",
        "changestreamer_storer_queued_bytes",
    ),
    Exported(
        "changestreamer.replication.change_log.rows",
        "gauge",
        "{row}",
        "Rows in the change log.",
        "changestreamer_change_log_rows",
    ),
    Exported(
        "changestreamer.replication.change_log.bytes",
        "gauge",
        "By",
        "Bytes the change log takes.",
        "changestreamer_change_log_bytes",
    ),
    Exported(
        "changestreamer.replication.change_log.purged_rows",
        "counter",
        "{row}",
        "Change log rows deleted by purges.",
        "changestreamer_change_log_purged_rows",
    ),
    Exported(
        "changestreamer.replication.change_log.purge_floor",
        "gauge",
        "1",
        "1, with what held the last purge pass's floor.",
        "changestreamer_purge_floor_info",
    ),
    Exported(
        "changestreamer.replication.lag",
        "gauge",
        "s",
        "Time since the upstream commit of the newest replication lag report.",
        "changestreamer_lag_seconds",
    ),
    Exported(
        "changestreamer.replication.slot_unconfirmed_wal_bytes",
        "gauge",
        "By",
        "WAL bytes past the replication slot's confirmed flush position.",
        "changestreamer_slot_unconfirmed_wal_bytes",
    ),
    Exported(
        "changestreamer.replica.backup_commit_lag",
        "gauge",
        "s",
        "How long the oldest durable commit not yet covered by a backup has waited.",
        "changestreamer_backup_lag_seconds",
    ),
    Exported(
        "changestreamer.replica.backup_wedged",
        "gauge",
        "1",
        "1 while the backup has made no progress for too long behind the replica.",
        "changestreamer_backup_wedged",
    ),
    Exported(
        "changestreamer.replica.snapshot_reservations_open",
        "gauge",
        "",
        "Snapshot reservations open now.",
        "changestreamer_snapshot_reservations_open",
    ),
    Exported(
        "changestreamer.server.connections_pending",
        "gauge",
        "",
        "Connections whose request has not fully arrived.",
        "changestreamer_connections_pending",
    ),
    Exported(
        "changestreamer.server.connections_refused",
        "counter",
        "",
        "Connections answered with an error status before their request was served.",
        "changestreamer_connections_refused",
    ),
    Exported(
        "changestreamer.server.handshakes_waiting",
        "gauge",
        "",
        "Websocket handshakes held for their turn.",
        "changestreamer_handshakes_waiting",
    ),
    Exported(
        "changestreamer.server.handshakes_held",
        "counter",
        "",
        "Websocket handshakes that had to wait for their turn.",
        "changestreamer_handshakes_held",
    ),
)


class _Collection:
    """The families of one collection, read once on the service's loop.

    Observable callbacks (the exporter's thread) take them; the reader's
    ``_receive_metrics`` takes them last and lets them go, so the next collection
    reads anew.
    """

    def __init__(self, values: MetricValues, loop: asyncio.AbstractEventLoop) -> None:
        self._values = values
        self._loop = loop
        self._lock = threading.Lock()
        self._families: dict[str, Family] | None = None

    def families(self) -> dict[str, Family]:
        with self._lock:
            if self._families is None:
                self._families = self._read()
            return self._families

    def done(self) -> None:
        with self._lock:
            self._families = None

    def _read(self) -> dict[str, Family]:
        future = asyncio.run_coroutine_threadsafe(self._values.read_fresh(), self._loop)
        try:
            readings = future.result(READ_TIMEOUT_S)
        except Exception as e:  # the loop is stuck or gone: nothing this time
            future.cancel()
            log.warning("metrics: reading the values for OTLP failed: %r", e)
            return {}
        return {f.name: f for f in families(readings)}


def _samples(
    exported: Exported, family: Family | None, suffix: str = ""
) -> Iterable[tuple[dict[str, str], float]]:
    """``(attributes, value)`` of the family's samples named ``family + suffix``."""
    if family is None:
        return
    name = family.name + suffix
    for sample in family.samples:
        if sample.name != name:
            continue
        labels = sample.labels
        if any(labels.get(k) != v for k, v in exported.where.items()):
            continue
        attributes = {
            exported.attributes.get(k, k): v for k, v in labels.items() if k not in exported.where
        }
        yield attributes, sample.value * exported.scale


def _observer(
    exported: Exported, collection: _Collection
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    suffix = "_total" if exported.kind == "counter" else ""

    def observe(_options: CallbackOptions) -> Iterable[Observation]:
        family = collection.families().get(exported.family)
        return [Observation(v, a) for a, v in _samples(exported, family, suffix)]

    return observe


@dataclass(slots=True)
class _Point:
    labels: dict[str, str]
    buckets: list[tuple[float, int]] = field(default_factory=list)  # (le, cumulative)
    sum: float = 0.0


def _histogram(exported: Exported, family: Family | None, start_ns: int, now_ns: int) -> Metric:
    """A family's histograms (one per label set) as cumulative OTLP points."""
    points: dict[tuple[tuple[str, str], ...], _Point] = {}
    for sample in family.samples if family is not None else ():
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        point = points.setdefault(tuple(sorted(labels.items())), _Point(labels))
        if sample.name.endswith("_bucket"):
            point.buckets.append((float(sample.labels["le"]), int(sample.value)))
        elif sample.name.endswith("_sum"):
            point.sum = sample.value
    data_points = []
    for point in points.values():
        buckets = sorted(point.buckets)
        cumulative = [n for _, n in buckets]
        data_points.append(
            HistogramDataPoint(
                attributes={exported.attributes.get(k, k): v for k, v in point.labels.items()},
                start_time_unix_nano=start_ns,
                time_unix_nano=now_ns,
                count=cumulative[-1] if cumulative else 0,
                sum=point.sum * exported.scale,
                bucket_counts=[b - a for a, b in itertools.pairwise([0, *cumulative])],
                explicit_bounds=[le * exported.scale for le, _ in buckets if le != math.inf],
                # OTLP's min and max are optional: the buckets do not know them.
                min=None,  # type: ignore[arg-type]
                max=None,  # type: ignore[arg-type]
            )
        )
    return Metric(
        name=exported.name,
        description=exported.description,
        unit=exported.unit,
        data=Histogram(data_points, AggregationTemporality.CUMULATIVE),
    )


class _Reader(PeriodicExportingMetricReader):
    """The periodic reader, with the histograms added to what it exports."""

    def __init__(
        self,
        exporter: OTLPMetricExporter,
        interval_ms: float,
        collection: _Collection,
        resource: Resource,
        scope: InstrumentationScope,
    ) -> None:
        super().__init__(exporter, export_interval_millis=interval_ms)
        self._collection = collection
        self._resource = resource
        self._scope = scope
        self._start_ns = time.time_ns()

    def _receive_metrics(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> None:
        try:
            found = self._collection.families()
        finally:
            self._collection.done()
        now_ns = time.time_ns()
        histograms = [
            _histogram(e, found.get(e.family), self._start_ns, now_ns)
            for e in EXPORTED
            if e.kind == "histogram"
        ]
        metrics_data = _with(metrics_data, histograms, self._resource, self._scope)
        super()._receive_metrics(metrics_data, timeout_millis, **kwargs)


def _with(
    data: MetricsData, metrics: list[Metric], resource: Resource, scope: InstrumentationScope
) -> MetricsData:
    """``data`` with ``metrics`` added to the scope of zero's meter."""
    resources = list(data.resource_metrics)
    for i, rm in enumerate(resources):
        scopes = list(rm.scope_metrics)
        for j, sm in enumerate(scopes):
            if sm.scope.name == scope.name:
                scopes[j] = dataclasses.replace(sm, metrics=[*sm.metrics, *metrics])
                resources[i] = dataclasses.replace(rm, scope_metrics=scopes)
                return MetricsData(resources)
    resources.append(ResourceMetrics(resource, [ScopeMetrics(scope, metrics, "")], ""))
    return MetricsData(resources)


def _endpoint(environ: Mapping[str, str]) -> str:
    """Where metrics go: the signal's own endpoint as given, else the base one's
    ``/v1/metrics`` (the OTLP exporter specification's rule)."""
    own = environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    if own:
        return own
    return environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/metrics"


def _interval_ms(environ: Mapping[str, str]) -> float:
    text = environ.get("OTEL_METRIC_EXPORT_INTERVAL")
    if not text:
        return DEFAULT_INTERVAL_MS
    try:
        interval = float(text)
    except ValueError:
        interval = math.nan
    if not (interval > 0 and math.isfinite(interval)):
        log.warning("OTEL_METRIC_EXPORT_INTERVAL=%s is not a positive number: 60000 ms", text)
        return DEFAULT_INTERVAL_MS
    return interval


def _resource() -> Resource:
    """zero-cache's resource attributes, under what the environment says
    (``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``: the SDK's detector)."""
    detected = Resource.create()
    attributes = {
        SERVICE_VERSION: importlib.metadata.version("changestreamer"),
        "process.worker": "change-streamer",
        "process.worker_index": 0,
        **detected.attributes,
    }
    if str(attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        attributes[SERVICE_NAME] = "changestreamer"
    return Resource(attributes, detected.schema_url)


class OtlpExport:
    """The running export: a meter provider of its own (not the global one)."""

    def __init__(self, provider: MeterProvider) -> None:
        self._provider = provider

    @classmethod
    def start(cls, values: MetricValues, environ: Mapping[str, str]) -> OtlpExport:
        """Starts exporting (on the service's event loop: the values are read there)."""
        protocol = environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL") or environ.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL"
        )
        if protocol and protocol != "http/protobuf":
            log.warning(
                "OTLP: exporting http/protobuf, not %s (the one this service has)", protocol
            )
        resource = _resource()
        version = str(resource.attributes.get(SERVICE_VERSION, ""))
        scope = InstrumentationScope(METER, version)
        collection = _Collection(values, asyncio.get_running_loop())
        endpoint, interval_ms = _endpoint(environ), _interval_ms(environ)
        exporter = OTLPMetricExporter(endpoint=endpoint)
        reader = _Reader(exporter, interval_ms, collection, resource, scope)
        # Stopped by ``stop`` (the app's lifespan), not at interpreter exit.
        provider = MeterProvider(metric_readers=[reader], resource=resource, shutdown_on_exit=False)
        meter = provider.get_meter(METER, version)
        for e in EXPORTED:
            callbacks = [_observer(e, collection)]
            if e.kind == "counter":
                meter.create_observable_counter(e.name, callbacks, e.unit, e.description)
            elif e.kind == "gauge":
                meter.create_observable_gauge(e.name, callbacks, e.unit, e.description)
        log.info("exporting metrics over OTLP to %s every %g s", endpoint, interval_ms / 1000)
        return cls(provider)

    async def stop(self) -> None:
        """Exports once more and stops. In a thread: that last collection reads the
        values through this event loop, which must stay free to answer."""
        await asyncio.to_thread(self._provider.shutdown)
