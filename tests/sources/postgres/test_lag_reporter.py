"""Replication lag reports (spec/source.md §5.6) and the slots' WAL gauges.

Against the real server where it matters: the report is written with
``pg_logical_emit_message`` and read back through a real replication stream of a
scratch database (``db_url``), and the WAL is inspected with an idle second slot
(``pg_logical_slot_peek_binary_changes``). The schedule's corner cases (retry,
the stream passing a skipped report) use a scripted emitter. Every wait is on a
condition, bounded; nothing asserts on timing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from app.protocol.lexi import lsn_to_watermark, to_lexi
from app.protocol.messages import ChangeSourceMessage, Commit, Status
from app.sources.base import ChangeStream
from app.sources.postgres.lag_reporter import LagReporter, PgEmitter, grant_hint, message_prefix
from app.sources.postgres.mapper import ChangeMapper, ShardId
from app.sources.postgres.pgoutput import LogicalMessage, parse_lsn
from app.sources.postgres.shard import ShardConfig
from app.sources.postgres.source import PostgresChangeSource, PostgresSourceOptions
from app.sources.postgres.stats import SlotWalProbe
from app.sources.postgres.values import TypeRegistry
from tests import waiting

PUB = "cs_lag_pub"
PREFIX = "zero/0/lag-report/v1"
WAIT_S = 20.0


async def eventually(check: Callable[[], bool], what: str) -> None:
    await waiting.eventually(check, what, WAIT_S)


@dataclass
class Upstream:
    url: str
    slot: str
    start: str  # the slot's consistent point, as a watermark


@pytest.fixture
async def up(db_url: str) -> Upstream:
    slot = f"cs_lag_{uuid.uuid4().hex[:10]}"
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        await c.execute("CREATE TABLE items (id serial PRIMARY KEY, v text)")
        await c.execute(f"CREATE PUBLICATION {PUB} FOR TABLE items")
        cur = await c.execute(
            "SELECT lsn FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,)
        )
        row = await cur.fetchone()
        assert row is not None
    # The scratch database's teardown drops its slots.
    return Upstream(db_url, slot, lsn_to_watermark(str(row[0])))


def source_for(up: Upstream, interval_ms: int, app_id: str = "zero") -> PostgresChangeSource:
    options = PostgresSourceOptions(app_id=app_id, shard_num=0, publications=(PUB,), slot=up.slot)
    return PostgresChangeSource(up.url, options, lag_report_interval_ms=interval_ms)


async def execute(url: str, *statements: str, params: tuple[Any, ...] = ()) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
        for s in statements:
            await c.execute(s.encode(), params or None)


async def insert_marker(url: str) -> None:
    await execute(url, "INSERT INTO items (v) VALUES ('marker')")


async def peek_slot(url: str) -> str:
    """An idle second slot: what the WAL holds from now on, read without consuming it."""
    name = f"cs_lag_peek_{uuid.uuid4().hex[:8]}"
    await execute(url, "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", params=(name,))
    return name


async def peeked_wal(url: str, slot: str) -> bytes:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
        cur = await c.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
            "'proto_version', '1', 'publication_names', %s, 'messages', 'true')",
            (slot, PUB),
        )
        return b"".join(bytes(r[0]) for r in await cur.fetchall())


async def emit(url: str, report: dict[str, Any]) -> None:
    """A lag report written by someone else (another node, or history)."""
    await execute(
        url,
        "SELECT pg_logical_emit_message(false, %s, %s)",
        params=(PREFIX, json.dumps(report)),
    )


async def messages(
    stream: ChangeStream, timeout_s: float = WAIT_S
) -> AsyncIterator[ChangeSourceMessage]:
    """The stream's messages, failing if they stop coming for ``timeout_s``. One per
    stream: each ``aiter(stream)`` is a reader of its own."""
    it = aiter(stream)
    while True:
        yield await asyncio.wait_for(anext(it), timeout_s)


def lag(m: ChangeSourceMessage) -> dict[str, Any] | None:
    return m.lag_report if isinstance(m, Status) else None


async def until_commit(it: AsyncIterator[ChangeSourceMessage]) -> list[ChangeSourceMessage]:
    """Messages up to and including the next commit."""
    out: list[ChangeSourceMessage] = []
    async for m in it:
        out.append(m)
        if isinstance(m, Commit):
            return out
    raise AssertionError("unreachable")


# -- the real round trip ----------------------------------------------------------------


async def test_reports_come_back_in_band_and_keep_coming_under_load(up: Upstream) -> None:
    peek = await peek_slot(up.url)
    source = source_for(up, interval_ms=50)
    stream = await source.start_stream(up.start, [])
    stop = asyncio.Event()

    async def write() -> None:
        async with await psycopg.AsyncConnection.connect(up.url, autocommit=True) as c:
            while not stop.is_set():
                await c.execute("INSERT INTO items (v) VALUES ('load')")

    writer = asyncio.create_task(write())
    try:
        first = source.start_lag_reporter()
        assert first is not None
        assert set(first) == {"nextSendTimeMs"}
        assert source.start_lag_reporter() is None  # once
        reports: list[Status] = []
        commits_between = 0
        watermarks: list[str] = []
        async for m in messages(stream):
            if isinstance(m, Commit | Status):
                watermarks.append(m.watermark)
            if isinstance(m, Commit) and reports:
                commits_between += 1
            if isinstance(m, Status) and m.lag_report is not None:
                reports.append(m)
            if len(reports) >= 5 and commits_between >= 20:
                break
    finally:
        stop.set()
        await writer
        await stream.close()
        await source.stop()

    # Statuses and commits together never go back (spec/source.md §1.7).
    assert watermarks == sorted(watermarks)
    sends = []
    for status in reports:
        assert status.ack is False
        assert list(status.body) == ["ack", "lagReport"]
        report: dict[str, Any] = status.body["lagReport"]
        assert status.lag_report is report
        timings = report["lastTimings"]
        assert list(timings) == ["sendTimeMs", "commitTimeMs", "receiveTimeMs"]
        assert all(isinstance(v, int | float) for v in timings.values())
        # Stamped on our clock either side of the upstream commit (same host here).
        assert timings["sendTimeMs"] <= timings["receiveTimeMs"]
        assert report["nextSendTimeMs"] >= timings["sendTimeMs"] + 50
        sends.append(timings["sendTimeMs"])
    assert sends == sorted(sends)
    assert len(set(sends)) == len(sends)
    # The messages really went through the WAL, with the shard's prefix.
    assert PREFIX.encode() in await peeked_wal(up.url, peek)


@pytest.mark.parametrize("interval_ms", [0, -5])
async def test_no_reports_when_the_interval_is_zero_or_less(up: Upstream, interval_ms: int) -> None:
    peek = await peek_slot(up.url)
    source = source_for(up, interval_ms=interval_ms)
    assert source.start_lag_reporter() is None
    assert await source.metrics() is not None  # no retries counter without a reporter
    assert "changestreamer_lag_report_retries_total" not in {m.name for m in await source.metrics()}
    stream = await source.start_stream(up.start, [])
    try:
        await insert_marker(up.url)
        seen = await until_commit(messages(stream))
    finally:
        await stream.close()
        await source.stop()
    assert not [m for m in seen if lag(m) is not None]
    wal = await peeked_wal(up.url, peek)
    assert b"marker" in wal  # the peek sees the stream's transaction …
    assert b"lag-report" not in wal  # … and no report was ever written


async def test_reports_older_than_the_newest_become_no_status(up: Upstream) -> None:
    # A long interval: only this process's first report and the ones written here.
    source = source_for(up, interval_ms=600_000)
    reporter = source._lag_reporter
    assert reporter is not None
    stream = await source.start_stream(up.start, [])
    try:
        source.start_lag_reporter()
        await eventually(lambda: reporter.sent == 1, "the first report to be sent")
        newest = reporter._high_water_ms  # its upstream commit time
        assert newest is not None
        # History (re-streamed from before a restart) and a newer report of another node.
        await emit(up.url, {"id": "old", "sendTimeMs": 1, "commitTimeMs": 2})
        await emit(up.url, {"id": "other", "sendTimeMs": 7, "commitTimeMs": newest + 1})
        await insert_marker(up.url)
        # The first report arrives before the others, or (Postgres < 17 skipped its
        # message at the session's start) counts as received after the marker's commit.
        seen = []
        async for m in messages(stream):
            if (r := lag(m)) is not None:
                seen.append(r)
            if len(seen) == 2:
                break
    finally:
        await stream.close()
        await source.stop()
    sends = {r["lastTimings"]["sendTimeMs"] for r in seen}
    assert 1 not in sends  # the old one became no status
    assert 7 in sends
    assert len(sends) == 2
    assert reporter.ignored == 1
    assert reporter.sent == 1  # the other node's report scheduled nothing


async def test_the_stream_passing_a_missing_reports_lsn_counts_it_as_received(
    up: Upstream,
) -> None:
    # What Postgres < 17 can do: the report's LSN is known, its message never comes.
    emitter = ScriptedEmitter(lsn_from=up.url)
    source = source_for(up, interval_ms=600_000)
    reporter = LagReporter(PREFIX, 600_000, emitter)
    source._lag_reporter = reporter
    stream = await source.start_stream(up.start, [])
    try:
        reporter.start()
        await eventually(lambda: reporter.sent == 1, "the scripted report to be sent")
        await insert_marker(up.url)
        it = messages(stream)
        seen = await until_commit(it)
        status = await anext(it)
    finally:
        await stream.close()
        await reporter.stop()
    commit = seen[-1]
    assert isinstance(commit, Commit)
    assert isinstance(status, Status)
    assert status.lag_report is not None
    assert status.lag_report["lastTimings"]["sendTimeMs"] == emitter.calls[0][1]
    assert status.watermark == commit.watermark  # right after it, at its watermark
    assert reporter.received == 1


async def test_without_execute_privilege_the_grant_is_logged_once_and_reports_stop(
    up: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    role = f"cs_lag_{uuid.uuid4().hex[:8]}"
    await execute(
        up.url,
        # Per database: dropped with the scratch database.
        "REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) FROM PUBLIC",
        f"CREATE ROLE {role} LOGIN",
    )
    url = psycopg.conninfo.make_conninfo(up.url, user=role)
    reporter = LagReporter(PREFIX, 20, PgEmitter(url))
    try:
        with caplog.at_level(logging.WARNING, logger="app.sources.postgres.lag_reporter"):
            assert reporter.start() is not None
            await eventually(lambda: reporter.disabled is not None, "reports to be disabled")
        assert reporter._timer is None  # nothing more is scheduled
        assert reporter.sent == 0
        hints = [r for r in caplog.records if "GRANT EXECUTE" in r.getMessage()]
        assert len(hints) == 1
        assert grant_hint(150000) in hints[0].getMessage()
        assert grant_hint(150000) == (
            "GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) "
            "TO <your_db_user>;"
        )
        assert "boolean, text, text, boolean" in grant_hint(170000)
    finally:
        await reporter.stop()
        await execute(up.url, f"DROP ROLE {role}")


# -- the schedule, with a scripted emitter ----------------------------------------------


@dataclass
class ScriptedEmitter:
    """Records each emit; returns the server's current LSN (``lsn_from``) or a counter."""

    lsn_from: str | None = None
    calls: list[tuple[str, int]] = field(default_factory=list)
    closed: bool = False

    @property
    def server_version(self) -> int | None:
        return 150000

    async def __call__(self, prefix: str, report_id: str, send_time_ms: int) -> tuple[int, float]:
        self.calls.append((report_id, send_time_ms))
        lsn = 1000 * len(self.calls)
        if self.lsn_from is not None:
            async with await psycopg.AsyncConnection.connect(self.lsn_from) as c:
                cur = await c.execute("SELECT pg_current_wal_lsn()::text")
                row = await cur.fetchone()
                assert row is not None
                lsn = parse_lsn(row[0])
        return lsn, float(send_time_ms)

    async def close(self) -> None:
        self.closed = True


