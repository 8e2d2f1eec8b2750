"""OTLP export: ``changestreamer serve`` with ``OTEL_EXPORTER_OTLP_ENDPOINT`` sends its
metrics, under zero-cache's names, to an OTLP/HTTP receiver on loopback; without
it, nothing of OpenTelemetry's SDK is imported."""

from __future__ import annotations

import asyncio
import gzip
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric

from app.server.metrics import metrics_router
from app.server.otel import EXPORTED

from .conftest import free_port, new_service
from .http import serve
from .scraping import EXPECTED, histogram, scrape, txn, value

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60.0

DOCS = REPO / "docs" / "metrics.md"
# In /metrics only: the sum of zero.replication.flow_control.wait_duration.
NOT_EXPORTED = {"changestreamer_flow_control_wait_seconds"}

# What every change streamer exports (the Postgres source's slot and lag-report
# metrics and the backup's lag need those set up).
ZERO_NAMES = {
    "zero.replication.transactions",
    "zero.replication.changes",
    "zero.replication.flow_control.waits",
    "zero.replication.flow_control.wait_duration",
    "zero.replication.flow_control.active_subscribers",
    "zero.replication.flow_control.queued_subscribers",
    "zero.replication.flow_control.pending_messages",
    "zero.replication.flow_control.backlog_messages",
    "zero.replication.flow_control.backlog_bytes",
    "zero.replication.flow_control.max_backlog_bytes",
}


@dataclass
class Receiver:
    """An OTLP/HTTP metrics endpoint: the requests it was sent, decoded."""

    url: str
    requests: list[ExportMetricsServiceRequest] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def wait_for(self, what: str, found: Any, *, since: int = 0) -> Any:
        """Waits until ``found(request)`` is truthy for a request (from the
        ``since``-th on); returns its value."""
        result: list[Any] = []

        def check() -> bool:
            for request in self.requests[since:]:
                if value := found(request):
                    result.append(value)
                    return True
            return False

        with self.arrived:
            assert self.arrived.wait_for(check, WAIT_S), f"no export with {what}"
        return result[0]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    state = Receiver("")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            request = ExportMetricsServiceRequest()
            request.ParseFromString(body)
            with state.arrived:
                state.paths.append(self.path)
                state.requests.append(request)
                state.arrived.notify_all()
            reply = ExportMetricsServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver")
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_", "OTEL_"))}
    env.update(PYTHONPATH=str(REPO), NODE_ENV="development", **extra)
    return env


def metrics_of(request: ExportMetricsServiceRequest) -> dict[str, Metric]:
    return {
        m.name: m for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }


def counted(request: ExportMetricsServiceRequest) -> dict[str, Metric] | None:
    """The request's metrics once transactions have been forwarded."""
    metrics = metrics_of(request)
    transactions = metrics.get("zero.replication.transactions")
    forward = metrics.get("changestreamer.replication.commit_forward_latency")
    if transactions is None or forward is None:
        return None
    if (
        transactions.sum.data_points[0].as_int == 0
        and not transactions.sum.data_points[0].as_double
    ):
        return None
    return metrics if forward.histogram.data_points[0].count > 0 else None


def test_serve_exports_zero_cache_metrics_over_otlp(tmp_path: Path, receiver: Receiver) -> None:
    port = free_port()
    with (tmp_path / "serve.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--port", str(port)],
            cwd=tmp_path,
            env=environment(
                ZERO_CHANGE_STREAMER_STARTUP_DELAY_MS="0",
                CHANGESTREAMER_DEMO_TRANSACTIONS_PER_SECOND="50",
                OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
                OTEL_METRIC_EXPORT_INTERVAL="200",
                OTEL_SERVICE_NAME="cs-test",
            ),
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            metrics = receiver.wait_for("forwarded transactions", counted)
        finally:
            proc.terminate()
            proc.wait(30)
    assert set(receiver.paths) == {"/v1/metrics"}
    assert set(metrics) >= ZERO_NAMES, ZERO_NAMES - set(metrics)
    # Everything exported is declared (and documented: test_docs_list_every_metric).
    assert set(metrics) <= {e.name for e in EXPORTED}

    transactions = metrics["zero.replication.transactions"].sum
    assert transactions.is_monotonic
    assert transactions.aggregation_temporality == 2  # cumulative, as zero-cache's SDK
    waits = metrics["zero.replication.flow_control.waits"].sum.data_points
    modes = {a.value.string_value for p in waits for a in p.attributes if a.key == "release.mode"}
    assert modes == {"all-subscribers", "consensus-timeout"}
    active = metrics["zero.replication.flow_control.active_subscribers"].gauge.data_points
    assert [p.as_int or p.as_double for p in active] == [0]
    assert not active[0].attributes  # state="active" is the metric's name here

    forward = metrics["changestreamer.replication.commit_forward_latency"]
    assert forward.unit == "s"
    [point] = forward.histogram.data_points
    assert len(point.bucket_counts) == len(point.explicit_bounds) + 1
    assert sum(point.bucket_counts) == point.count
    assert list(point.explicit_bounds)[:3] == [0.001, 0.002, 0.005]  # zero's latency buckets
    wait_duration = metrics["zero.replication.flow_control.wait_duration"].histogram.data_points
    assert {a.value.string_value for p in wait_duration for a in p.attributes} == modes

    resource = {
        a.key: a.value.string_value or a.value.int_value
        for a in receiver.requests[-1].resource_metrics[0].resource.attributes
    }
    assert resource["service.name"] == "cs-test"
    assert resource["process.worker"] == "change-streamer"
    assert "process.worker_index" in resource
    log_text = (tmp_path / "serve.log").read_text()
    assert f"exporting metrics over OTLP to {receiver.url}/v1/metrics every 0.2 s" in log_text


