"""``GET /metrics``: the service in the Prometheus text format, by prometheus-client.

Custom collectors read ``app/server/metric_values.py`` at scrape time: nothing on
the streaming path calls the client library (it counts in plain ints and bucket
arrays). Beside them the library's own process (``process_*``), platform
(``python_info``) and garbage-collector (``python_gc_*``) collectors. Every family,
its type and unit, and the zero-cache OpenTelemetry name it maps to are listed in
``docs/metrics.md``.

Counters restart from zero with the process (Prometheus' ``rate`` handles that).
``changestreamer_lag_seconds`` appears once a lag report with timings arrived; it
is computed at scrape time (now − the report's upstream commit time), so it rises
between reports and keeps rising when replication stalls, which is what an alert
wants. ``changestreamer_change_log_rows`` is a ``COUNT(*)``, run at most once per
``change_log_rows_ttl_s`` with a timeout (left out when it fails); the change
source's own metrics (``ChangeSource.metrics``: the Postgres slots' WAL) are read
with bounded, cached queries too.

With ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``…_METRICS_ENDPOINT``) set, the router's
lifespan also exports the same values over OTLP/HTTP under zero-cache's names
(``app/server/otel.py``, imported only then).

No authentication: like the replication port itself, ``/metrics`` must only be
reachable from the internal network (the scraper's).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry

from app.server.http_protocol import PendingLimits
from app.server.metric_families import families
from app.server.metric_values import (
    MetricValues,
)
from app.streamer.service import ChangeStreamerService

__all__ = ["ServiceCollector", "metrics_registry", "metrics_router", "otlp_enabled"]


class ServiceCollector(Collector):
    """The service's families, read when the registry is collected (on the loop)."""

    def __init__(self, values: MetricValues) -> None:
        self._values = values

    def collect(self) -> Iterable[Metric]:
        return families(self._values.read())


def metrics_registry(values: MetricValues) -> CollectorRegistry:
    """A registry of its own (not the library's global one): the service's families,
    then the process, platform and garbage-collector collectors."""
    registry = CollectorRegistry()
    registry.register(ServiceCollector(values))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def otlp_enabled(environ: Mapping[str, str]) -> bool:
    """Whether to export over OTLP: zero-cache's condition for metrics (an endpoint is
    set), unless ``OTEL_METRICS_EXPORTER=none`` turns metrics off."""
    if environ.get("OTEL_METRICS_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    )


def metrics_router(
    service_getter: Callable[[], ChangeStreamerService | None],
    *,
    connection_limits: PendingLimits | None = None,
    change_log_rows_ttl_s: float = 30.0,
    change_log_timeout_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    environ: Mapping[str, str] = os.environ,
) -> APIRouter:
    """``GET /metrics``, and the OTLP export while the app runs if ``environ`` asks
    for it; ``service_getter`` returns None before the service exists."""
    values = MetricValues(
        service_getter,
        connection_limits=connection_limits,
        change_log_rows_ttl_s=change_log_rows_ttl_s,
        change_log_timeout_s=change_log_timeout_s,
        clock=clock,
        wall_clock=wall_clock,
    )
    registry = metrics_registry(values)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not otlp_enabled(environ):
            yield
            return
        from app.server.otel import OtlpExport  # the SDK is imported only when used

        export = OtlpExport.start(values, environ)
        try:
            yield
        finally:
            await export.stop()

    router = APIRouter(lifespan=lifespan)

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        await values.refresh()
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        # Synchronous, on the loop: the collectors read the service where it runs.
        return Response(encode(registry), media_type=content_type)

    return router
