"""Replication lag reports for the Postgres source (spec/source.md §5.6, §1.7).

Every ``interval`` the reporter writes a non-transactional logical message
``{app}/{shard}/lag-report/v1`` = ``{"id", "sendTimeMs", "commitTimeMs"}`` upstream
(``pg_logical_emit_message`` on a normal connection; on Postgres 17 and later
with ``flush``, so an idle server sends it at once). When the message comes back
through the replication stream (``ChangeMapper`` hands it to :meth:`on_message`)
it becomes ``["status", {"ack": false, "lagReport": {"lastTimings": {sendTimeMs,
commitTimeMs, receiveTimeMs}, "nextSendTimeMs"}}, {"watermark": lexi(messageLsn)}]``:
the round trip upstream → WAL → walsender → us, measured in band.

The schedule follows zero-cache's ``LagReporter``:

* the next report goes out ``interval`` after the *send* time of the one just
  received (at once if that is already past);
* a report still missing one interval after it was sent is sent again (a new id;
  ``retries`` counts them);
* before Postgres 17 an emitted message can sit past the walsender's flush
  position while the stream moves on; once the stream passes the report's LSN
  (:meth:`passed`, called at every commit the stream delivers) the report counts
  as received;
* ``42501`` (no EXECUTE on ``pg_logical_emit_message``) logs the GRANT that fixes
  it, once, and ends reporting; any other failure is retried an interval later.

Only the report we are waiting for schedules the next one. Other reports (ones
re-streamed from before a restart, another replication-manager's) still become
statuses, but only if their ``commitTimeMs`` is not below the newest one seen
(spec/core.md §2.3: "lag reports older than the newest seen are ignored"); the
first report this process sends is that mark until one arrives, so history from
an older watermark never makes the lag look smaller than it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final, Protocol

import psycopg

from app.protocol.lexi import parse_state_version, to_lexi
from app.protocol.messages import Status
from app.sources.postgres.conninfo import async_connect
from app.sources.postgres.pgoutput import format_lsn, parse_lsn
from app.timeouts import within

__all__ = [
    "EMIT_TIMEOUT_S",
    "MESSAGE_SUFFIX",
    "Emitter",
    "LagReporter",
    "PgEmitter",
    "grant_hint",
    "message_prefix",
]

log = logging.getLogger(__name__)

MESSAGE_SUFFIX: Final = "/lag-report/v1"
PG_17: Final = 170000
# One emit (connect included) may take this long; a stuck upstream then counts as a
# failed report (retried an interval later) instead of a hung timer.
EMIT_TIMEOUT_S: Final = 10.0
APPLICATION_NAME: Final = "changestreamer-lag-reporter"
_INSUFFICIENT_PRIVILEGE: Final = "42501"


def message_prefix(app_id: str, shard_num: int) -> str:
    """The logical message prefix of the shard's lag reports."""
    return f"{app_id}/{shard_num}{MESSAGE_SUFFIX}"


def grant_hint(server_version: int | None) -> str:
    """The statement that lets a database user send lag reports."""
    signature = (
        "boolean, text, text, boolean" if (server_version or 0) >= PG_17 else "boolean, text, text"
    )
    return f"GRANT EXECUTE ON FUNCTION pg_logical_emit_message({signature}) TO <your_db_user>;"


class Emitter(Protocol):
    """Writes one report upstream; returns (the message's LSN, the upstream commit time ms)."""

    def __call__(
        self, prefix: str, report_id: str, send_time_ms: int
    ) -> Awaitable[tuple[int, float]]: ...

    @property
    def server_version(self) -> int | None: ...

    async def close(self) -> None: ...