def number(metric: Metric, **attributes: str) -> float:
    """The value of the point with ``attributes`` of a sum or a gauge."""
    points = metric.sum.data_points if metric.HasField("sum") else metric.gauge.data_points
    for p in points:
        if {a.key: a.value.string_value for a in p.attributes} == attributes:
            return float(p.as_int if p.HasField("as_int") else p.as_double)
    raise AssertionError(f"no point {attributes} in {metric.name}")


async def test_the_export_carries_the_values_metrics_serves(
    tmp_path: Path, receiver: Receiver
) -> None:
    db, source, service = await new_service(tmp_path, task_id="otel-test")
    app = FastAPI()
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_METRIC_EXPORT_INTERVAL": "100"}
    app.include_router(metrics_router(lambda: service, environ=environ))
    runner = asyncio.create_task(service.run())
    try:
        async with serve(app) as url:
            stream = await asyncio.wait_for(source.wait_for_stream(), 10)
            for w in ("02", "03", "04", "05"):
                stream.push_all(txn(w, 2, commit_ms=time.time() * 1000))
            await asyncio.wait_for(service.storer.wait_durable("05"), 10)
            scraped = await scrape(url)

            # Nothing moves any more: every export from here on has what was scraped.
            with receiver.arrived:
                earlier = len(receiver.requests)
            exported = await asyncio.to_thread(
                receiver.wait_for, "an export after the scrape", metrics_of, since=earlier
            )
    finally:
        await service.stop()
        await asyncio.wait_for(runner, 20)
        await db.dispose()
    assert number(exported["zero.replication.transactions"]) == 4
    assert number(exported["zero.replication.changes"]) == value(
        scraped, "changestreamer_changes_total"
    )
    for name, family in (
        (
            "changestreamer.replication.commit_forward_latency",
            "changestreamer_commit_forward_latency_seconds",
        ),
        (
            "changestreamer.replication.change_log.group_commit_rows",
            "changestreamer_change_log_group_commit_rows",
        ),
    ):
        [point] = exported[name].histogram.data_points
        prometheus = histogram(scraped, family)
        assert (point.count, point.sum) == (prometheus.count, prometheus.sum)
        assert list(point.explicit_bounds) == [le for le, _ in prometheus.buckets[:-1]]
    assert histogram(scraped, "changestreamer_commit_forward_latency_seconds").count == 4


LOADED = """
import asyncio, sys
from fastapi import FastAPI
from app.server.metrics import metrics_router
async def main(environ):
    app = FastAPI()
    app.include_router(metrics_router(lambda: None, environ=environ))
    async with app.router.lifespan_context(app):
        pass
for environ in ENVIRONS:
    asyncio.run(main(environ))
    print(sorted(m for m in sys.modules if m.startswith(
        ("app.server.otel", "opentelemetry.sdk", "opentelemetry.exporter")
    )))
"""


def loaded(*environs: dict[str, str]) -> list[list[str]]:
    """The OpenTelemetry SDK modules imported once an app with each ``environ`` in
    turn went through its lifespan (in one new process)."""
    done = subprocess.run(
        [sys.executable, "-c", LOADED.replace("ENVIRONS", repr(environs))],
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [eval(line) for line in done.stdout.splitlines()]


def test_without_an_endpoint_nothing_of_the_sdk_is_imported(receiver: Receiver) -> None:
    unset, off, on = loaded(
        {},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_METRICS_EXPORTER": "none"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url},
    )
    assert unset == off == []
    # With an endpoint the export starts (and exports once as it stops).
    assert "app.server.otel" in on
    assert "opentelemetry.sdk.metrics" in on
    assert "opentelemetry.exporter.otlp.proto.http.metric_exporter" in on
    assert metrics_of(receiver.requests[-1])["changestreamer.running"]


def test_docs_list_every_metric_and_every_family_is_exported() -> None:
    named = set(re.findall(r"`([a-z][a-z0-9_.]*)", DOCS.read_text()))
    for e in EXPORTED:
        assert e.name in named, e.name
        assert e.family + ("_total" if e.kind == "counter" else "") in named, e.family
    assert set(EXPECTED) - NOT_EXPORTED <= {e.family for e in EXPORTED}
    assert "changestreamer_flow_control_wait_seconds_total" in named
