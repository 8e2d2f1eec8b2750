"""The change-streamer service: forward, store, ack (spec/core.md §2).

``run`` assumes ownership of the change log, then loops over upstream
connections. It takes what the pump has read ahead as a batch; each message is
serialized once and queued for the storer, and the batch's changes are forwarded
to the live subscribers together — always before the loop awaits anything, so at
every await the storer and the forwarder stand at the same stream position.
Every 64 KiB of forwarded JSON the loop waits for a flow-control broadcast, and
after a batch it waits if the storer is over its byte budget. Both waits are
raced against the end of the upstream stream, so a dead upstream is noticed at
once.

When a stream ends or breaks inside a transaction, the partial transaction is
dropped from the storer and subscribers get a synthetic rollback; the next
stream starts after the last stored commit. Errors are classified (spec/core.md
§2.8): abort signals and protocol violations stop the service; anything else is
retried with backoff (25 ms doubling to 10 s).

``subscribe`` adds a subscriber to the forwarder and asks the storer to catch it
up in the same synchronous step; that pairing is the gap-free handoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import DBAPIError

from app.backoff import Backoff
from app.protocol.canonical_json import dumps, dumps_text
from app.protocol.codec import data_message, reconstruct
from app.protocol.errors import ErrorType
from app.protocol.messages import (
    Begin,
    ChangeSourceMessage,
    Commit,
    Control,
    Data,
    Rollback,
    Status,
)
from app.protocol.subscription_messages import SYNTHETIC_ROLLBACK_JSON
from app.sources.base import ChangeSource, ChangeStream, SourceMetric
from app.stop_signals import AbortError, AutoResetSignal
from app.storage import ChangeDb, ChangeLog, ChangeLogState, OwnershipLostError, Replication
from app.streamer.acker import UpstreamAcker
from app.streamer.backup_watch import BackupWatch
from app.streamer.downstream import DEFAULT_MAX_UNCONSUMED_BYTES, Downstream
from app.streamer.forwarder import Forwarder
from app.streamer.histogram import LATENCY_BOUNDS_S, Histogram
from app.streamer.loop_lag import LoopLag
from app.streamer.pump import Pump
from app.streamer.purge import CLEANUP_DELAY_S, Purger
from app.streamer.reservations import (
    DEFAULT_MAX_OPEN_S,
    DEFAULT_MAX_RESERVATIONS,
    Reservation,
    SnapshotReservations,
)
from app.streamer.rowrun import encode_rows
from app.streamer.snapshot import ServiceSnapshot, take_snapshot
from app.streamer.storer import DEFAULT_BACK_PRESSURE_BYTES, DEFAULT_GROUP_MAX_ROWS, Storer
from app.streamer.subscriber import Change, Mode, Subscriber, new_change, subscriber_log_fields
from app.streamer.tail import DEFAULT_TAIL_BYTES
from app.streamer.timers import LoopTimers, Timers
from app.timeouts import within
from app.versions import PROBE_REPLICA_VERSION

log = logging.getLogger(__name__)

# Node's default stream high-water mark, which the reference uses as its
# flow-control checkpoint interval.
FLUSH_THRESHOLD = 64 * 1024
SWITCH_INTERVAL_S = 0.0005


class TooManySubscribers(Exception):
    """The subscriber limit is reached; the message says so (the client retries)."""


class SocketSlot:
    """A ``/subscribe`` or ``/snapshot`` socket's place under the subscriber limit
    (``ChangeStreamerService.admit_socket``); ``release`` is idempotent."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


class UnrecoverableError(Exception):
    """The upstream broke the protocol; retrying would repeat it."""


@dataclass(frozen=True, slots=True)
class SubscriberContext:
    protocol_version: int
    id: str
    mode: Mode
    replica_version: str
    watermark: str
    initial: bool = False
    task_id: str | None = None

    def log_fields(self) -> dict[str, object]:
        """What the log lines of this subscriber's connection carry (``app.logs``)."""
        return subscriber_log_fields(self.id, self.task_id, self.mode, self.protocol_version)


