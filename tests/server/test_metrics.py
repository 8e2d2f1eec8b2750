"""/metrics in the Prometheus text format, scraped over loopback from a running streamer."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from fastapi import FastAPI

from app.server.metrics import (
    ChangeLogRows,
    MetricFamily,
    format_value,
    lag_seconds,
    metrics_router,
    render,
)
from app.sources.memory import MemoryChangeSource
from app.storage import (
    ChangeLog,
)
from app.streamer.service import ChangeStreamerService, SubscriberContext

from .conftest import REPLICA_VERSION, new_service
from .http import http_get, serve

# -- a real server on loopback -------------------------------------------------


# -- a strict parser of the text format (what a scraper accepts) -------------------

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')


@dataclass
class Family:
    help: str | None = None
    type: str | None = None
    samples: dict[tuple[tuple[str, str], ...], float] = field(default_factory=dict)


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def parse(text: str) -> dict[str, Family]:
    assert text.endswith("\n")
    families: dict[str, Family] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            family = families.setdefault(name, Family())
            assert family.help is None, f"second HELP: {line}"
            assert not family.samples, f"HELP after samples: {line}"
            family.help = _unescape(doc)
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            family = families.setdefault(name, Family())
            assert family.type is None, f"second TYPE: {line}"
            assert not family.samples, f"TYPE after samples: {line}"
            assert kind in ("counter", "gauge"), line
            family.type = kind
        else:
            m = _SAMPLE.fullmatch(line)
            assert m is not None, f"not a sample line: {line!r}"
            name, raw_labels, raw_value = m.groups()
            assert name in families, f"sample before its HELP/TYPE: {line}"
            labels: list[tuple[str, str]] = []
            rest = raw_labels or ""
            while rest:
                lm = _LABEL.match(rest)
                assert lm is not None, f"bad labels in {line!r}"
                labels.append((lm.group(1), _unescape(lm.group(2))))
                rest = rest[lm.end() :]
            value = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}.get(raw_value)
            families[name].samples[tuple(labels)] = float(raw_value) if value is None else value
    return families


async def scrape(url: str) -> dict[str, Family]:
    reply = await http_get(url + "/metrics")
    assert reply.status == 200
    assert reply.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    return parse(reply.text)


def value(families: dict[str, Family], name: str, **labels: str) -> float:
    return families[name].samples[tuple(labels.items())]


# -- the text format -----------------------------------------------------------------


def test_label_values_and_help_are_escaped_and_round_trip() -> None:
    tricky = 'a "quoted" back\\slash\nnewline'
    text = render(
        [
            MetricFamily("x_total", "counter", "help with \\ and\nnewline").add(3, label=tricky),
            MetricFamily("y", "gauge", "plain").add(0.25),
        ]
    )
    assert 'x_total{label="a \\"quoted\\" back\\\\slash\\nnewline"} 3\n' in text
    assert "# HELP x_total help with \\\\ and\\nnewline\n" in text
    families = parse(text)
    assert families["x_total"].help == "help with \\ and\nnewline"
    assert families["x_total"].type == "counter"
    assert value(families, "x_total", label=tricky) == 3
    assert value(families, "y") == 0.25


def test_values_are_formatted_as_prometheus_numbers() -> None:
    assert [format_value(v) for v in (3, 2.0, 0.5, 1e-7, math.inf, -math.inf)] == [
        "3",
        "2",
        "0.5",
        "1e-07",
        "+Inf",
        "-Inf",
    ]
    assert format_value(math.nan) == "NaN"


def test_lag_is_measured_from_the_commit_time_of_the_newest_report() -> None:
    report = {
        "lastTimings": {"sendTimeMs": 1000, "commitTimeMs": 1500, "receiveTimeMs": 1600},
        "nextSendTimeMs": 31000,
    }
    assert lag_seconds(report, 4.0) == 2.5
    assert lag_seconds({"nextSendTimeMs": 31000}, 4.0) is None  # the initial report
    assert lag_seconds(None, 4.0) is None


# -- a running streamer ---------------------------------------------------------------


@dataclass
class Running:
    service: ChangeStreamerService
    source: MemoryChangeSource
    url: str
    wall: list[float]


def txn(w: str, n: int) -> list[list[Any]]:
    rows: list[list[Any]] = [
        [
            "data",
            {
                "tag": "insert",
                "relation": {"schema": "public", "name": "t", "rowKey": {"columns": ["id"]}},
                "new": {"id": i},
            },
        ]
        for i in range(n)
    ]
    return [
        ["begin", {"tag": "begin"}, {"commitWatermark": w}],
        *rows,
        ["commit", {"tag": "commit"}, {"watermark": w}],
    ]


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    db, source, service = await new_service(tmp_path, task_id="metrics-test")
    wall = [1_700_000_000.0]
    app = FastAPI()
    app.include_router(
        metrics_router(lambda: service, change_log_rows_ttl_s=0, wall_clock=lambda: wall[0])
    )
    runner = asyncio.create_task(service.run())
    try:
        async with serve(app) as url:
            yield Running(service, source, url, wall)
    finally:
        await service.stop()
        await asyncio.wait_for(runner, 20)
        await db.dispose()


EXPECTED = {
    "changestreamer_running": "gauge",
    "changestreamer_subscribers": "gauge",
    "changestreamer_event_loop_lag_seconds": "gauge",
    "changestreamer_subscriber_backlog_bytes": "gauge",
    "changestreamer_subscriber_max_backlog_bytes": "gauge",
    "changestreamer_subscriber_pending_messages": "gauge",
    "changestreamer_storer_queued_bytes": "gauge",
    "changestreamer_flow_control_waits_total": "counter",
    "changestreamer_flow_control_wait_seconds_total": "counter",
    "changestreamer_transactions_total": "counter",
    "changestreamer_changes_total": "counter",
    "changestreamer_change_log_rows": "gauge",
    "changestreamer_backup_wedged": "gauge",
    "changestreamer_snapshot_reservations_open": "gauge",
    "changestreamer_change_log_purged_rows_total": "counter",
    "changestreamer_change_log_bytes": "gauge",
}


async def test_metrics_have_help_and_type_and_move_with_the_stream(running: Running) -> None:
    stream = await asyncio.wait_for(running.source.wait_for_stream(), 10)
    before = await scrape(running.url)
    assert {name: f.type for name, f in before.items()} == EXPECTED  # no lag report yet
    assert all(f.help for f in before.values())
    assert value(before, "changestreamer_running") == 1
    assert value(before, "changestreamer_subscribers", state="active") == 0
    assert value(before, "changestreamer_subscribers", state="queued") == 0
    assert value(before, "changestreamer_flow_control_waits_total", mode="all-subscribers") == 0
    assert value(before, "changestreamer_flow_control_waits_total", mode="consensus-timeout") == 0
    assert value(before, "changestreamer_transactions_total") == 0
    assert value(before, "changestreamer_changes_total") == 0
    assert value(before, "changestreamer_change_log_rows") == 2  # the replica version's seed

    running.service.subscribe(
        SubscriberContext(
            protocol_version=6,
            id="vs-1",
            mode="serving",
            replica_version=REPLICA_VERSION,
            watermark=REPLICA_VERSION,
        )
    )
    # Live from here on: what follows goes straight to its channel, not to a
    # catch-up backlog (the pending-messages gauge counts the channel).
    for _ in range(500):
        if not any(s.backlogged for s in running.service.forwarder.active):
            break
        await asyncio.sleep(0.01)
    stream.push_all(txn("02", 3))
    await asyncio.wait_for(running.service.storer.wait_durable("02"), 10)

    after = await scrape(running.url)
    assert value(after, "changestreamer_subscribers", state="active") == 1
    assert value(after, "changestreamer_transactions_total") == 1
    assert value(after, "changestreamer_changes_total") == 3
    assert value(after, "changestreamer_change_log_rows") == 2 + 5  # begin, 3 inserts, commit
    assert value(after, "changestreamer_storer_queued_bytes") == 0
    # Nobody consumes the subscriber's stream: its messages stay pending.
    assert value(after, "changestreamer_subscriber_pending_messages") > 0


async def test_lag_appears_once_a_lag_report_with_timings_arrived(running: Running) -> None:
    stream = await asyncio.wait_for(running.source.wait_for_stream(), 10)
    assert "changestreamer_lag_seconds" not in await scrape(running.url)
    report = {
        "lastTimings": {
            "sendTimeMs": 1_699_999_990_000,
            "commitTimeMs": 1_699_999_995_000,
            "receiveTimeMs": 1_699_999_996_000,
        },
        "nextSendTimeMs": 1_700_000_020_000,
    }
    stream.push_all(
        [*txn("02", 1), ["status", {"ack": False, "lagReport": report}, {"watermark": "02"}]]
    )
    await asyncio.wait_for(running.service.storer.wait_durable("02"), 10)
    for _ in range(500):  # the status follows the commit through the same loop
        families = await scrape(running.url)
        if "changestreamer_lag_seconds" in families:
            break
        await asyncio.sleep(0.01)
    assert families["changestreamer_lag_seconds"].type == "gauge"
    assert value(families, "changestreamer_lag_seconds") == 5.0
    running.wall[0] += 7
    assert value(await scrape(running.url), "changestreamer_lag_seconds") == 12.0


async def test_backup_lag_appears_once_a_backup_watermark_is_known(running: Running) -> None:
    stream = await asyncio.wait_for(running.source.wait_for_stream(), 10)
    stream.push_all(txn("02", 1))
    await asyncio.wait_for(running.service.storer.wait_durable("02"), 10)
    assert "changestreamer_backup_lag_seconds" not in await scrape(running.url)
    running.service.track_backup_watermark("02")
    families = await scrape(running.url)
    assert families["changestreamer_backup_lag_seconds"].type == "gauge"
    assert value(families, "changestreamer_backup_lag_seconds") == 0.0


async def test_without_a_service_only_running_zero_is_exposed() -> None:
    app = FastAPI()
    app.include_router(metrics_router(lambda: None))
    async with serve(app) as url:
        families = await scrape(url)
    assert list(families) == ["changestreamer_running"]
    assert value(families, "changestreamer_running") == 0


# -- the change-log row count is cheap ---------------------------------------------


class CountingLog:
    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.queries = 0
        self.error: Exception | None = None

    async def count(self) -> int:
        self.queries += 1
        if self.error is not None:
            raise self.error
        return self.rows


async def test_the_row_count_is_reused_within_its_ttl_and_recounted_after() -> None:
    now = [100.0]
    rows = ChangeLogRows(ttl_s=30, timeout_s=5, clock=lambda: now[0])
    log = CountingLog(10)
    change_log = cast(ChangeLog, log)
    assert await rows.get(change_log) == 10
    log.rows = 11
    now[0] += 29.9
    assert await rows.get(change_log) == 10
    assert log.queries == 1
    now[0] += 0.1
    assert await rows.get(change_log) == 11
    assert log.queries == 2


async def test_a_failing_row_count_leaves_the_sample_out(caplog: pytest.LogCaptureFixture) -> None:
    rows = ChangeLogRows(ttl_s=0, timeout_s=5)
    log = CountingLog(10)
    log.error = RuntimeError("db down")
    assert await rows.get(cast(ChangeLog, log)) is None
    assert "db down" in caplog.text
    log.error = None
    assert await rows.get(cast(ChangeLog, log)) == 10
