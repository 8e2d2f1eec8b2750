"""The storer: writes the change stream to the change log with group commit,
and catches subscribers up from it.

The main loop hands every batch of begin/data/commit/rollback changes to
``append`` (synchronous) right after it forwards the same batch, before any
await. ``append``
builds each upstream transaction's rows as they arrive and queues the
transaction whole at its commit, so the consumer works a transaction at a time,
not a message at a time (on the main loop both are per-change costs). A single
consumer task writes them:

* **Group commit.** Whatever is queued when the consumer looks is written in one
  database transaction, as many upstream transactions as are complete, together
  with ``lastWatermark`` and the backfill bookkeeping of schema changes. Only
  whole upstream transactions are ever committed: the rows of the open one stay
  in memory, or — past ``open_tx_flush_bytes`` — are written into a database
  transaction that holds nothing else and commits only with their commit, so a
  rollback or a broken stream can drop them with a plain ``ROLLBACK``.
* **Durability events.** After each commit ``durable`` moves to the last commit
  watermark written, waiters wake, and the acker hears of it: upstream is acked
  only for what is durable.
* **Back pressure.** ``ready_for_more`` arms a gate once the queued JSON exceeds
  the byte budget; it opens at 80 %. A watchdog fails the gate if no change is
  processed for ``statement_timeout_s`` (the log is wedged: stop, don't hang).

Catch-up (spec/core.md §3.3, ARCHITECTURE decision 2). ``catchup`` is called in
the same synchronous step as ``Forwarder.add``. At that point the last commit
*enqueued* is exactly the boundary between what the subscriber must read from
the log and what reaches it live, so that watermark is its upper bound; the
catch-up task waits until the bound is durable, then reads ``[S, bound]`` in
batches. A subscriber that joins mid-transaction is parked until the
transaction ends — by commit, rollback *or abort* (the reference leaves it hanging
on abort, spec/core.md §8 B1) — and its bound includes the commit if there was
one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from functools import partial

from app.progress import Job, ProgressView
from app.protocol.canonical_json import loads
from app.protocol.changes import SCHEMA_CHANGE_TAGS
from app.protocol.codec import change_tag, data_change, extract_change, reconstruct
from app.protocol.errors import ErrorType
from app.protocol.lexi import watermark_fraction
from app.protocol.pieces import LARGE_TEXT_CHARS
from app.stop_signals import AbortError, AutoResetSignal
from app.storage import ChangeLog, Replication, StoredRow
from app.storage.backfill import BookkeepingOp, bookkeeping_for
from app.storage.changelog import WriteTransaction
from app.streamer.histogram import CATCHUP_BOUNDS_S, GROUP_ROWS_BOUNDS, Histogram
from app.streamer.subscriber import Change, Mode, Subscriber, new_change
from app.streamer.tail import DEFAULT_TAIL_BYTES, LogTail
from app.streamer.timers import TimerHandle, Timers
from app.timeouts import within

log = logging.getLogger(__name__)

CATCHUP_BATCH = 2000
# A catch-up's first read; each next one doubles up to CATCHUP_BATCH. Under churn
# (subscribers that reconnect and leave again) a full first batch was decoded for
# every one of them: 40 % of the event loop in bench.churn. The first two batches
# are also what a client that never reads holds (one sent, one read), so a flood
# of them costs little (docs/reliability.md, "Churn and floods").
CATCHUP_FIRST_BATCH = 8
# Catch-ups reading a batch of the log at the same time (the rest queue for a turn).
MAX_CONCURRENT_CATCHUPS = 4
DEFAULT_BACK_PRESSURE_BYTES = 64 * 1024 * 1024
# A group commit stops taking transactions once it holds this many rows (whole
# transactions only): large enough that one commit (one fsync) serves many small ones.
DEFAULT_GROUP_MAX_ROWS = 10_000
LOW_WATER_FRACTION = 0.8


class WedgedError(AbortError):
    """No change was processed within the statement timeout while upstream waited."""


class StorerStopped(Exception):
    """The storer stopped before a subscriber's catch-up bound became durable."""


