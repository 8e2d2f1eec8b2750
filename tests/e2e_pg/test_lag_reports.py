"""Lag reports and slot WAL through the whole service: Postgres → source → streamer →
subscriber, ``/metrics`` and ``/statz`` (``ZERO_REPLICATION_LAG_REPORT_INTERVAL_MS``).

The pipeline is the in-process one of ``conftest.py`` (initial sync, the service, a
serving subscriber). Every wait is on a condition, bounded; nothing asserts on timing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
from prometheus_client.core import Metric

from app.protocol.canonical_json import loads
from app.server.metric_families import families as metric_families
from app.server.metric_values import MetricValues
from tests.waiting import eventually

from .conftest import WAIT_S, StartUpstream, Upstream

SETUP = ("CREATE TABLE items (id serial PRIMARY KEY, v text)",)


async def lag_statuses(env: Upstream, count: int, *, commits_between: int = 0) -> list[Any]:
    """The next ``count`` lag reports with timings the subscriber receives (in band),
    with at least ``commits_between`` commits between the first and the last."""
    reports: list[Any] = []
    commits = 0
    deadline = time.monotonic() + WAIT_S * 2
    while len(reports) < count or commits < commits_between:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"{len(reports)} reports, {commits} commits between them"
        text = await asyncio.wait_for(env.subscriber.get(), remaining)
        env.subscriber.ack_next()
        assert isinstance(text, str)  # statuses and small changes
        message = loads(text)
        if message[0] == "commit" and reports:
            commits += 1
        if message[0] == "status" and "lastTimings" in message[1].get("lagReport", {}):
            reports.append(message[1]["lagReport"])
    return reports


async def families(env: Upstream, now_s: float) -> dict[str, Metric]:
    """``/metrics``' families (a counter's named without ``_total``) at ``now_s``."""
    values = MetricValues(
        lambda: env.runtime.service, change_log_rows_ttl_s=0, wall_clock=lambda: now_s
    )
    return {f.name: f for f in metric_families(await values.read_fresh())}


def lag(metrics: dict[str, Metric]) -> float:
    [sample] = metrics["changestreamer_lag_seconds"].samples
    return sample.value


async def test_reports_reach_subscribers_in_band_and_keep_coming_under_load(
    upstream: StartUpstream,
) -> None:
    env = await upstream(SETUP, ZERO_REPLICATION_LAG_REPORT_INTERVAL_MS="50")
    stop = asyncio.Event()

    async def write() -> None:
        async with await psycopg.AsyncConnection.connect(env.url, autocommit=True) as c:
            while not stop.is_set():
                await c.execute("INSERT INTO items (v) VALUES ('load')")

    writer = asyncio.create_task(write())
    try:
        reports = await lag_statuses(env, 4, commits_between=10)
    finally:
        stop.set()
        await writer
    sends = [r["lastTimings"]["sendTimeMs"] for r in reports]
    assert sends == sorted(sends)
    assert len(set(sends)) == len(sends)
    for report in reports:
        assert set(report) == {"lastTimings", "nextSendTimeMs"}
        assert set(report["lastTimings"]) == {"sendTimeMs", "commitTimeMs", "receiveTimeMs"}

    service = env.runtime.service
    latest = service.latest_lag_report  # what a subscriber that joins now starts with
    assert latest is not None
    assert latest["lastTimings"]["sendTimeMs"] >= sends[-1]

    before = await families(env, time.time())
    assert before["changestreamer_lag_seconds"].type == "gauge"

    # The slot's WAL, labelled with the slot this replica streams from.
    slot = env.runtime.slot
    retained = {
        s.labels["slot"]: s.value for s in before["changestreamer_slot_retained_wal_bytes"].samples
    }
    unconfirmed = {
        s.labels["slot"]: s.value
        for s in before["changestreamer_slot_unconfirmed_wal_bytes"].samples
    }
    assert isinstance(retained[slot], int)
    assert retained[slot] >= 0
    assert isinstance(unconfirmed[slot], int)
    assert unconfirmed[slot] >= 0
    assert before["changestreamer_lag_report_retries"].type == "counter"

    # /statz's upstream group names the slot and counts the reports.
    stats = await service.upstream_stats()
    assert stats["slot"] == slot
    assert stats["lagReports"]["sent"] >= 4
    assert stats["lagReports"]["intervalMs"] == 50
    assert stats["lagReports"]["disabled"] is None
    [ours] = [s for s in stats["slots"] if s["name"] == slot]
    assert isinstance(ours["retainedWalBytes"], int)


async def test_the_lag_gauge_moves_on_a_real_clock_between_reports(
    upstream: StartUpstream,
) -> None:
    # One report, then none for a long while: the gauge still rises.
    env = await upstream(SETUP, ZERO_REPLICATION_LAG_REPORT_INTERVAL_MS="600000")
    service = env.runtime.service
    # The stream passes the first report (whether its message came or not).
    await env.execute("INSERT INTO items (v) VALUES ('a')")
    await eventually(
        lambda: "lastTimings" in (service.latest_lag_report or {}), "a lag report", WAIT_S
    )
    # now − the report's upstream commit: it grows by exactly the time that passed.
    now = time.time()
    at_now = lag(await families(env, now))
    later = lag(await families(env, now + 5))
    assert abs(later - at_now - 5) < 1e-6
    # And on the real clock, with no new report.
    first = lag(await families(env, time.time()))

    async def moved() -> bool:
        nonlocal later
        later = lag(await families(env, time.time()))
        return later > first

    await eventually(moved, "the lag gauge to move", WAIT_S)
    assert later > first


async def test_no_reports_at_an_interval_of_zero(upstream: StartUpstream) -> None:
    env = await upstream(SETUP, ZERO_REPLICATION_LAG_REPORT_INTERVAL_MS="0")
    await env.execute("INSERT INTO items (v) VALUES ('a')")
    statuses: list[Any] = []
    while True:  # up to and including the transaction's commit
        text = await asyncio.wait_for(env.subscriber.get(), WAIT_S)
        env.subscriber.ack_next()
        assert isinstance(text, str)  # statuses and small changes
        message = loads(text)
        if message[0] == "status":
            statuses.append(message[1])
        if message[0] == "commit":
            break
    assert not [s for s in statuses if "lagReport" in s]
    service = env.runtime.service
    assert service.latest_lag_report is None
    metrics = await families(env, time.time())
    assert "changestreamer_lag_seconds" not in metrics
    assert "changestreamer_lag_report_retries" not in metrics
    assert "changestreamer_slot_retained_wal_bytes" in metrics  # WAL gauges regardless
    assert (await service.upstream_stats())["lagReports"] is None