@dataclass(frozen=True, slots=True)
class StreamerOptions:
    back_pressure_bytes: int = DEFAULT_BACK_PRESSURE_BYTES
    statement_timeout_s: float = 20.0
    # Rows a change-log group commit stops at (ZERO_CHANGE_LOG_BATCH_SIZE; whole
    # transactions only, so one may pass it).
    change_log_batch_size: int = DEFAULT_GROUP_MAX_ROWS
    drain_timeout_s: float = 30.0
    # Consensus-timeout proportion; negative disables early release.
    timeout_proportion: float = 2.0
    slow_subscriber_grace_s: float = 30.0
    auto_reset: bool = True
    backup_url: str | None = None
    backoff_initial_s: float = 0.025
    backoff_max_s: float = 10.0
    # A subscriber with more than this sent but not acknowledged is dropped (it
    # stopped reading); it can resume from the change log.
    max_unconsumed_bytes: int = DEFAULT_MAX_UNCONSUMED_BYTES
    max_subscribers: int = 1000
    # Replication sockets one client address may hold at once (app/server/replication.py).
    max_sockets_per_address: int = 100
    # How far behind the change log's head a subscriber connected for longer than
    # subscriber_max_lag_s may hold the purge floor: older than this (its acked
    # commit's durable age) or more change text behind is dropped (it may resume,
    # or learn that it is too old).
    subscriber_max_lag_s: float = 3600.0
    subscriber_max_lag_bytes: int = 4 * 1024**3
    # A ``/v7/subscribe`` socket that sends no ``start-subscription`` or
    # ``reserve-snapshot`` within this long is closed (it would hold a slot for ever).
    first_message_timeout_s: float = 30.0
    # Origins whose websocket upgrades are accepted (browsers send one; view-syncers
    # do not); any other Origin gets 403 (app.server.replication_access).
    allowed_origins: tuple[str, ...] = ()
    # If set, replication upgrades need it as the Basic-auth password (else 401).
    replication_password: str | None = None
    # Snapshot reservations open at once, in all (more are refused).
    max_reservations: int = DEFAULT_MAX_RESERVATIONS
    # Snapshot reservations open longer than this are ended (a stuck restore).
    reservation_max_s: float = DEFAULT_MAX_OPEN_S
    # The replica backups are made of; its size goes into reservation statuses.
    replica_file: str | None = None
    # Before purging to a backed-up watermark, wait at least this long.
    purge_delay_s: float = CLEANUP_DELAY_S
    # How long this node's own restore took, up to the service's start: the first
    # cleanup delay (seed 001), so replicas restored beside it still catch up.
    restore_s: float = 0.0
    # Keep at least this much recent change log, whatever else allows (0: off).
    change_log_retention_s: float = 0.0
    # Change text of the last durable transactions kept in memory for catch-ups
    # that start among them (app.streamer.tail; 0: every catch-up reads the log).
    catchup_tail_bytes: int = DEFAULT_TAIL_BYTES