@dataclass(slots=True)
class _OpenTx:
    """An upstream transaction: built by ``store``, queued whole at its commit."""

    watermark: str
    skip_ack: bool
    rows: list[StoredRow] = field(default_factory=list)
    ops: list[BookkeepingOp] = field(default_factory=list)
    pos: int = 0
    bytes: int = 0  # JSON of ``rows``: counted against the byte budget until written
    chunked: bool = False  # earlier rows were queued ahead as _Chunks


@dataclass(slots=True)
class _Chunk:
    """Rows of a big transaction queued ahead of its commit (past
    ``open_tx_flush_bytes``); they go into a database transaction of its own."""

    rows: list[StoredRow]
    bytes: int


_SCHEMA_TAGS = frozenset(SCHEMA_CHANGE_TAGS)
_PLAIN_BEGIN = '{"tag":"begin"}'

_DROP = object()  # a chunked transaction ended without commit: roll its rows back
_STOP = object()
_Item = _OpenTx | _Chunk | object


@dataclass(slots=True)
class _Catchup:
    sub: Subscriber
    mode: Mode
    started: float  # when it was asked for (Timers.monotonic)
    task: asyncio.Task[None] | None = None
    job: Job | None = None  # its progress, once the read is under way


class Storer:
    def __init__(
        self,
        *,
        change_log: ChangeLog,
        replication: Replication,
        owner: str,
        replica_version: str,
        durable_watermark: str,
        timers: Timers,
        on_durable: Callable[[str], None] = lambda _w: None,
        on_fatal: Callable[[BaseException], None] = lambda _e: None,
        back_pressure_bytes: int = DEFAULT_BACK_PRESSURE_BYTES,
        statement_timeout_s: float = 20.0,
        group_max_rows: int = DEFAULT_GROUP_MAX_ROWS,
        open_tx_flush_bytes: int = 8 * 1024 * 1024,
        catchup_batch: int = CATCHUP_BATCH,
        max_concurrent_catchups: int = MAX_CONCURRENT_CATCHUPS,
        hold_catchups_until_owned: bool = False,
        tail_bytes: int = DEFAULT_TAIL_BYTES,
    ) -> None:
        self._log = change_log
        self._replication = replication
        self._owner = owner
        self._replica_version = replica_version
        self._timers = timers
        self._on_durable = on_durable
        self._on_fatal = on_fatal
        self._budget = back_pressure_bytes
        self._statement_timeout_s = statement_timeout_s
        self._group_max_rows = group_max_rows
        self._open_tx_flush_bytes = open_tx_flush_bytes
        self._catchup_batch = catchup_batch
        # Catch-ups that last a few seconds show their progress (a bar on a terminal,
        # log lines otherwise); started with the first catch-up.
        self.progress = ProgressView()

        # Enqueue side (the main loop, synchronous).
        # A deque and an event instead of asyncio.Queue: this is on the per-change
        # hot path, and the queue's bound is the byte budget (ready_for_more).
        self._queue: deque[_Item] = deque()
        self._queue_ready = asyncio.Event()
        self._queued_bytes = 0
        self._building: _OpenTx | None = None
        self._enqueued_in_tx = False
        self._last_enqueued_commit = durable_watermark
        self._parked: list[_Catchup] = []
        # Catch-ups wait for ``owned`` (a takeover may still be moving the log's end).
        self._until_owned = hold_catchups_until_owned
        self._gate: asyncio.Future[None] | None = None
        self._watchdog: TimerHandle | None = None

        # Consumer side.
        self.durable = durable_watermark
        # Catch-ups waiting for their bound to become durable: (watermark, future).
        self._durable_waiters: list[tuple[str, asyncio.Future[None]]] = []
        self._running = False
        self._stopped = asyncio.Event()
        self._catchups: set[asyncio.Task[None]] = set()
        # Catch-ups reading a batch of the log at once; the rest wait their turn
        # (FIFO), so a crowd of (re)connecting subscribers cannot take the loop from
        # the live stream, and one that leaves while waiting costs no read at all.
        # A turn is one batch, not a whole catch-up: a subscriber that does not read
        # what it was sent waits for that outside its turn, so it cannot hold one.
        self._reading = asyncio.Semaphore(max_concurrent_catchups)
        # The last durable transactions, for catch-ups that start among them.
        self._tail = LogTail(tail_bytes)
        change_log.before_purge(self._tail.forget_before)
        self.catchups_from_memory = 0
        self.catchups_from_log = 0
        # Rows per group commit, and catch-ups from request to the end of their
        # read (waits for durability and for a turn included): for /metrics.
        self.group_commit_rows = Histogram(GROUP_ROWS_BOUNDS)
        self.catchup_seconds = Histogram(CATCHUP_BOUNDS_S)

    # ------------------------------------------------------------------
    # Enqueue side: called by the main loop without awaiting.

    def append(self, changes: list[Change]) -> None:
        """Takes a batch of the stream — the same changes the forwarder was just given.

        Each transaction's rows are built as its changes arrive (a change's stored
        text is its message's change object, cut out of the message text) and the
        transaction is queued whole at its commit (a big one in chunks, past
        ``open_tx_flush_bytes``); a rollback drops it. Schema changes add their
        backfill bookkeeping, which goes in with the commit.
        """
        tx = self._building
        for change in changes:
            watermark, tag, text = change
            if tag == "begin":
                assert isinstance(text, str), "a begin is never large"
                if tx is not None:
                    raise AssertionError(
                        f"begin {watermark} while transaction {tx.watermark} is open"
                    )
                body = extract_change(text)
                skip_ack = body != _PLAIN_BEGIN and loads(body).get("skipAck") is True
                tx = self._building = _OpenTx(
                    watermark, skip_ack, [(watermark, 0, body, None)], bytes=len(body)
                )
                self._queued_bytes += len(body)
                self._enqueued_in_tx = True
                continue
            if tx is None:
                raise AssertionError(f"{tag} {watermark} outside a transaction")
            if tag == "commit":
                assert isinstance(text, str), "a commit is never large"
                body = extract_change(text)
                self._queued_bytes += len(body)
                tx.bytes += len(body)
                tx.pos += 1
                tx.rows.append((tx.watermark, tx.pos, body, tx.watermark))
                self._building = None
                self._enqueue(tx)
                self._last_enqueued_commit = watermark
                self._end_enqueued_tx()
                tx = None
                continue
            if tag == "rollback":
                tx = None
                self._drop_building()
                continue
            data = data_change(text)
            if tag in _SCHEMA_TAGS:  # its backfill bookkeeping goes with the commit
                assert isinstance(data, str), "a schema change is never large"
                tx.ops.extend(bookkeeping_for(loads(data)))
            tx.pos += 1
            tx.rows.append((tx.watermark, tx.pos, data, None))
            size = len(data)
            tx.bytes += size
            self._queued_bytes += size
            if tx.bytes >= self._open_tx_flush_bytes:
                self._enqueue(_Chunk(tx.rows, tx.bytes))
                tx.rows, tx.bytes, tx.chunked = [], 0, True

    def abort(self) -> None:
        """The stream broke: drop the open transaction (nothing of it is stored)."""
        if self._building is not None:
            log.info("dropping transaction %s: the stream was aborted", self._building.watermark)
        self._drop_building()

    def _enqueue(self, item: _Item) -> None:
        self._queue.append(item)
        self._queue_ready.set()

    def _drop_building(self) -> None:
        """Ends the transaction being built without storing it."""
        tx, self._building = self._building, None
        if tx is not None:
            self._processed(tx.bytes)  # never queued: its bytes are free again
            if tx.chunked:  # the consumer rolls back the rows already written
                self._enqueue(_DROP)
        self._end_enqueued_tx()

    def catchup(self, sub: Subscriber, mode: Mode) -> None:
        """Catches ``sub`` up to the stream position of this very call (see module doc)."""
        request = _Catchup(sub, mode, self._timers.monotonic())
        # A backlog that passes its hard bound is dropped; the next round reads it.
        # (Without ``sub`` in it: a cycle would keep a closed subscriber for the GC.)
        sub.catch_up_again = partial(self.catchup, mode=mode)
        if self._enqueued_in_tx or self._until_owned:
            self._parked.append(request)
        else:
            self._start_catchup(request, self._last_enqueued_commit)

    def ready_for_more(self) -> asyncio.Future[None] | None:
        """None, or a gate to await while the queue holds more than the byte budget."""
        if not self._running:
            return None
        if self._gate is None and self._queued_bytes > self._budget:
            log.warning(
                "change log writes are behind by %d bytes; pausing upstream", self._queued_bytes
            )
            self._gate = asyncio.get_running_loop().create_future()
            self._arm_watchdog()
        return self._gate

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def _end_enqueued_tx(self) -> None:
        self._enqueued_in_tx = False
        if not self._parked:  # the usual case, once per transaction
            return
        parked, self._parked = self._parked, []
        for request in parked:
            self._start_catchup(request, self._last_enqueued_commit)

    # ------------------------------------------------------------------
    # Back pressure.

    def _arm_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = self._timers.call_later(self._statement_timeout_s, self._on_wedged)

    def _on_wedged(self) -> None:
        self._watchdog = None
        gate, self._gate = self._gate, None
        if gate is not None and not gate.done():
            gate.set_exception(
                WedgedError(
                    f"No statement processed within the last "
                    f"{round(self._statement_timeout_s * 1000)}ms. "
                    "Considering the change-log to be wedged."
                )
            )

    def _processed(self, size: int) -> None:
        self._queued_bytes -= size
        if self._gate is None:
            return
        if self._queued_bytes < self._budget * LOW_WATER_FRACTION:
            self._open_gate()
        else:
            self._arm_watchdog()  # progress: restart the clock

    def _open_gate(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        gate, self._gate = self._gate, None
        if gate is not None and not gate.done():
            gate.set_result(None)

    # ------------------------------------------------------------------
    # Consumer.

    async def run(self) -> None:
        """Writes queued changes until ``stop``; raises what made it fail."""
        self._running = True
        self._stopped.clear()
        completed: list[_OpenTx] = []
        writer: contextlib.AbstractAsyncContextManager[WriteTransaction] | None = None
        db_tx: WriteTransaction | None = None
        chunk_rows = 0  # rows of a big transaction already in the open db_tx

        async def open_db_tx() -> WriteTransaction:
            nonlocal writer, db_tx
            if db_tx is None:
                writer = self._log.write(self._owner)
                db_tx = await writer.__aenter__()
            return db_tx

        async def close_db_tx(*, commit: bool) -> None:
            # The write context commits on a clean exit and rolls back when an
            # exception passes through it; it is held open across queue reads, so
            # it is driven by hand.
            nonlocal writer, db_tx
            cm, writer, db_tx = writer, None, None
            if cm is None:
                return
            if commit:
                await cm.__aexit__(None, None, None)
            else:
                await cm.__aexit__(_Rollback, _Rollback(), None)

        async def flush_completed() -> None:
            nonlocal completed, chunk_rows
            if not completed:
                return
            group, completed = completed, []
            rows = [row for t in group for row in t.rows]
            committed, chunk_rows = len(rows) + chunk_rows, 0
            if db_tx is None and not any(t.ops for t in group):
                # The common case (no schema-change bookkeeping, no big transaction
                # holding a database transaction open): one call.
                await self._log.commit_rows(self._owner, rows, group[-1].watermark)
                self._made_durable(group)
                self.group_commit_rows.observe(committed)
                return
            w = await open_db_tx()
            for start in range(0, len(rows), self._group_max_rows):
                await w.append(rows[start : start + self._group_max_rows])
            for t in group:
                for op in t.ops:
                    await w.apply(op)
            w.set_last_watermark(group[-1].watermark)
            await close_db_tx(commit=True)
            self._made_durable(group)
            self.group_commit_rows.observe(committed)

        try:
            await self._log.start_writer()
            # Rows of a big transaction are in the open database transaction.
            chunked_open = False
            stopping = False
            while not stopping:
                while not self._queue:
                    self._queue_ready.clear()
                    await self._queue_ready.wait()
                items, size = self._take_group()
                self._processed(size)
                for item in items:
                    if type(item) is _OpenTx:
                        completed.append(item)
                        if chunked_open:
                            # The big transaction's commit: its last rows, its
                            # bookkeeping and lastWatermark go in with its chunks.
                            await flush_completed()
                            chunked_open = False
                    elif type(item) is _Chunk:
                        if not chunked_open:
                            # Commit what is complete: the big one gets a database
                            # transaction of its own, dropped whole on rollback.
                            await flush_completed()
                            chunked_open = True
                        w = await open_db_tx()
                        await w.append(item.rows)
                        chunk_rows += len(item.rows)
                    elif item is _DROP:
                        if chunked_open:
                            await close_db_tx(commit=False)
                            chunked_open = False
                            chunk_rows = 0
                    else:  # _STOP
                        stopping = True
                        break
                # Not held while the next group is awaited: a transaction's rows
                # may carry a 100 MB value (_take_group gives at least one item).
                del items, item
                if not chunked_open:
                    await flush_completed()
        finally:
            self._running = False
            with contextlib.suppress(BaseException):
                await close_db_tx(commit=False)
            self._open_gate()
            self._drain_queue()
            # What this stream enqueued but did not store will not become durable
            # on its own: its waiters (catch-ups) fail, and their subscribers
            # reconnect and catch up again.
            self._fail_durable_waiters(
                StorerStopped("the change stream ended before the catch-up bound was stored")
            )
            self._stopped.set()

    def _take_group(self) -> tuple[list[_Item], int]:
        """Queued items for one group commit (about ``group_max_rows`` rows, at
        least one item), and the JSON bytes they hold."""
        queue = self._queue
        items: list[_Item] = []
        rows = size = 0
        while queue and rows < self._group_max_rows:
            item = queue.popleft()
            items.append(item)
            if isinstance(item, (_OpenTx, _Chunk)):
                rows += len(item.rows)
                size += item.bytes
        return items, size

    def _made_durable(self, group: list[_OpenTx]) -> None:
        for t in group:
            if t.chunked:  # its first rows went ahead in chunks: not all at hand
                self._tail.clear()
            else:
                self._tail.add(t.watermark, t.rows, t.bytes)
        self.durable = group[-1].watermark
        self._wake_durable_waiters()
        acked = [t.watermark for t in group if not t.skip_ack]
        if acked:
            self._on_durable(acked[-1])

    def _drain_queue(self) -> None:
        while self._queue:
            item = self._queue.popleft()
            if isinstance(item, (_OpenTx, _Chunk)):
                self._queued_bytes -= item.bytes
        # Subscribers parked mid-transaction can no longer be served: they reconnect.
        parked, self._parked = self._parked, []
        for request in parked:
            request.sub.fail(StorerStopped("the change stream was interrupted"))
        self._enqueued_in_tx = False
        # Nothing past what is stored is pending any more: catch-ups that start
        # before the next stream are bounded by the durable watermark.
        self._last_enqueued_commit = self.durable

    async def stop(self, *, drain_timeout_s: float = 30.0) -> None:
        """Aborts the open transaction, writes what is complete, and ends ``run``.

        Raises ``AbortError`` if the queue does not drain within the timeout (real
        time: this is the last safety net when the change log hangs).
        """
        if not self._running:
            return
        self.abort()
        self._enqueue(_STOP)
        try:
            await within(self._stopped.wait(), drain_timeout_s)
        except TimeoutError:
            raise AbortError(
                f"changeLog did not drain within {round(drain_timeout_s * 1000)}ms"
            ) from None

    def owned(self, last_watermark: str) -> None:
        """This task owns the change log, which ends at ``last_watermark``.

        Until a takeover completes the previous owner may still store commits (and
        ack them upstream, so the new stream never brings them): catch-ups asked for
        before it are parked and bounded here, by where the log really ends.
        """
        if last_watermark > self.durable:
            self.reset_for_stream(last_watermark)
        self._until_owned = False
        if not self._enqueued_in_tx:
            self._end_enqueued_tx()

    def reset_for_stream(self, durable_watermark: str) -> None:
        """A new upstream stream starts from ``durable_watermark`` (what is stored)."""
        if durable_watermark != self.durable:
            self._tail.clear()  # the log's end moved without this storer
        self._last_enqueued_commit = durable_watermark
        self.durable = durable_watermark
        self._wake_durable_waiters()
        self._drop_building()  # if the last stream ended without abort()

    # ------------------------------------------------------------------
    # Catch-up.

    def _batches(self, start: str, up_to: str) -> AsyncGenerator[list[StoredRow], None]:
        """The log's rows from ``start``'s transaction through ``up_to``, in batches
        that start small and double: from memory while the tail holds them all."""
        first = min(CATCHUP_FIRST_BATCH, self._catchup_batch)
        held = self._tail.rows_from(start, up_to)
        if held is None:
            self.catchups_from_log += 1
            return self._log.read(
                start,
                up_to,
                batch_size=self._catchup_batch,
                first_batch=first,
                # A large change comes back in pieces, never whole (decision 44).
                pieces_over=LARGE_TEXT_CHARS,
            )
        self.catchups_from_memory += 1
        return _ramped(held, first, self._catchup_batch)

    def _start_catchup(self, request: _Catchup, up_to: str) -> None:
        request.sub.catchup_to = up_to
        self.progress.start()
        task = asyncio.create_task(self._catchup(request, up_to), name=f"catchup-{request.sub.id}")
        request.task = task
        self._catchups.add(task)
        task.add_done_callback(self._catchups.discard)

    async def wait_durable(self, watermark: str, *, sub: Subscriber | None = None) -> None:
        """Returns once ``watermark`` is durable; raises ``StorerStopped`` if it won't be.

        That is: the stream that enqueued it ended first, or ``sub`` closed.
        """
        if self.durable >= watermark:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._durable_waiters.append((watermark, future))
        if sub is not None:

            def on_close() -> None:
                if not future.done():
                    future.set_exception(StorerStopped("subscriber closed"))

            sub.downstream.on_close(on_close)
        await future

    def _wake_durable_waiters(self) -> None:
        still = []
        for watermark, future in self._durable_waiters:
            if future.done():
                continue
            if watermark <= self.durable:
                future.set_result(None)
            else:
                still.append((watermark, future))
        self._durable_waiters = still

    def _fail_durable_waiters(self, error: StorerStopped) -> None:
        self._wake_durable_waiters()
        waiters, self._durable_waiters = self._durable_waiters, []
        for _, future in waiters:
            if not future.done():
                future.set_exception(error)

    async def _catchup(self, request: _Catchup, up_to: str) -> None:
        sub, mode = request.sub, request.mode
        start = sub.watermark
        try:
            await self.wait_durable(up_to, sub=sub)
            if sub.closed:
                return
            job = Job(f"catch-up of {sub.id}", unit="changes", context=sub.log_fields)
            request.job = self.progress.add(job)
            await self._read_for(sub, mode, start, up_to, job)
            if not sub.closed:  # read to its end (not refused, not gone)
                self.catchup_seconds.observe(self._timers.monotonic() - request.started)
        except AutoResetSignal as e:
            log.error("%s", e, extra=sub.log_extra)
            sub.fail(e)
            self._on_fatal(e)
        except StorerStopped as e:
            sub.fail(e)
        except Exception as e:
            log.exception("catch-up of subscriber %s failed", sub.id, extra=sub.log_extra)
            sub.fail(e)
        finally:
            if request.job is not None:
                request.job.finish()

    async def _read_for(
        self, sub: Subscriber, mode: Mode, start: str, up_to: str, job: Job
    ) -> None:
        """Emits the log's changes after ``start`` through ``up_to`` to ``sub``."""
        # The replica version is where the log starts, until a purge took its start
        # (zero's storer takes it as found regardless: a silent gap for a subscriber
        # at the replica version once the log was purged). Known for this process's
        # own purges; a restart forgets it.
        found = start == self._replica_version and self._log.purged_rows == 0
        rows_seen = False
        last: asyncio.Future[bool] | None = None
        async with contextlib.aclosing(self._batches(start, up_to)) as batches:
            while True:
                async with self._reading:  # a turn: one batch
                    if sub.closed:
                        return
                    batch = await anext(batches, None)
                if batch is None:
                    break
                rows_seen = True
                # At most two batches in memory; waited on outside a turn. False:
                # the subscriber closed (left, or was dropped) meanwhile.
                if last is not None and not await last:
                    return
                last = None
                # The rows of the subscriber's own last transaction come first (the
                # read starts at it): skipped. Without them the log was purged past it.
                skip = 0
                while skip < len(batch) and batch[skip][0] == start:
                    skip += 1
                found = found or skip > 0
                if not found and skip < len(batch):
                    watermark = batch[skip][0]
                    # Whatever the mode: zero's storer resets the service for a
                    # backup-mode subscriber here (its own backup replicator), but ours
                    # follows the log in a child process (app.runtime.log_follower,
                    # which fails with exit code 3 on its own), so a backup-mode
                    # subscriber comes from the network, and nothing a client says may
                    # stop or reset the service (issue 25).
                    sub.close(
                        ErrorType.WATERMARK_TOO_OLD,
                        f"earliest supported watermark is {watermark} (requested {start})",
                    )
                    return
                last = sub.catchup(_stored_changes(batch[skip:] if skip else batch))
                _advance(job, len(batch) - skip, start, up_to, batch[-1][0])
        if not found and not rows_seen:
            log.info(
                "subscriber %s at %s is ahead of the durable change log (%s)",
                sub.id,
                start,
                up_to,
                extra=sub.log_extra,
            )
        sub.set_caught_up()

    async def close_catchups(self) -> None:
        tasks = list(self._catchups)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.progress.stop()


def _advance(job: Job, changes: int, start: str, up_to: str, at: str) -> None:
    """Counts a batch, and estimates the catch-up's total in changes from how far
    through the watermark range it has read (the log has no cheap row count)."""
    job.advance(changes)
    fraction = watermark_fraction(start, up_to, at)
    if fraction:
        job.total = max(job.done, round(job.done / fraction))


async def _ramped(
    transactions: list[list[StoredRow]], first: int, size: int
) -> AsyncGenerator[list[StoredRow], None]:
    """The transactions' rows in batches as ``ChangeLog.read`` ramps them: ``first``
    rows, then twice as many each time up to ``size``; each batch is built only
    when asked for."""
    batch: list[StoredRow] = []
    n = first
    for rows in transactions:
        at = 0
        while at < len(rows):
            take = rows[at : at + n - len(batch)]
            batch += take
            at += len(take)
            if len(batch) == n:
                yield batch
                batch, n = [], min(size, n * 2)
    if batch:
        yield batch


def _stored_changes(rows: list[StoredRow]) -> list[Change]:
    """Change-log rows as the changes they were stored from (the message text
    rebuilt, byte for byte)."""
    out: list[Change] = []
    for watermark, _pos, change, _pre in rows:
        tag = change_tag(change)
        out.append(new_change(watermark, tag, reconstruct(watermark, tag, change)))
    return out


class _Rollback(Exception):
    """Rolls the open write transaction back when its context exits."""
