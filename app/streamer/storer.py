"""The storer: writes the change stream to the change log with group commit.

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

Catch-up of subscribers from the log is ``app.streamer.catchup``; the storer
owns one ``Catchups`` and gives it what it needs: each catch-up's bound (the last
commit *enqueued*, or a wait while a transaction is open or the log not yet owned),
``wait_durable``, the log and the tail of the last durable transactions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from app.flow_gate import HighLowGate
from app.logs import redact
from app.protocol.canonical_json import loads
from app.protocol.changes import SCHEMA_CHANGE_TAGS
from app.protocol.codec import data_change, extract_change
from app.stop_signals import AbortError
from app.storage import ChangeLog, Replication, StoredRow
from app.storage.backfill import BookkeepingOp, bookkeeping_for
from app.storage.changelog import WriteTransaction
from app.streamer.catchup import CATCHUP_BATCH, MAX_CONCURRENT_CATCHUPS, Catchups, StorerStopped
from app.streamer.histogram import GROUP_ROWS_BOUNDS, Histogram
from app.streamer.subscriber import Change, Subscriber
from app.streamer.tail import DEFAULT_TAIL_BYTES, LogTail
from app.streamer.timers import TimerHandle, Timers
from app.timeouts import within

log = logging.getLogger(__name__)

DEFAULT_BACK_PRESSURE_BYTES = 64 * 1024 * 1024
# A group commit stops taking transactions once it holds this many rows (whole
# transactions only): large enough that one commit (one fsync) serves many small ones.
DEFAULT_GROUP_MAX_ROWS = 10_000
LOW_WATER_FRACTION = 0.8


class WedgedError(AbortError):
    """No change was processed within the statement timeout while upstream waited."""


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
        self._timers = timers
        # The first failed write of the current streak and when it failed (cleared by
        # the next durable commit): /ready's "cannot write" (``write_problem``).
        self._write_failure: tuple[str, float] | None = None
        # Change text made durable so far (how far behind a subscriber's ack is).
        self.stored_bytes = 0
        self._on_durable = on_durable
        self._statement_timeout_s = statement_timeout_s
        self._group_max_rows = group_max_rows
        self._open_tx_flush_bytes = open_tx_flush_bytes

        # Enqueue side (the main loop, synchronous).
        # A deque and an event instead of asyncio.Queue: this is on the per-change
        # hot path, and the queue's bound is the byte budget (ready_for_more).
        self._queue: deque[_Item] = deque()
        self._queue_ready = asyncio.Event()
        self._queued_bytes = 0
        self._building: _OpenTx | None = None
        self._enqueued_in_tx = False
        self._last_enqueued_commit = durable_watermark
        # Catch-ups wait for ``owned`` (a takeover may still be moving the log's end).
        self._until_owned = hold_catchups_until_owned
        # Closed once the queue is at the byte budget, open again at 80 % of it.
        self._gate = HighLowGate(back_pressure_bytes, int(back_pressure_bytes * LOW_WATER_FRACTION))
        self._watchdog: TimerHandle | None = None

        # Consumer side.
        self.durable = durable_watermark
        # Catch-ups waiting for their bound to become durable: (watermark, future).
        self._durable_waiters: list[tuple[str, asyncio.Future[None]]] = []
        self._running = False
        self._stopped = asyncio.Event()
        # While ``run`` goes: complete transactions for the next group commit, the
        # write held open across queue reads for a big transaction's chunks, and
        # how many of its rows are in it already.
        self._completed: list[_OpenTx] = []
        self._write = _HeldWrite(change_log, owner)
        self._chunked_open = False
        self._chunk_rows = 0
        # The last durable transactions, for catch-ups that start among them.
        self._tail = LogTail(tail_bytes)
        change_log.before_purge(self._tail.forget_before)
        self.catchups = Catchups(
            change_log=change_log,
            tail=self._tail,
            boundary=self._catchup_bound,
            wait_durable=self.wait_durable,
            replica_version=replica_version,
            timers=timers,
            on_fatal=on_fatal,
            batch=catchup_batch,
            max_concurrent=max_concurrent_catchups,
        )
        # Rows per group commit: for /metrics.
        self.group_commit_rows = Histogram(GROUP_ROWS_BOUNDS)

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

    def _catchup_bound(self) -> str | None:
        """A catch-up asked for now reads the log up to here; None: it is parked
        until the open transaction ends, or the log is owned."""
        if self._enqueued_in_tx or self._until_owned:
            return None
        return self._last_enqueued_commit

    def ready_for_more(self) -> asyncio.Future[None] | None:
        """None, or a gate to await while the queue holds more than the byte budget."""
        if not self._running:
            return None
        gate = self._gate
        if not gate.closed and gate.rise(self._queued_bytes):
            log.warning(
                "change log writes are behind by %d bytes; pausing upstream", self._queued_bytes
            )
            self._arm_watchdog()
        return gate.wait()

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def _end_enqueued_tx(self) -> None:
        self._enqueued_in_tx = False
        if self.catchups.parked:  # not in the usual case, once per transaction
            self.catchups.release_parked(self._last_enqueued_commit)

    # ------------------------------------------------------------------
    # Back pressure.

    def _arm_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = self._timers.call_later(self._statement_timeout_s, self._on_wedged)

    def _on_wedged(self) -> None:
        self._watchdog = None
        self._gate.fail(
            WedgedError(
                f"No statement processed within the last "
                f"{round(self._statement_timeout_s * 1000)}ms. "
                "Considering the change-log to be wedged."
            )
        )

    def _processed(self, size: int) -> None:
        self._queued_bytes -= size
        if not self._gate.closed:
            return
        if self._gate.fall(self._queued_bytes):
            self._cancel_watchdog()
        else:
            self._arm_watchdog()  # progress: restart the clock

    def _open_gate(self) -> None:
        self._cancel_watchdog()
        self._gate.open()

    def _cancel_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    # ------------------------------------------------------------------
    # Consumer.

    async def run(self) -> None:
        """Writes queued changes until ``stop``; raises what made it fail."""
        self._running = True
        self._stopped.clear()
        try:
            await self._log.start_writer()
            while await self._write_group():
                pass
        except AbortError:
            raise  # a stop signal (ownership lost, a reset), not a write that failed
        except Exception as e:
            if self._write_failure is None:
                self._write_failure = (_describe(e), self._timers.monotonic())
            raise
        finally:
            await self._consumer_ended()

    def write_problem(self) -> str | None:
        """Why the change log cannot be written now (a write failed and none has
        succeeded since: a full disk, a lost database), or None."""
        failure = self._write_failure
        if failure is None:
            return None
        error, since = failure
        waited = self._timers.monotonic() - since
        return f"the change log cannot be written (for {waited:.0f} s): {error}"

    async def _write_group(self) -> bool:
        """Waits for queued items and writes a group of them; False once ``stop``'s
        marker was among them.

        Complete transactions are committed together, except while a big one is
        chunked: its rows are in a database transaction of its own, which commits
        with its commit (together with what completed before it) or rolls back.
        The group is not held once this returns, while the next one is awaited: a
        transaction's rows may carry a 100 MB value.
        """
        while not self._queue:
            self._queue_ready.clear()
            await self._queue_ready.wait()
        items, size = self._take_group()
        self._processed(size)
        going = True
        for item in items:
            if type(item) is _OpenTx:
                self._completed.append(item)
                if self._chunked_open:
                    # The big transaction's commit: its last rows, its
                    # bookkeeping and lastWatermark go in with its chunks.
                    await self._flush_completed()
                    self._chunked_open = False
            elif not await self._write_other(item):
                going = False
                break
        if not self._chunked_open:
            await self._flush_completed()
        return going

    async def _write_other(self, item: _Item) -> bool:
        """Writes a chunk or drops the chunked transaction; False for ``_STOP``."""
        if type(item) is _Chunk:
            if not self._chunked_open:
                # Commit what is complete: the big one gets a database
                # transaction of its own, dropped whole on rollback.
                await self._flush_completed()
                self._chunked_open = True
            w = await self._write.open()
            await w.append(item.rows)
            self._chunk_rows += len(item.rows)
        elif item is _DROP:
            if self._chunked_open:
                await self._write.close(commit=False)
                self._chunked_open = False
                self._chunk_rows = 0
        else:  # _STOP
            return False
        return True

    async def _flush_completed(self) -> None:
        """Commits the complete transactions (and a chunked one's earlier rows)."""
        if not self._completed:
            return
        group, self._completed = self._completed, []
        rows = [row for t in group for row in t.rows]
        committed, self._chunk_rows = len(rows) + self._chunk_rows, 0
        if self._write.tx is None and not any(t.ops for t in group):
            # The common case (no schema-change bookkeeping, no big transaction
            # holding a database transaction open): one call.
            await self._log.commit_rows(self._owner, rows, group[-1].watermark)
        else:
            w = await self._write.open()
            for start in range(0, len(rows), self._group_max_rows):
                await w.append(rows[start : start + self._group_max_rows])
            for t in group:
                for op in t.ops:
                    await w.apply(op)
            w.set_last_watermark(group[-1].watermark)
            await self._write.close(commit=True)
        self._made_durable(group)
        self.group_commit_rows.observe(committed)

    async def _consumer_ended(self) -> None:
        self._running = False
        with contextlib.suppress(BaseException):
            await self._write.close(commit=False)
        # Neither is kept for the next stream (rows may be large).
        self._completed, self._chunked_open, self._chunk_rows = [], False, 0
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
        self.stored_bytes += sum(t.bytes for t in group)
        self._write_failure = None
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
        self.catchups.fail_parked(StorerStopped("the change stream was interrupted"))
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
    # Durability waiters (catch-ups wait for their bound).

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

    @property
    def durable_waiters(self) -> int:
        """Waits on ``wait_durable`` held (one whose subscriber closed, until the
        durable watermark next moves)."""
        return len(self._durable_waiters)


class _Rollback(Exception):
    """Rolls the open write transaction back when its context exits."""


class _HeldWrite:
    """The change log's write context, driven by hand: it is held open across queue
    reads (a big transaction's chunks), so it cannot be an ``async with``. It
    commits on a clean exit and rolls back when an exception passes through it."""

    __slots__ = ("_cm", "_log", "_owner", "tx")

    def __init__(self, change_log: ChangeLog, owner: str) -> None:
        self._log = change_log
        self._owner = owner
        self._cm: contextlib.AbstractAsyncContextManager[WriteTransaction] | None = None
        self.tx: WriteTransaction | None = None  # None: no database transaction open

    async def open(self) -> WriteTransaction:
        """The open database transaction, begun if there is none."""
        if self.tx is None:
            self._cm = self._log.write(self._owner)
            self.tx = await self._cm.__aenter__()
        return self.tx

    async def close(self, *, commit: bool) -> None:
        cm, self._cm, self.tx = self._cm, None, None
        if cm is None:
            return
        if commit:
            await cm.__aexit__(None, None, None)
        else:
            await cm.__aexit__(_Rollback, _Rollback(), None)


def _describe(error: BaseException) -> str:
    """An error for /ready's reason: its type and a short, redacted message."""
    text = redact(" ".join(str(error).split()))
    if len(text) > _ERROR_TEXT:
        text = text[: _ERROR_TEXT - 1] + "…"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


_ERROR_TEXT = 120