class ChangeStreamerService:
    def __init__(
        self,
        *,
        db: ChangeDb,
        source: ChangeSource,
        task_id: str,
        address: str | None,
        replica_version: str,
        durable_watermark: str,
        options: StreamerOptions | None = None,
        timers: Timers | None = None,
        taking_over: bool = False,
    ) -> None:
        """``taking_over``: another task owns the change log now and may still store
        commits (and ack them upstream) until ``run`` takes it over; catch-ups then
        wait for the takeover, bounded by where the log really ends (``Storer.owned``).
        """
        self.options = options or StreamerOptions()
        self.task_id = task_id
        self.replica_version = replica_version
        self._address = address
        self._source = source
        self._timers = timers or LoopTimers()
        self.change_log = ChangeLog(db)
        self.replication = Replication(db)
        self.acker = UpstreamAcker()
        # The backed-up watermark, the coverage gate, the lags (app.streamer.backup_watch).
        self.backups = BackupWatch(
            backup_url=self.options.backup_url,
            replica_file=self.options.replica_file,
            clock=self._timers.monotonic,
            retention_s=self.options.change_log_retention_s,
        )
        self.loop_lag = LoopLag()  # how late the event loop runs (statz, metrics)
        # /subscribe (not yet subscribed) and /snapshot sockets, under the limit too.
        self._open_sockets = 0
        self.forwarder = Forwarder(
            timers=self._timers,
            timeout_proportion=self.options.timeout_proportion,
            grace_period_s=self.options.slow_subscriber_grace_s,
        )
        self.storer = Storer(
            change_log=self.change_log,
            replication=self.replication,
            owner=task_id,
            replica_version=replica_version,
            durable_watermark=durable_watermark,
            timers=self._timers,
            on_durable=self._on_durable,
            on_fatal=self._on_fatal,
            back_pressure_bytes=self.options.back_pressure_bytes,
            statement_timeout_s=self.options.statement_timeout_s,
            group_max_rows=self.options.change_log_batch_size,
            hold_catchups_until_owned=taking_over,
            tail_bytes=self.options.catchup_tail_bytes,
        )
        self.reservations = SnapshotReservations(
            self.replication.change_log_state,
            self.options.backup_url,
            self._timers,
            replica_size=self.backups.replica_size,
            max_open_s=self.options.reservation_max_s,
            max_open=self.options.max_reservations,
        )

        self.purger = Purger(
            lambda w: self.change_log.purge_before(w, task_id),
            self.forwarder.acks,
            self.reservations.reserved_watermarks,
            self._timers,
            # Grown to the longest reservation → subscribe time seen, starting from how
            # long this node's own restore took (seed 001): a view-syncer restoring an
            # older backup must still find the changes after it. Each open
            # reservation holds the floor at its own watermark (reserved_watermarks),
            # so a steady trickle of restores does not stop purging altogether.
            delay_s=lambda: max(
                self.options.purge_delay_s,
                self.options.restore_s,
                self.reservations.longest_completed_s,
            ),
            named_acks=self._acks_holding_the_floor,
            retention=self.backups.commit_clock,
            # Without backups the tracked watermark is the local replica's position.
            backup_name="backup" if self.options.backup_url else "replica",
            on_fatal=self._on_fatal,
        )
        self.backups.listeners += [
            self.acker.track_backup,
            self.purger.track_backup_watermark,
            self.reservations.track_backup_watermark,
        ]
        self._backoff = Backoff(self.options.backoff_initial_s, self.options.backoff_max_s)
        self._stopped = asyncio.Event()
        self._stop_error: BaseException | None = None
        self._stream: ChangeStream | None = None
        self._tx: str | None = None  # commit watermark of the open transaction
        self._latest_lag_report: dict[str, Any] | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        # Called with each durable commit watermark (the replica follower's wake-up).
        self.durable_listeners: list[Callable[[str], None]] = []
        self.serving_started = asyncio.Event()
        # Set once this task owns the change log (purges check that ownership).
        self.owning = asyncio.Event()
        self.running = False
        self.transactions = 0
        self.changes = 0
        # Upstream commit time (a commit's commitTimeMs) to the moment the commit
        # was handed to the subscribers; commit times of commits not yet handed.
        self.commit_forward_seconds = Histogram(LATENCY_BOUNDS_S)
        self._unforwarded_commit_ms: list[float] = []

    # ------------------------------------------------------------------
    # Lifecycle.

    async def run(self) -> None:
        """Streams until ``stop``; raises the error that stopped it, if any."""
        # The event loop thread is busy with changes while driver threads
        # (aiosqlite) need the GIL back after every statement step; Python's
        # default 5 ms switch interval then stalls each step (the convoy effect:
        # ingest fell from ~6,000 to ~3,000 transactions/s in tests/streamer's
        # crash child). A shorter interval costs little.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.running = True
        self.loop_lag.start()
        self.forwarder.start_progress_monitor()
        first = self._source.start_lag_reporter()
        if first is not None:
            self._latest_lag_report = first
        try:
            last = await self.replication.assume_ownership(self.task_id, self._address)
            self.storer.owned(last)
            self.owning.set()
            self.backups.activate()  # purges, acks and reservations hear of backups now
            while not self._stopped.is_set():
                error = await self._stream_once()
                if self._stopped.is_set():
                    break
                if error is not None and _is_missing_table(error):
                    log.info("the change log's tables are gone (%s); stopping", error)
                    await self.stop(_CleanStop(str(error)))
                    break
                if error is not None and _is_fatal(error):
                    await self.stop(error)
                    break
                delay = self._backoff.next_delay()
                if error is not None:
                    level = logging.INFO if delay < 1 else logging.WARNING
                    if delay >= 6.5:
                        level = logging.ERROR
                    log.log(level, "change stream failed (%s); retrying in %.3fs", error, delay)
                with contextlib.suppress(TimeoutError):
                    await within(self._stopped.wait(), delay)
        finally:
            self.forwarder.stop_progress_monitor()
            await self.loop_lag.stop()
            await self.purger.stop()
            await self.reservations.stop()
            await self.storer.catchups.close()
            self.forwarder.close_all()
            self.running = False
            log.info("change streamer stopped")
        if self._stop_error is not None and not isinstance(self._stop_error, _CleanStop):
            raise self._stop_error

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the service (None: a plain stop, or still running)."""
        if isinstance(self._stop_error, _CleanStop):
            return None
        return self._stop_error

    async def stop(self, error: BaseException | None = None) -> None:
        """Stops streaming; ``run`` returns (or raises ``error``). Safe to call twice."""
        if self._stopped.is_set():
            return
        if error is not None and not isinstance(error, (AbortError, _CleanStop)):
            log.error("stopping the change streamer: %s", error)
        self._stop_error = error
        self._stopped.set()
        if self._stream is not None:
            await self._stream.close()
        with contextlib.suppress(Exception):
            await self._source.stop()
        await self.backups.stop()

    @property
    def stopped(self) -> asyncio.Event:
        """Set once ``stop`` was called."""
        return self._stopped

    def fail(self, error: BaseException) -> None:
        """Stops the service with ``error`` (an ``AutoResetSignal`` also flags the reset)."""
        self._on_fatal(error)

    def _on_fatal(self, error: BaseException) -> None:
        async def stop_and_flag() -> None:
            # Only the owner speaks for the change log: a node that has not taken it
            # over (or has lost it) must not flag a reset in a log others serve.
            if isinstance(error, AutoResetSignal) and self.owning.is_set():
                with contextlib.suppress(Exception):
                    await self.replication.set_reset_required()
            await self.stop(error)

        self._owned_task(stop_and_flag())

    def _owned_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------
    # One upstream connection.

    async def _stream_once(self) -> BaseException | None:
        storer_task: asyncio.Task[None] | None = None
        error: BaseException | None = None
        try:
            params = await self.replication.start_parameters()
            if params.owner != self.task_id:
                # Another node took the change log over (and with it the slot): a
                # stream started now would take the slot back from it.
                raise OwnershipLostError(params.owner)
            self.storer.reset_for_stream(params.last_watermark)
            stream = await self._source.start_stream(
                params.last_watermark, params.backfill_requests
            )
            self._stream = stream
            if self._stopped.is_set():
                return None
            self.acker.reset(stream.ack)
            storer_task = asyncio.create_task(self.storer.run(), name="storer")
            # The retry delay starts over once a commit of this stream is durable
            # (_on_durable), not when the stream opens: a stream that opens and then
            # fails at once, every time (a full disk), must back off.
            await self._consume(stream, storer_task)
        except Exception as e:  # classified by the caller
            error = e
        finally:
            # Also on cancellation, which then propagates: abort the open
            # transaction and stop the storer before leaving.
            error = await self._end_stream(storer_task, error)
        return error

    async def _end_stream(
        self, storer_task: asyncio.Task[None] | None, error: BaseException | None
    ) -> BaseException | None:
        stream, self._stream = self._stream, None
        if stream is not None:
            with contextlib.suppress(Exception):
                await stream.close()
        self.acker.reset(None)
        if self._tx is not None:
            log.info("upstream ended inside transaction %s: rolling it back", self._tx)
            self.storer.abort()
            self.forwarder.forward([Change(self._tx, "rollback", SYNTHETIC_ROLLBACK_JSON)])
            self._tx = None
        self.forwarder.release_current()
        if storer_task is not None:
            try:
                await self.storer.stop(drain_timeout_s=self.options.drain_timeout_s)
            except AbortError as e:
                storer_task.cancel()
                return e
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    await storer_task
                except Exception as e:  # the storer's failure is the stream's
                    error = error or e
        return error

    async def _consume(self, stream: ChangeStream, storer_task: asyncio.Task[None]) -> None:
        pump = Pump(stream)
        ended = pump.ended
        try:
            unflushed = 0
            while True:
                if storer_task.done():
                    storer_task.result()  # raises the storer's failure
                    raise RuntimeError("the storer stopped unexpectedly")
                batch = pump.take_all()
                if not batch:
                    if ended.done():
                        ended.result()  # raises the stream's failure, if it failed
                        return
                    await pump.wait_readable(also=storer_task)
                    continue
                # In a call of its own, so that nothing of the batch (a change with
                # a 100 MB value, say) stays referenced while the loop waits.
                flushed = await self._consume_batch(batch, unflushed, ended, storer_task)
                del batch
                if flushed is None:
                    return
                unflushed = flushed
                # The byte budget is checked per batch (at most the pump's 256
                # messages past it), not per message.
                gate = self.storer.ready_for_more()
                if gate is not None:
                    await self._race(gate, ended, storer_task)
                    if gate.done():
                        gate.result()  # a wedged storer raises here
                    else:
                        self._raise_if_ended(ended)
                        return
        finally:
            await pump.close()

    async def _consume_batch(
        self,
        batch: list[ChangeSourceMessage],
        unflushed: int,
        ended: asyncio.Future[None],
        storer_task: asyncio.Task[None],
    ) -> int | None:
        """Stores and forwards ``batch``; the bytes forwarded since the last
        checkpoint, or None if the upstream ended at a checkpoint."""
        # Changes are stored and forwarded a batch at a time, but always before any
        # await: a subscriber that joins at an await must find the forwarder and
        # the storer at the same stream position.
        forwarding: list[Change] = []
        try:
            i, end = 0, len(batch)
            while i < end:
                message = batch[i]
                kind = type(message)
                if kind is Data and self._tx is not None:
                    # The common case, a run of row changes, in one call
                    # (rowrun.py). It stops after the change that fills the
                    # flow-control budget: that change is the checkpoint.
                    after, used = encode_rows(
                        batch, i, self._tx, forwarding, FLUSH_THRESHOLD - unflushed
                    )
                    if after > i:
                        self.changes += after - i
                        i = after
                        unflushed += used
                        if unflushed >= FLUSH_THRESHOLD:
                            unflushed = 0
                            if not await self._checkpoint(forwarding, ended, storer_task):
                                return None
                        continue
                i += 1
                if kind is Control or kind is Status:
                    self._forward(forwarding)  # what came before it goes first
                    if kind is Control:
                        assert isinstance(message, Control)
                        await self._reset_required(message)
                    else:
                        assert isinstance(message, Status)
                        self._status(message)
                    continue
                change = self._change(message)
                forwarding.append(change)
                unflushed += len(change.json)
                if unflushed >= FLUSH_THRESHOLD:
                    unflushed = 0
                    if not await self._checkpoint(forwarding, ended, storer_task):
                        return None
        finally:
            self._forward(forwarding)
        return unflushed

    async def _checkpoint(
        self,
        forwarding: list[Change],
        ended: asyncio.Future[None],
        storer: asyncio.Task[None],
    ) -> bool:
        """Stores and forwards ``forwarding``, its last change a flow-control
        checkpoint (synchronously: nothing is left to forward at the await), and
        waits for the release of the checkpoint before it; False if the upstream
        ended first."""
        # Forwarded first: the subscribers' senders are then woken ahead of the
        # storer's consumer (the event loop runs them in that order), so a commit's
        # frames reach the sockets before its group commit is handed to the writer.
        released = self.forwarder.forward(forwarding, checkpoint=True)
        if self._unforwarded_commit_ms:
            self._commits_forwarded()
        self.storer.append(forwarding)
        forwarding.clear()
        if released is None:
            return True
        await self._race(released, ended, storer)
        if not released.done():
            self.forwarder.release_current()
            self._raise_if_ended(ended)
            return False
        return True

    def _forward(self, changes: list[Change]) -> None:
        """Forwards, stores and empties ``changes`` (the one path for every change)."""
        if changes:
            self.forwarder.forward(changes)  # first: see _checkpoint
            if self._unforwarded_commit_ms:
                self._commits_forwarded()
            self.storer.append(changes)
            changes.clear()

    def _commits_forwarded(self) -> None:
        """The commits just forwarded: upstream commit → forward, on the wall clock
        (the upstream's clock against ours: a skew shows up here; a commit stamped
        in our future counts as 0)."""
        now_ms = self._timers.wall_ms()
        observe = self.commit_forward_seconds.observe
        for commit_ms in self._unforwarded_commit_ms:  # a number: the protocol checks it
            waited_ms = now_ms - commit_ms
            observe(waited_ms / 1000 if waited_ms > 0 else 0.0)
        self._unforwarded_commit_ms.clear()

    async def _race(
        self, waited: asyncio.Future[Any], ended: asyncio.Future[None], storer: asyncio.Task[None]
    ) -> None:
        """Waits for ``waited``, the upstream's end, or the storer's failure."""
        await asyncio.wait({waited, ended, storer}, return_when=asyncio.FIRST_COMPLETED)
        if storer.done() and not waited.done():
            storer.result()  # raises the storer's failure
            raise RuntimeError("the storer stopped unexpectedly")

    @staticmethod
    def _raise_if_ended(ended: asyncio.Future[None]) -> None:
        if ended.done():
            ended.result()  # raises the stream's failure, if it failed

    def _change(self, message: ChangeSourceMessage) -> Change:
        """The change of a begin, commit, rollback or data message that ``encode_rows``
        did not take (a value it cannot vouch for); checks that the
        stream keeps the protocol's order."""
        kind = type(message)
        if kind is Data:
            assert isinstance(message, Data)
            tx = self._tx
            if tx is None:
                raise UnrecoverableError(
                    f"'data' change ({message.tag}) received before 'begin' message"
                )
            self.changes += 1
            return new_change(tx, message.tag, data_message(dumps_text(message.body)))
        if kind is Begin:
            assert isinstance(message, Begin)
            if self._tx is not None:
                raise UnrecoverableError(
                    f"'begin' {message.commit_watermark} received while transaction "
                    f"{self._tx} is open"
                )
            watermark = self._tx = message.commit_watermark
            self.acker.on_begin(message)
            return new_change(watermark, "begin", _bookend(message.body, "begin", watermark))
        if kind is Commit:
            assert isinstance(message, Commit)
            open_tx = self._tx
            if open_tx is None:
                raise UnrecoverableError("'commit' change received before 'begin' message")
            if message.watermark != open_tx:
                raise UnrecoverableError(
                    f"commit watermark {message.watermark} does not match 'begin' watermark "
                    f"{open_tx}"
                )
            self._tx = None  # complete once stored: an upstream end from here on rolls nothing back
            self.transactions += 1
            commit_ms = message.body.get("commitTimeMs")
            if commit_ms is not None:
                self._unforwarded_commit_ms.append(commit_ms)
            self.acker.on_commit(message)
            return new_change(open_tx, "commit", _bookend(message.body, "commit", open_tx))
        if kind is Rollback:
            assert isinstance(message, Rollback)
            if self._tx is None:
                raise UnrecoverableError(
                    "'rollback' change (rollback) received before 'begin' message"
                )
            watermark, self._tx = self._tx, None
            self.acker.on_upstream(message)
            return new_change(
                watermark, "rollback", reconstruct(watermark, "rollback", dumps(message.body))
            )
        raise UnrecoverableError(f"unexpected message {message!r}")  # pragma: no cover

    def _status(self, message: Status) -> None:
        self.acker.on_upstream(message)
        if message.lag_report is not None:
            self._latest_lag_report = message.lag_report
            self.forwarder.send_status()

    async def _reset_required(self, control: Control) -> None:
        message = control.message or "Resync required"
        log.error("upstream requires a reset: %s %s", message, control.error_details or "")
        await self.replication.set_reset_required()
        if self.options.auto_reset:
            raise AutoResetSignal(message)

    # ------------------------------------------------------------------
    # Subscribers and reservations.

    def subscribe(self, ctx: SubscriberContext) -> Downstream:
        """Starts a subscription; errors arrive in-band on the returned channel.
        Raises :class:`TooManySubscribers` (before anything starts) at the limit."""
        self._check_limit()
        downstream = Downstream(
            max_unconsumed_bytes=self.options.max_unconsumed_bytes, log_fields=ctx.log_fields()
        )
        sub = Subscriber(
            id=ctx.id,
            protocol_version=ctx.protocol_version,
            watermark=ctx.watermark,
            mode=ctx.mode,
            downstream=downstream,
            latest_lag_report=lambda: self._latest_lag_report,
            task_id=ctx.task_id,
        )
        if ctx.replica_version != self.replica_version:
            # A client asking for the current version is no cause for a warning.
            log.log(
                logging.INFO if ctx.replica_version == PROBE_REPLICA_VERSION else logging.WARNING,
                "rejecting subscriber %s at replica version %s",
                ctx.id,
                ctx.replica_version,
                extra=sub.log_extra,
            )
            sub.close(
                ErrorType.WRONG_REPLICA_VERSION,
                f"current replica version is {self.replica_version} "
                f"(requested {ctx.replica_version})",
            )
            if ctx.task_id is not None:
                # Its restore is over, whatever it restored: the reservation would
                # otherwise hold the purge floor until its cap.
                self.reservations.close_for_task(ctx.task_id)
            return downstream
        if ctx.mode == "serving":
            # An accepted serving subscriber proves that the routing layer sends
            # clients here: it ends the start-up delay (app/runtime/lifecycle.py).
            # Nothing else does: not a refused one, not a backup-mode one, not a
            # reservation (anyone can open those).
            self.serving_started.set()
        # One line at each end of a subscription, as zero-cache logs them; explicit
        # fields, since whoever closes the channel may run in another task.
        log.info("adding subscriber %s at %s", ctx.id, ctx.watermark, extra=sub.log_extra)

        def remove() -> None:
            log.info("removing subscriber %s", sub.id, extra=sub.log_extra)
            self.forwarder.remove(sub)

        downstream.on_close(remove)
        # One synchronous step: the forwarder's position is the catch-up bound.
        self.forwarder.add(sub)
        self.storer.catchups.catchup(sub, ctx.mode)  # same step as Forwarder.add
        if ctx.task_id is not None:
            self.reservations.close_for_task(ctx.task_id)
        return downstream

    def _check_limit(self) -> None:
        count = len(self.forwarder.active) + len(self.forwarder.queued) + self._open_sockets
        if count >= self.options.max_subscribers:
            raise TooManySubscribers(
                f"this change-streamer serves at most {self.options.max_subscribers} "
                "subscribers; retry later"
            )

    @property
    def open_sockets(self) -> int:
        """Sockets admitted under the subscriber limit that have not subscribed."""
        return self._open_sockets

    def admit_socket(self) -> SocketSlot:
        """A place under the subscriber limit for a ``/subscribe`` socket before it
        subscribes, or a ``/snapshot`` socket: each holds server resources as a
        subscriber does, so each counts. Raises :class:`TooManySubscribers`."""
        self._check_limit()
        self._open_sockets += 1

        def release() -> None:
            self._open_sockets -= 1

        return SocketSlot(release)

    def start_snapshot_reservation(self, task_id: str) -> Reservation:
        return self.reservations.open(task_id)

    def _acks_holding_the_floor(self) -> list[tuple[str, str]]:
        """The subscribers' acks the purge floor respects: all but those connected for
        longer than ``subscriber_max_lag_s`` that are behind by more than it (or by
        ``subscriber_max_lag_bytes``): one slow client must not keep the change log
        from shrinking for ever. Those are dropped, saying why; one that resumes
        from a purged watermark gets WatermarkTooOld."""
        max_s, max_bytes = self.options.subscriber_max_lag_s, self.options.subscriber_max_lag_bytes
        now = self._timers.monotonic()
        held: list[tuple[str, str]] = []
        for sub, joined_at in self.forwarder.joined():
            if now - joined_at > max_s:
                lag_s = self.backups.durable_wait_s(sub.acked)
                lag_bytes = self.backups.bytes_after(sub.acked)
                if lag_s > max_s or lag_bytes > max_bytes:
                    self.forwarder.drop(
                        sub,
                        f"its acks held the change log's purge floor {lag_s:.0f} s and "
                        f"{lag_bytes} bytes behind (at most {max_s:g} s and {max_bytes} bytes)",
                    )
                    continue
            held.append((sub.id, sub.acked))
        return held

    def _on_durable(self, watermark: str) -> None:
        self._backoff.reset()  # progress
        self.backups.on_durable(watermark, self.storer.stored_bytes)
        self.acker.track_change_log(watermark)
        for listener in self.durable_listeners:
            listener(watermark)

    # ------------------------------------------------------------------
    # What pages and exporters read.

    def snapshot(self) -> ServiceSnapshot:
        """The service's state now (``app.streamer.snapshot``), on its event loop."""
        return take_snapshot(self)

    @property
    def latest_lag_report(self) -> dict[str, Any] | None:
        """The newest lag report seen (what a subscriber that joins now starts with)."""
        return self._latest_lag_report

    @property
    def upstream_type(self) -> str:
        """The change source's kind (``postgres``, ``custom``, ``demo``, …)."""
        return self._source.upstream_type

    async def upstream_stats(self) -> dict[str, Any]:
        """``/statz``'s ``upstream`` group: what the change source says of itself."""
        return await self._source.stats()

    async def upstream_metrics(self) -> list[SourceMetric]:
        """What the change source adds to ``/metrics`` (``ChangeSource.metrics``)."""
        return await self._source.metrics()

    async def get_change_log_state(self) -> ChangeLogState:
        return await self.replication.change_log_state()


class _CleanStop(Exception):
    """The change-log schema disappeared: stop without an error."""


def _is_fatal(error: BaseException) -> bool:
    return isinstance(error, (AbortError, UnrecoverableError, _CleanStop))


def _is_missing_table(error: BaseException) -> bool:
    """Postgres undefined_table: the change-log schema was dropped under us.

    Raised through SQLAlchemy (wrapped) or by the driver directly (the hot paths).
    """
    cause = error.orig if isinstance(error, DBAPIError) else error
    return getattr(cause, "sqlstate", None) == "42P01"


def _bookend(body: dict[str, Any], tag: str, watermark: str) -> str:
    """The message text of a begin or commit. Most bodies are just ``{"tag": tag}``,
    whose text needs no serializer; the message around the body is a fixed frame
    (watermarks are LexiVersions: nothing to escape), byte-identical to serializing
    the whole tuple."""
    if len(body) == 1 and body.get("tag") == tag:
        change_json = '{"tag":"' + tag + '"}'
    else:
        change_json = dumps(body)
    return reconstruct(watermark, tag, change_json)