async def test_a_report_still_missing_after_an_interval_is_sent_again() -> None:
    emitter = ScriptedEmitter()
    reporter = LagReporter(PREFIX, 20, emitter)
    reporter.start()
    try:
        await eventually(lambda: len(emitter.calls) >= 3, "two retries")
    finally:
        await reporter.stop()
    assert reporter.retries >= 2
    assert len({report_id for report_id, _ in emitter.calls}) == len(emitter.calls)  # new ids
    assert emitter.closed


async def test_the_received_report_schedules_the_next_one() -> None:
    emitter = ScriptedEmitter()
    reporter = LagReporter(PREFIX, 20, emitter)
    reporter.start()
    try:
        await eventually(lambda: reporter.sent == 1, "the first report")
        report_id, sent = emitter.calls[0]
        content = json.dumps({"id": report_id, "sendTimeMs": sent, "commitTimeMs": sent + 1})
        status = reporter.on_message(content.encode(), 5000)
        assert status is not None
        assert status.watermark == to_lexi(5000)
        assert status.lag_report is not None
        assert status.lag_report["nextSendTimeMs"] >= sent + 20
        await eventually(lambda: len(emitter.calls) == 2, "the next report")
    finally:
        await reporter.stop()
    assert reporter.retries == 0
    assert reporter.received == 1


