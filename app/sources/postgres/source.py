"""The Postgres change source: a logical replication slot read with pgoutput.

``PostgresChangeSource.start_stream`` takes the slot over (ending whatever backend
holds it), starts replication one byte after the durable watermark's LSN (starting
*at* a commit LSN would send that transaction again, spec/source.md §5.3) and
returns a :class:`PostgresChangeStream`.

The stream has two halves on one socket:

* the reader, the async iterator the service consumes: frames → pgoutput messages
  → change-source messages (``mapper``); keepalives become ``status`` messages (only
  the ones that ask for a reply are forwarded, so their echo comes back after every
  preceding commit is stored);
* the writer, a task that sends standby status updates: the positions
  :class:`~app.sources.postgres.standby.StandbyAcker` allows, and a manual
  keepalive when nothing was sent for 75 % of ``wal_sender_timeout``.

Liveness: no inbound frame for 2 × ``wal_sender_timeout`` (while we are waiting
for one; a slow consumer is back pressure, not silence) ends the stream with an
error, and the service reconnects with backoff.

A change that cannot be mapped (an unsupported schema change, a value that does not
parse) ends replication the reference's way: ``rollback``, then ``control
reset-required`` with the LSN and the reason, then nothing more from this stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import psycopg

from app.protocol.lexi import parse_state_version, to_lexi
from app.protocol.messages import Begin, ChangeSourceMessage, Commit, Control, Rollback, Status
from app.sources.base import (
    BackfillRequest,
    ChangeSource,
    ChangeSourceError,
    ChangeStream,
    SourceMetric,
)
from app.sources.postgres import large_values
from app.sources.postgres.backfill_stream import BackfillNames, stream_backfill
from app.sources.postgres.backfills import BackfillManager
from app.sources.postgres.connection import (
    CHUNK_BYTES,
    FramePieces,
    ReplicationConnection,
    ReplicationStreamEnded,
    StartReplicationError,
)
from app.sources.postgres.conninfo import async_connect
from app.sources.postgres.lag_reporter import LagReporter, PgEmitter, message_prefix
from app.sources.postgres.mapper import ChangeMapper, MappingError, ShardId
from app.sources.postgres.pgoutput import (
    LogicalMessage,
    PgOutputMessage,
    PrimaryKeepalive,
    Relation,
    XLogData,
    decode_chunks,
    decode_message,
    format_lsn,
    parse_copy_data,
    standby_status_update,
)
from app.sources.postgres.shard import ShardConfig
from app.sources.postgres.slots import (
    drop_old_replicas_and_slots,
    record_takeover,
    slot_name_prefix,
)
from app.sources.postgres.standby import StandbyAcker
from app.sources.postgres.stats import SlotWalProbe, upstream_stats
from app.sources.postgres.values import TypeRegistry, load_type_registry
from app.stop_signals import AbortError
from app.timeouts import within

__all__ = ["PostgresChangeSource", "PostgresChangeStream", "PostgresSourceOptions"]

log = logging.getLogger(__name__)

# START_REPLICATION right after ending the slot's previous holder can still see it
# active for a moment (55006); the reference retries 6 times, 10 ms apart.
SLOT_BUSY_RETRIES: Final = 6
SLOT_BUSY_DELAY_S: Final = 0.01
# When wal_sender_timeout is 0 (disabled) we still wake up this often.
DEFAULT_POLL_S: Final = 5.0
# A timer may fire a hair early; a keepalive that is this close to due is sent.
KEEPALIVE_SLACK_S: Final = 0.005
# How long close() waits for the standby writer to end, once woken and once cancelled.
WRITER_STOP_S: Final = 2.0

# An XLogData CopyData frame: b"w", then wal_start, wal_end, send_time (8 bytes
# each), then one pgoutput message.
_XLOG_DATA: Final = 0x77
_XLOG_HEADER_SIZE: Final = 25
_LSN: Final = struct.Struct("!Q")  # an XLogData frame's start LSN, after its 'w'


@dataclass(frozen=True, slots=True)
class PostgresSourceOptions:
    app_id: str
    shard_num: int
    publications: tuple[str, ...]
    slot: str
    ddl_detection: bool = True
    # The published schema at initial sync; compared against relations when DDL
    # detection is off (degraded mode).
    initial_schema: dict[str, Any] | None = None
    # Overrides 2 × wal_sender_timeout as the inbound-silence limit.
    silence_timeout_s: float | None = None
    # The replicas row of the replica being served: older replicas' slots are
    # dropped when a stream starts (after a re-sync they would pin WAL).
    replica_id: str | None = None
    # Who takes the slot over and where its backups go, recorded in that row when a
    # stream starts (``slots.record_takeover``), for the next node that restores.
    task_id: str | None = None
    backup_path: str | None = None


class PostgresChangeSource(ChangeSource):
    upstream_type = "pg"  # /statz upstream group

    def __init__(
        self, upstream_url: str, options: PostgresSourceOptions, *, lag_report_interval_ms: int = 0
    ) -> None:
        """``lag_report_interval_ms`` > 0 sends replication lag reports that often
        (``ZERO_REPLICATION_LAG_REPORT_INTERVAL_MS``, lag_reporter.py); 0 or less: none."""
        self._url = upstream_url
        self._options = options
        self._registry: TypeRegistry | None = None
        self._lag_reporter = (
            LagReporter(
                message_prefix(options.app_id, options.shard_num),
                lag_report_interval_ms,
                PgEmitter(upstream_url),
            )
            if lag_report_interval_ms > 0
            else None
        )
        # The slots' WAL for /metrics, read on scrape (cached, bounded: stats.py).
        self._slot_wal = SlotWalProbe(upstream_url, ShardConfig(options.app_id, options.shard_num))

    async def stats(self) -> dict[str, Any]:
        opts = self._options
        stats = await upstream_stats(self._url, ShardConfig(opts.app_id, opts.shard_num))
        stats["slot"] = opts.slot  # which of ``slots`` this replica streams from
        reporter = self._lag_reporter
        stats["lagReports"] = reporter.stats() if reporter is not None else None
        return stats

    async def metrics(self) -> list[SourceMetric]:
        slots = await self._slot_wal.read()
        out: list[SourceMetric] = []
        if slots is not None:
            out += [
                SourceMetric(
                    "changestreamer_slot_retained_wal_bytes",
                    "gauge",
                    "WAL bytes Postgres keeps for the slot: current LSN minus its restart_lsn.",
                    [
                        ({"slot": s.name}, s.retained_wal_bytes)
                        for s in slots
                        if s.retained_wal_bytes is not None
                    ],
                ),
                SourceMetric(
                    "changestreamer_slot_unconfirmed_wal_bytes",
                    "gauge",
                    "WAL bytes past the slot's confirmed_flush_lsn (not yet acked by its reader).",
                    [
                        ({"slot": s.name}, s.unconfirmed_wal_bytes)
                        for s in slots
                        if s.unconfirmed_wal_bytes is not None
                    ],
                ),
            ]
        if self._lag_reporter is not None:
            out.append(
                SourceMetric(
                    "changestreamer_lag_report_retries_total",
                    "counter",
                    "Lag reports sent again because the previous one did not arrive in time.",
                    [({}, self._lag_reporter.retries)],
                )
            )
        return out

    def start_lag_reporter(self) -> dict[str, Any] | None:
        return None if self._lag_reporter is None else self._lag_reporter.start()

    async def stop(self) -> None:
        if self._lag_reporter is not None:
            await self._lag_reporter.stop()

    async def start_stream(
        self, after_watermark: str, backfill_requests: list[BackfillRequest]
    ) -> ChangeStream:
        opts = self._options
        async with await async_connect(self._url, autocommit=True) as conn:
            registry = self._registry = await load_type_registry(conn)
            wal_sender_timeout_s = await _wal_sender_timeout_s(conn)
            await _take_over_slot(conn, opts.slot)
            if opts.replica_id is not None:
                if opts.task_id is not None:
                    shard = ShardConfig(opts.app_id, opts.shard_num)
                    await record_takeover(
                        conn,
                        shard,
                        opts.replica_id,
                        task_id=opts.task_id,
                        backup_path=opts.backup_path,
                    )
                await _drop_older_replicas(conn, opts)
        start_lsn = parse_state_version(after_watermark).major + 1
        replication = await ReplicationConnection.connect(self._url)
        try:
            reset = await _start(replication, opts.slot, start_lsn, opts.publications)
        except BaseException:
            await replication.close()
            raise
        mapper = ChangeMapper(
            ShardId(opts.app_id, opts.shard_num),
            registry,
            ddl_detection=opts.ddl_detection,
            initial_schema=opts.initial_schema,
        )
        mapper.lag_reports = self._lag_reporter
        shard = ShardConfig(opts.app_id, opts.shard_num)
        names = BackfillNames(slot_name_prefix(shard), f"{opts.app_id}/{opts.shard_num}/backfill")
        backfills = BackfillManager(
            lambda request: stream_backfill(
                self._url, names, opts.publications, request, mapper.registry
            ),
            wake=replication.interrupt,
        )
        stream = PostgresChangeStream(
            replication,
            mapper,
            url=self._url,
            wal_sender_timeout_s=wal_sender_timeout_s,
            silence_timeout_s=opts.silence_timeout_s,
            backfills=backfills,
            after_watermark=after_watermark,
        )
        if reset is not None:
            stream.fail_with_reset(reset, start_lsn)
        else:
            backfills.start(after_watermark, backfill_requests)
        log.info(
            "replicating slot %s from %s (after %s)",
            opts.slot,
            format_lsn(start_lsn),
            after_watermark,
        )
        return stream


class PostgresChangeStream(ChangeStream):
    def __init__(
        self,
        replication: ReplicationConnection,
        mapper: ChangeMapper,
        *,
        url: str,
        wal_sender_timeout_s: float,
        silence_timeout_s: float | None = None,
        backfills: BackfillManager | None = None,
        after_watermark: str = "00",
    ) -> None:
        self._replication = replication
        self._mapper = mapper
        self._backfills = backfills
        # Backfill transactions go between upstream ones, versioned after the last
        # commit streamed (see backfills.py).
        self._in_tx = False
        self._last_commit = after_watermark
        self._url = url
        self._acker = StandbyAcker()
        self._closed = asyncio.Event()
        self._send_wakeup = asyncio.Event()
        self._reset: list[ChangeSourceMessage] | None = None
        if wal_sender_timeout_s > 0:
            self._poll_s = wal_sender_timeout_s * 0.15
            self._keepalive_s: float | None = wal_sender_timeout_s * 0.75
            default_silence: float | None = wal_sender_timeout_s * 2
        else:
            self._poll_s = DEFAULT_POLL_S
            self._keepalive_s = None
            default_silence = None
        self._silence_s = silence_timeout_s if silence_timeout_s is not None else default_silence
        self._writer = asyncio.create_task(self._write_loop(), name="pg-standby-writer")

    # -- ChangeStream ---------------------------------------------------

    def __aiter__(self) -> AsyncIterator[ChangeSourceMessage]:
        return self._read()

    def ack(self, status: list[Any]) -> None:
        watermark = status[2]["watermark"]
        self._acker.on_ack(watermark)
        self._send_wakeup.set()

    async def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._backfills is not None:
            await self._backfills.close()
        # The writer ends on its own once woken: cancelling it alone is not enough
        # on Python 3.11, whose wait_for() swallows a cancel that arrives while the
        # event it waits on has just been set (an ack right before close() did
        # that, and close() then waited forever on a writer still sending
        # keepalives). Closing the connection wakes a writer blocked in a send.
        self._send_wakeup.set()
        await asyncio.wait({self._writer}, timeout=WRITER_STOP_S)
        await self._replication.close()
        if not self._writer.done():
            self._writer.cancel()
            await asyncio.wait({self._writer}, timeout=WRITER_STOP_S)
        if self._writer.done() and not self._writer.cancelled():
            # Retrieve it, so a send that failed on the closing socket is not
            # reported as a never-retrieved task exception.
            self._writer.exception()

    # -- reading --------------------------------------------------------

    def fail_with_reset(self, reason: str, lsn: int) -> None:
        self._reset = _reset_messages(reason, lsn, in_transaction=self._in_tx)

    async def _read(self) -> AsyncIterator[ChangeSourceMessage]:
        if self._reset is not None:
            for m in self._reset:
                yield m
            await self._closed.wait()
            return
        last_inbound = time.monotonic()
        backfills = self._backfills
        while not self._closed.is_set():
            if backfills is not None and not self._in_tx:
                out = backfills.transaction(self._last_commit, self._replication.has_frame())
                if out:
                    self._last_commit = out[-1].watermark  # type: ignore[union-attr]
                    for m in out:
                        yield m
                    del out
                    continue
            frame = await self._replication.read_frame(self._poll_s, pieces_over=CHUNK_BYTES)
            if frame is None:
                if self._writer.done():
                    self._writer.result()  # raises the writer's failure
                silent = time.monotonic() - last_inbound
                if self._silence_s is not None and silent > self._silence_s:
                    raise ChangeSourceError(
                        f"no message from Postgres for {silent:.0f} s "
                        f"(limit {self._silence_s:.0f} s); reconnecting"
                    )
                continue
            last_inbound = time.monotonic()
            # The `del`s: nothing of a frame (one may carry a 100 MB value) stays
            # referenced from here while the next one is awaited.
            if isinstance(frame, FramePieces):
                out = await self._large_frame_messages(frame.chunks)
                del frame
            else:
                if frame[0] == _XLOG_DATA:
                    # Row changes, begins and commits, the bulk of the stream, in one
                    # C call (mapper.map_common), with _account's bookkeeping inline.
                    common = self._mapper.map_common(frame, _XLOG_HEADER_SIZE)
                    if common is not None:
                        del frame
                        if common.kind == "data":
                            if backfills is not None and backfills.running_table is not None:
                                backfills.observe(common)  # a key change can void its batches
                            yield common
                        elif common.kind == "begin":
                            self._on_begin(common)
                            yield common
                        else:
                            self._on_commit(common)
                            yield common
                            passed = self._lag_report_passed(common)
                            if passed is not None:
                                yield passed
                        del common
                        continue
                out = await self._frame_messages(frame)
                del frame
            out.reverse()
            while out:
                yield out.pop()
            if self._resetting():
                await self._swallow()
                return

    async def _frame_messages(self, frame: memoryview) -> list[ChangeSourceMessage]:
        """The messages of one frame other than a row change (in stream order)."""
        copy = parse_copy_data(frame)
        if isinstance(copy, PrimaryKeepalive):
            status = self._on_keepalive(copy)
            return [] if status is None else [status]
        assert isinstance(copy, XLogData)
        return await self._map(copy.wal_start, decode_message(copy.payload))

    def _resetting(self) -> bool:
        return self._reset is not None

    def _on_keepalive(self, k: PrimaryKeepalive) -> Status | None:
        if k.reply_requested:
            # Forwarded: the service echoes it once everything before it is stored.
            return Status({"ack": True}, to_lexi(k.wal_end), True, None)
        if self._backfills is not None:
            self._backfills.on_position(to_lexi(k.wal_end))
        self._acker.on_idle_keepalive(k.wal_end)
        self._send_wakeup.set()
        return None

    async def _large_frame_messages(self, chunks: Sequence[bytes]) -> list[ChangeSourceMessage]:
        """The messages of a frame too large to join (decision 44), decoded from its
        chunks as any frame is, except that a text value over ``LARGE_VALUE_BYTES``
        stays in the chunks until it is made JSON text a chunk at a time."""
        head = chunks[0]
        if head[0] != _XLOG_DATA or len(head) < _XLOG_HEADER_SIZE:
            # Not WAL data (a keepalive is never this large): say what it is.
            return await self._frame_messages(memoryview(b"".join(chunks)))
        (wal_start,) = _LSN.unpack_from(head, 1)
        large_over = large_values.LARGE_VALUE_BYTES
        message = decode_chunks(chunks, _XLOG_HEADER_SIZE, large_over=large_over)
        return await self._map(wal_start, message, large=True)

    async def _map(
        self, wal_start: int, message: PgOutputMessage, *, large: bool = False
    ) -> list[ChangeSourceMessage]:
        """Every decoded message but the C path's row changes (``_read``) comes here,
        from a frame of any size: mapped, then the stream's bookkeeping."""
        try:
            if isinstance(message, Relation) and self._mapper.needs_types(message):
                async with await async_connect(self._url) as conn:
                    self._mapper.registry = await load_type_registry(conn)
            if large:
                message = await self._mapper.materialize(message)
            out = self._mapper.map(message)
        except MappingError as e:
            self._reset = _reset_messages(str(e), wal_start, e.details, in_transaction=self._in_tx)
            log.error("unable to continue replication from %s: %s", format_lsn(wal_start), e)
            return self._reset
        self._account(out)
        backfills = self._backfills
        if (
            backfills is not None
            and isinstance(message, LogicalMessage)
            and not message.transactional
        ):
            # Outside any transaction: the stream is past this LSN (a backfill
            # waiting to complete may go now).
            backfills.on_position(to_lexi(message.lsn))
        last = out[-1] if out else None
        if last is not None and last.kind == "commit":
            passed = self._lag_report_passed(last)
            if passed is not None:
                out.append(passed)
        return out

    def _lag_report_passed(self, commit: Commit) -> Status | None:
        """Past this commit, a lag report before it that never came counts as
        received (lag_reporter.py: messages skipped before Postgres 17)."""
        reporter = self._mapper.lag_reports
        return None if reporter is None else reporter.passed(commit.watermark)

    def _account(self, out: list[ChangeSourceMessage]) -> None:
        """The stream's bookkeeping of mapped messages: the acker's and the
        backfills' transaction boundaries, and every change a backfill must see (a
        key change voids its older batches). The C path of ``_read`` does the same
        for each of its messages."""
        backfills = self._backfills
        for m in out:
            if m.kind == "begin":
                self._on_begin(m)
            elif m.kind == "commit":
                self._on_commit(m)
            elif m.kind == "rollback":
                self._in_tx = False
            elif m.kind == "data" and backfills is not None:
                backfills.observe(m)

    def _on_begin(self, begin: Begin) -> None:
        self._acker.on_begin(begin.commit_watermark, skip_ack=begin.skip_ack)
        self._in_tx = True
        if self._backfills is not None:
            self._backfills.on_begin(begin.commit_watermark)

    def _on_commit(self, commit: Commit) -> None:
        self._in_tx = False
        self._last_commit = commit.watermark
        if self._backfills is not None:
            self._backfills.on_commit(commit.watermark)

    async def _swallow(self) -> None:
        """After reset-required nothing more is sent; keep the socket drained until closed."""
        while not self._closed.is_set():
            try:
                await self._replication.read_frame(DEFAULT_POLL_S)
            except ReplicationStreamEnded:
                await self._closed.wait()
                return

    # -- writing --------------------------------------------------------

    async def _write_loop(self) -> None:
        last_sent = time.monotonic()
        while not self._closed.is_set():
            # Wait until an ack is due or the manual keepalive is; the deadline is
            # absolute, so wakeups for nothing do not push the keepalive back.
            timeout: float | None = None
            if self._keepalive_s is not None:
                timeout = max(0.0, last_sent + self._keepalive_s - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await within(self._send_wakeup.wait(), timeout)
            self._send_wakeup.clear()
            if self._closed.is_set():
                return
            lsn = self._acker.take()
            keepalive_due = (
                self._keepalive_s is not None
                and time.monotonic() >= last_sent + self._keepalive_s - KEEPALIVE_SLACK_S
            )
            if lsn is None and not keepalive_due:
                continue
            # LSN 0 is invalid, so a keepalive moves nothing; it only resets the
            # sender's timeout (spec/source.md §3, step 5).
            frame = standby_status_update(lsn or 0, now_unix_us=time.time_ns() // 1000)
            await self._replication.send_frame(frame)
            last_sent = time.monotonic()


def _reset_messages(
    reason: str, lsn: int, details: dict[str, Any] | None = None, *, in_transaction: bool
) -> list[ChangeSourceMessage]:
    """reset-required, after a rollback of the open transaction if there is one (a
    rollback outside a transaction is a protocol violation to the service, as to
    zero's: a slot that cannot serve at the stream's start has none)."""
    message = f"Unable to continue replication from LSN {format_lsn(lsn)}"
    error_details: dict[str, Any] = {"error": message, **(details or {"reason": reason})}
    body = {"tag": "reset-required", "message": message, "errorDetails": error_details}
    control: list[ChangeSourceMessage] = [Control(body)]
    return [Rollback({"tag": "rollback"}), *control] if in_transaction else control


async def _wal_sender_timeout_s(conn: psycopg.AsyncConnection[Any]) -> float:
    cur = await conn.execute("SELECT setting FROM pg_settings WHERE name = 'wal_sender_timeout'")
    row = await cur.fetchone()
    return int(row[0]) / 1000 if row is not None else 0.0


async def _take_over_slot(conn: psycopg.AsyncConnection[Any], slot: str) -> None:
    """Ends the backend holding the slot (a previous run of ours, or another node)."""
    cur = await conn.execute(
        "SELECT active_pid, pg_terminate_backend(active_pid) "
        "FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    )
    row = await cur.fetchone()
    if row is None:
        # Not worth a retry: the slot is gone for good. The reference stops here too;
        # a restart then finds the replica unservable and re-syncs (ZERO_AUTO_RESET).
        raise AbortError(
            f"replication slot {slot} does not exist; "
            "a different replication-manager may now be running, or the replica must be re-synced"
        )
    if row[0] is not None:
        log.info("ended backend %s that held replication slot %s", row[0], slot)


async def _drop_older_replicas(
    conn: psycopg.AsyncConnection[Any], opts: PostgresSourceOptions
) -> None:
    assert opts.replica_id is not None
    cfg = ShardConfig(app_id=opts.app_id, shard_num=opts.shard_num, publications=())
    try:
        _, active = await drop_old_replicas_and_slots(conn, cfg, opts.replica_id)
    except psycopg.Error as e:
        log.warning("could not drop older replicas' slots: %s", e)
        return
    if active:
        log.warning("%d older replicas' slots are still in use; they are kept for now", active)


async def _start(
    replication: ReplicationConnection, slot: str, start_lsn: int, publications: Sequence[str]
) -> str | None:
    """Starts replication; returns a reason when the slot can never serve us again."""
    for attempt in range(SLOT_BUSY_RETRIES):
        try:
            await replication.start_replication(slot, start_lsn, publications)
            return None
        except StartReplicationError as e:
            if e.sqlstate == "55006" and attempt + 1 < SLOT_BUSY_RETRIES:
                await asyncio.sleep(SLOT_BUSY_DELAY_S)
                continue
            if e.sqlstate == "55000":
                # Object not in prerequisite state: the slot was invalidated.
                return f"replication slot {slot} can no longer be used: {e}"
            raise
    raise AssertionError("unreachable")
