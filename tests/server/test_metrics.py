"""/metrics, scraped over loopback from a running streamer and read with
prometheus-client's own parser (what a scraper accepts)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
from fastapi import FastAPI

from app.server.metric_values import ChangeLogRows, lag_seconds
from app.server.metrics import metrics_router
from app.storage import ChangeLog
from app.streamer.service import ChangeStreamerService, SubscriberContext
from tests.memory_source import MemoryChangeSource

from .conftest import REPLICA_VERSION, new_service
from .http import http_get, serve
from .scraping import EXPECTED, Scrape, eventually, histogram, scrape, txn, value

# -- a running streamer --------------------------------------------------------------


@dataclass
class Running:
    service: ChangeStreamerService
    source: MemoryChangeSource
    url: str
    wall: list[float]


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


# The library's process and Python collectors (Linux has /proc).
PROCESS = {
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_open_fds": "gauge",
    "process_start_time_seconds": "gauge",
    "python_info": "gauge",
    "python_gc_objects_collected": "counter",
    "python_gc_collections": "counter",
}


def ours(families: Scrape) -> dict[str, str]:
    return {name: f.type for name, f in families.items() if name.startswith("changestreamer_")}


async def test_families_have_help_types_and_the_process_and_python_ones(
    running: Running,
) -> None:
    await asyncio.wait_for(running.source.wait_for_stream(), 10)
    families = await scrape(running.url)
    assert ours(families) == EXPECTED  # no lag report, no backup yet
    assert {n: families[n].type for n in PROCESS} == PROCESS
    assert all(f.help for f in families.values())
    assert value(families, "changestreamer_running") == 1
    assert value(families, "changestreamer_subscribers", state="active") == 0
    assert value(families, "changestreamer_subscribers", state="queued") == 0
    for mode in ("all-subscribers", "consensus-timeout"):
        assert value(families, "changestreamer_flow_control_waits_total", mode=mode) == 0
        timed = histogram(families, "changestreamer_flow_control_wait_duration_seconds", mode=mode)
        assert timed.count == 0
    assert value(families, "changestreamer_transactions_total") == 0
    assert value(families, "changestreamer_changes_total") == 0
    assert value(families, "changestreamer_change_log_rows") == 2  # the replica version's seed
    for name in (
        "changestreamer_commit_forward_latency_seconds",
        "changestreamer_change_log_group_commit_rows",
        "changestreamer_catchup_duration_seconds",
    ):
        assert histogram(families, name).count == 0
    assert value(families, "process_resident_memory_bytes") > 0


async def test_counters_and_histograms_move_with_the_stream(running: Running) -> None:
    stream = await asyncio.wait_for(running.source.wait_for_stream(), 10)
    running.service.subscribe(
        SubscriberContext(
            protocol_version=6,
            id="vs-1",
            mode="serving",
            replica_version=REPLICA_VERSION,
            watermark=REPLICA_VERSION,
        )
    )
    # Its catch-up (nothing to read: the log holds only the seed) ends once.
    await eventually(
        running.url,
        lambda f: histogram(f, "changestreamer_catchup_duration_seconds").count == 1,
        "the catch-up",
    )
    # Three transactions, committed upstream 0.25 s before they arrive (the
    # upstream's clock: the wall clock here).
    committed_ms = time.time() * 1000 - 250
    for n, w in enumerate(("02", "03", "04"), start=1):
        stream.push_all(txn(w, n, commit_ms=committed_ms))
    await asyncio.wait_for(running.service.storer.wait_durable("04"), 10)

    families = await scrape(running.url)
    assert value(families, "changestreamer_subscribers", state="active") == 1
    assert value(families, "changestreamer_transactions_total") == 3
    assert value(families, "changestreamer_changes_total") == 1 + 2 + 3
    forward = histogram(families, "changestreamer_commit_forward_latency_seconds")
    assert forward.count == 3
    assert 3 * 0.25 <= forward.sum < 3 * 10
    assert dict(forward.buckets)[0.2] == 0  # none under the 0.25 s they waited upstream
    group = histogram(families, "changestreamer_change_log_group_commit_rows")
    assert 1 <= group.count <= 3
    assert group.sum == (1 + 2) + (2 + 2) + (3 + 2)  # every row, begins and commits too
    assert value(families, "changestreamer_change_log_rows") == 2 + group.sum
    assert histogram(families, "changestreamer_catchup_duration_seconds").count == 1
    assert value(families, "changestreamer_storer_queued_bytes") == 0
    # Nobody consumes the subscriber's stream: its messages stay pending.
    assert value(families, "changestreamer_subscriber_pending_messages") > 0


async def test_commits_without_a_commit_time_are_not_measured(running: Running) -> None:
    stream = await asyncio.wait_for(running.source.wait_for_stream(), 10)
    stream.push_all([*txn("02", 1), *txn("03", 1, commit_ms=time.time() * 1000)])
    await asyncio.wait_for(running.service.storer.wait_durable("03"), 10)
    families = await scrape(running.url)
    assert value(families, "changestreamer_transactions_total") == 2
    assert histogram(families, "changestreamer_commit_forward_latency_seconds").count == 1


async def test_flow_control_waits_are_counted_and_timed_by_release_mode(
    running: Running,
) -> None:
    stream = await asyncio.wait_for(running.source.wait_for_stream(), 10)
    # 40 rows of 10 KB: a flow-control checkpoint every 64 KiB, each released at
    # once (no subscriber to wait for), the one before the newest waited on.
    stream.push_all(txn("02", 40, pad=10_000))
    await asyncio.wait_for(running.service.storer.wait_durable("02"), 10)
    families = await scrape(running.url)
    waits = value(families, "changestreamer_flow_control_waits_total", mode="all-subscribers")
    assert waits >= 4
    timed = histogram(
        families, "changestreamer_flow_control_wait_duration_seconds", mode="all-subscribers"
    )
    assert timed.count == waits
    assert timed.sum == pytest.approx(
        value(families, "changestreamer_flow_control_wait_seconds_total")
    )


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
    # The status follows the commit through the same loop.
    families = await eventually(
        running.url, lambda f: "changestreamer_lag_seconds" in f, "the lag gauge"
    )
    assert families["changestreamer_lag_seconds"].type == "gauge"
    assert value(families, "changestreamer_lag_seconds") == 5.0
    running.wall[0] += 7
    assert value(await scrape(running.url), "changestreamer_lag_seconds") == 12.0


async def test_backup_lag_appears_once_a_backup_watermark_is_known(running: Running) -> None:
    stream = await asyncio.wait_for(running.source.wait_for_stream(), 10)
    stream.push_all(txn("02", 1))
    await asyncio.wait_for(running.service.storer.wait_durable("02"), 10)
    assert "changestreamer_backup_lag_seconds" not in await scrape(running.url)
    running.service.backups.track("02")
    families = await scrape(running.url)
    assert families["changestreamer_backup_lag_seconds"].type == "gauge"
    assert value(families, "changestreamer_backup_lag_seconds") == 0.0


async def test_without_a_service_only_running_zero_and_the_process_are_exposed() -> None:
    app = FastAPI()
    app.include_router(metrics_router(lambda: None))
    async with serve(app) as url:
        families = await scrape(url)
    assert ours(families) == {"changestreamer_running": "gauge"}
    assert value(families, "changestreamer_running") == 0
    assert set(PROCESS) <= set(families)


async def test_an_openmetrics_scraper_gets_openmetrics() -> None:
    app = FastAPI()
    app.include_router(metrics_router(lambda: None))
    async with serve(app) as url:
        reply = await http_get(url + "/metrics", {"Accept": "application/openmetrics-text"})
    assert reply.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert reply.text.endswith("# EOF\n")
    assert "changestreamer_running 0.0\n" in reply.text


# -- the values behind them ----------------------------------------------------------


def test_lag_is_measured_from_the_commit_time_of_the_newest_report() -> None:
    report = {
        "lastTimings": {"sendTimeMs": 1000, "commitTimeMs": 1500, "receiveTimeMs": 1600},
        "nextSendTimeMs": 31000,
    }
    assert lag_seconds(report, 4.0) == 2.5
    assert lag_seconds({"nextSendTimeMs": 31000}, 4.0) is None  # the initial report
    assert lag_seconds(None, 4.0) is None


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

    async def size_bytes(self) -> int:
        return self.rows * 100


async def test_the_row_count_is_reused_within_its_ttl_and_recounted_after() -> None:
    now = [100.0]
    rows = ChangeLogRows(ttl_s=30, timeout_s=5, clock=lambda: now[0])
    log = CountingLog(10)
    change_log = cast(ChangeLog, log)
    assert await rows.get(change_log) == 10
    assert (rows.last(change_log), rows.bytes) == (10, 1000)
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
    change_log = cast(ChangeLog, log)
    log.error = RuntimeError("db down")
    assert await rows.get(change_log) is None
    assert rows.last(change_log) is None
    assert "db down" in caplog.text
    log.error = None
    assert await rows.get(change_log) == 10