class PgEmitter:
    """``pg_logical_emit_message`` on one normal connection, opened on first use and
    again after any failure (a broken connection is never reused)."""

    def __init__(self, url: str, *, timeout_s: float = EMIT_TIMEOUT_S) -> None:
        self._url = url
        self._timeout_s = timeout_s
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._version: int | None = None

    @property
    def server_version(self) -> int | None:
        return self._version

    async def __call__(self, prefix: str, report_id: str, send_time_ms: int) -> tuple[int, float]:
        try:
            return await within(self._emit(prefix, report_id, send_time_ms), self._timeout_s)
        except BaseException:
            await self.close()
            raise

    async def _emit(self, prefix: str, report_id: str, send_time_ms: int) -> tuple[int, float]:
        if self._conn is None or self._conn.closed:
            self._conn = await async_connect(
                self._url,
                autocommit=True,
                connect_timeout=max(1, int(self._timeout_s)),
                application_name=APPLICATION_NAME,
                options=f"-c statement_timeout={int(self._timeout_s * 1000)}",
            )
            self._version = self._conn.info.server_version
        # The 4th argument (flush) exists from Postgres 17 on; without it an idle
        # server's walsender sees the message only at the next WAL flush (50–100 ms).
        flush = ", true" if (self._version or 0) >= PG_17 else ""
        # commitTimeMs is the upstream clock (now() of this statement's transaction),
        # a fractional number of ms as zero-cache sends it.
        query = (
            "WITH t AS (SELECT extract(epoch FROM now()) * 1000 AS ms) "
            "SELECT t.ms::float8, pg_logical_emit_message(false, %s, json_build_object("
            "'id', %s::text, 'sendTimeMs', %s::int8, 'commitTimeMs', t.ms)::text"
            f"{flush})::text FROM t"
        )
        cur = await self._conn.execute(query.encode(), (prefix, report_id, send_time_ms))
        row = await cur.fetchone()
        assert row is not None
        return parse_lsn(row[1]), float(row[0])

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


@dataclass(slots=True)
class _Report:
    id: str
    send_ms: int
    commit_ms: float
    lsn: int = 0  # known once the emit returned