def test_a_stream_passing_no_further_than_the_report_counts_nothing() -> None:
    reporter = LagReporter(PREFIX, 1000, ScriptedEmitter())
    assert reporter.passed(to_lexi(10)) is None  # nothing expected


def test_the_mapper_hands_lag_reports_to_the_reporter_and_ignores_them_without_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mapper = ChangeMapper(ShardId("zero", 0), TypeRegistry())
    report = LogicalMessage(False, 4096, PREFIX, b'{"id":"x","sendTimeMs":1,"commitTimeMs":2}')
    assert mapper.map(report) == []  # no reporter: another node's reports are ignored
    mapper.lag_reports = LagReporter(PREFIX, 1000, ScriptedEmitter())
    mapper.lag_reports._high_water_ms = 0  # as after this process's first report
    [status] = mapper.map(report)
    assert isinstance(status, Status)
    assert status.watermark == to_lexi(4096)
    # A report that cannot be read is dropped with a warning, never a reset.
    with caplog.at_level(logging.WARNING):
        assert mapper.map(LogicalMessage(False, 4097, PREFIX, b"{not json")) == []
    assert "unreadable lag report" in caplog.text
    assert message_prefix("zero", 0) == PREFIX


# -- the slots' WAL ---------------------------------------------------------------------


async def test_the_slots_wal_is_read_on_scrape_cached_and_bounded(db_url: str) -> None:
    app = f"lagt{uuid.uuid4().hex[:6]}"
    slot = f"{app}_0_a"
    await execute(
        db_url, "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", params=(slot,)
    )
    await execute(
        db_url, "CREATE TABLE t (id int)", "INSERT INTO t SELECT generate_series(1, 1000)"
    )
    now = [0.0]
    probe = SlotWalProbe(db_url, ShardConfig(app, 0), ttl_s=5, clock=lambda: now[0])
    slots = await probe.read()
    assert slots is not None
    [wal] = slots
    assert wal.name == slot
    assert isinstance(wal.retained_wal_bytes, int)
    assert wal.retained_wal_bytes > 0
    assert isinstance(wal.unconfirmed_wal_bytes, int)
    assert wal.unconfirmed_wal_bytes > 0
    # A scrape storm: one query per TTL, concurrent scrapes share it.
    results = await asyncio.gather(*(probe.read() for _ in range(20)))
    assert all(r is slots for r in results)
    assert probe.queries == 1
    now[0] += 5
    assert await probe.read() is not slots
    assert probe.queries == 2

    # The source's metrics: one gauge per slot of the shard, labelled with its name.
    source = PostgresChangeSource(
        db_url,
        PostgresSourceOptions(app_id=app, shard_num=0, publications=(), slot=slot),
        lag_report_interval_ms=1000,
    )
    metrics = {m.name: m for m in await source.metrics()}
    assert metrics["changestreamer_slot_retained_wal_bytes"].type == "gauge"
    [(labels, value)] = metrics["changestreamer_slot_retained_wal_bytes"].samples
    assert labels == {"slot": slot}
    assert value > 0
    [(labels, value)] = metrics["changestreamer_slot_unconfirmed_wal_bytes"].samples
    assert labels == {"slot": slot}
    assert value > 0
    assert metrics["changestreamer_lag_report_retries_total"].samples == [({}, 0)]
    await source.stop()


async def test_an_unreachable_upstream_leaves_the_wal_gauges_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    probe = SlotWalProbe("postgresql://nobody@127.0.0.1:1/none", ShardConfig("x", 0), timeout_s=2)
    with caplog.at_level(logging.WARNING):
        assert await probe.read() is None
        assert await probe.read() is None  # the failure is cached too
    assert probe.queries == 1
    assert "reading the replication slots' WAL failed" in caplog.text