class LagReporter:
    def __init__(
        self,
        prefix: str,
        interval_ms: int,
        emit: Emitter,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_ms <= 0:
            raise ValueError(f"lag report interval must be positive, got {interval_ms} ms")
        self.prefix = prefix
        self.interval_ms = interval_ms
        self._emit = emit
        self._clock = clock
        self._expecting: _Report | None = None
        # Reports with a lower commit time are history (see the module docstring).
        self._high_water_ms: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False
        self._stopped = False
        self.disabled: str | None = None  # why reporting ended, once it did
        self.sent = 0
        self.received = 0
        self.retries = 0
        self.ignored = 0

    # -- life cycle -------------------------------------------------------

    def start(self) -> dict[str, Any] | None:
        """Sends the first report now (in the background); returns ``{"nextSendTimeMs"}``
        for the service's initial status. A second call returns None."""
        if self._started or self._stopped:
            return None
        self._started = True
        now = self._now_ms()
        log.info("replication lag reports every %d ms (%s)", self.interval_ms, self.prefix)
        self._schedule(0, self._initiate)
        return {"nextSendTimeMs": now}

    async def stop(self) -> None:
        """Ends reporting and closes the connection; safe to call more than once."""
        self._stopped = True
        self._cancel_timer()
        tasks, self._tasks = self._tasks, set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._emit.close()

    def stats(self) -> dict[str, Any]:
        """What ``/statz`` shows of the reporter."""
        return {
            "intervalMs": self.interval_ms,
            "sent": self.sent,
            "received": self.received,
            "retries": self.retries,
            "ignored": self.ignored,
            "disabled": self.disabled,
        }

    # -- the stream's side --------------------------------------------------

    def on_message(self, content: bytes, message_lsn: int) -> Status | None:
        """A lag-report message from the stream → its status, or None (ignored)."""
        try:
            body = json.loads(content)
            report = _Report(str(body["id"]), body["sendTimeMs"], body["commitTimeMs"])
            if not all(_is_number(v) for v in (report.send_ms, report.commit_ms)):
                raise ValueError("sendTimeMs and commitTimeMs must be numbers")
        except (ValueError, TypeError, KeyError) as e:
            # Not worth a reset: the report is only a measurement.
            log.warning("ignoring an unreadable lag report at %s: %s", format_lsn(message_lsn), e)
            return None
        return self._process(report, to_lexi(message_lsn))

    def passed(self, commit_watermark: str) -> Status | None:
        """The stream delivered the commit at ``commit_watermark``: if that is past the
        report we wait for, the report was skipped (Postgres < 17, see the module
        docstring) and counts as received, with the commit's watermark as its own
        (a status right after a commit at the same watermark keeps them monotonic)."""
        expected = self._expecting
        if expected is None or not expected.lsn:
            return None
        lsn = parse_state_version(commit_watermark).major
        if lsn <= expected.lsn:
            return None
        log.info(
            "the stream is past the expected lag report at %s (a commit at %s); "
            "counting it as received",
            format_lsn(expected.lsn),
            format_lsn(lsn),
        )
        return self._process(expected, commit_watermark)

    def _process(self, report: _Report, watermark: str) -> Status | None:
        now = self._now_ms()
        expected = self._expecting
        if expected is not None and report.id == expected.id:
            next_send = max(now, report.send_ms + self.interval_ms)
            self._expecting = None
            self._schedule((next_send - now) / 1000, self._initiate)
        else:
            # Someone else's or an old report: it schedules nothing.
            next_send = (
                expected.send_ms
                if expected is not None
                else max(now, report.send_ms + self.interval_ms)
            )
            if self._high_water_ms is None or report.commit_ms < self._high_water_ms:
                self.ignored += 1
                log.debug("ignoring lag report %s (older than the newest)", report.id)
                return None
        self._high_water_ms = max(self._high_water_ms or report.commit_ms, report.commit_ms)
        self.received += 1
        lag_report = {
            "lastTimings": {
                "sendTimeMs": report.send_ms,
                "commitTimeMs": report.commit_ms,
                "receiveTimeMs": now,
            },
            "nextSendTimeMs": next_send,
        }
        return Status({"ack": False, "lagReport": lag_report}, watermark, False, lag_report)

    # -- sending ------------------------------------------------------------

    async def _initiate(self) -> None:
        if self._stopped or self.disabled is not None:
            return
        now = self._now_ms()
        report = _Report(uuid.uuid4().hex, now, now)
        # Set before the emit: the report may come back before the emit returns.
        self._expecting = report
        try:
            report.lsn, report.commit_ms = await self._emit(self.prefix, report.id, now)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if self._expecting is report:
                self._expecting = None
            if getattr(e, "sqlstate", None) == _INSUFFICIENT_PRIVILEGE:
                self._disable(e)
                return
            log.warning(
                "could not send a replication lag report (retrying in %d ms): %s",
                self.interval_ms,
                e,
            )
            self._schedule(self.interval_ms / 1000, self._initiate)
            return
        self.sent += 1
        if self._high_water_ms is None:
            self._high_water_ms = report.commit_ms
        if self._expecting is report:
            self._schedule(self.interval_ms / 1000, lambda: self._retry(report.id))

    async def _retry(self, report_id: str) -> None:
        missing = self._expecting
        if missing is None or missing.id != report_id:
            return
        self.retries += 1
        log.warning(
            "lag report %s (sent at LSN %s) did not arrive within %d ms; sending another",
            missing.id,
            format_lsn(missing.lsn),
            self.interval_ms,
        )
        await self._initiate()

    def _disable(self, error: Exception) -> None:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        self.disabled = f"insufficient privilege: {reason}"
        self._cancel_timer()
        log.warning(
            "replication lag reports are off: the database user may not call "
            "pg_logical_emit_message (%s). To enable them, run: %s",
            reason,
            grant_hint(self._emit.server_version),
        )

    # -- timers -------------------------------------------------------------

    def _schedule(self, delay_s: float, job: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Runs ``job`` after ``delay_s``, replacing whatever was scheduled."""
        self._cancel_timer()
        if self._stopped:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(0.0, delay_s), self._run, job)

    def _run(self, job: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._timer = None
        task = asyncio.get_running_loop().create_task(job(), name="lag-report")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("lag reporter failed: %r", task.exception())

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
