"""Catch-up of subscribers from the change log (spec/core.md §3.3, ARCHITECTURE
decision 2; docs/architecture.md decisions 11, 40, 43).

``Catchups.catchup`` is called (``service.subscribe``: ``storer.catchups``) in the same
synchronous step as ``Forwarder.add``. At that point the last commit *enqueued*
is exactly the boundary between what the subscriber must read from the log and
what reaches it live, so that watermark is its upper bound; the catch-up task
waits until the bound is durable, then reads ``[S, bound]`` in batches. A
subscriber that joins mid-transaction is parked until the transaction ends — by
commit, rollback *or abort* (the reference leaves it hanging on abort,
spec/core.md §8 B1) — and its bound includes the commit if there was one.

What it needs from the group-commit side is explicit and small: ``boundary``
(the bound a catch-up asked for now gets, or None while it must be parked),
``wait_durable``, the change log to read, and the in-memory tail of the last
durable transactions. The storer in turn tells it when parked catch-ups may go
(``release_parked``) or never will (``fail_parked``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from app.progress import Job, ProgressView
from app.protocol.codec import change_tag, reconstruct
from app.protocol.errors import ErrorType
from app.protocol.lexi import watermark_fraction
from app.protocol.pieces import LARGE_TEXT_CHARS
from app.stop_signals import AutoResetSignal
from app.storage import ChangeLog, StoredRow
from app.streamer.histogram import CATCHUP_BOUNDS_S, Histogram
from app.streamer.subscriber import Change, Mode, Subscriber, new_change
from app.streamer.tail import LogTail
from app.streamer.timers import Timers

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


class StorerStopped(Exception):
    """The storer stopped before a subscriber's catch-up bound became durable."""


class WaitDurable(Protocol):
    """``Storer.wait_durable``: returns once ``watermark`` is durable, raises
    ``StorerStopped`` if it won't be (its stream ended first, or ``sub`` closed)."""

    def __call__(self, watermark: str, *, sub: Subscriber | None = None) -> Awaitable[None]: ...


@dataclass(slots=True)
class _Catchup:
    sub: Subscriber
    started: float  # when it was asked for (Timers.monotonic)
    task: asyncio.Task[None] | None = None
    job: Job | None = None  # its progress, once the read is under way


class Catchups:
    """The catch-ups of one storer: parked, waiting for durability or a turn, reading."""

    def __init__(
        self,
        *,
        change_log: ChangeLog,
        tail: LogTail,
        boundary: Callable[[], str | None],
        wait_durable: WaitDurable,
        replica_version: str,
        timers: Timers,
        on_fatal: Callable[[BaseException], None],
        batch: int = CATCHUP_BATCH,
        max_concurrent: int = MAX_CONCURRENT_CATCHUPS,
    ) -> None:
        self._log = change_log
        self._tail = tail
        self._boundary = boundary
        self._wait_durable = wait_durable
        self._replica_version = replica_version
        self._timers = timers
        self._on_fatal = on_fatal
        self._batch = batch
        # Catch-ups asked for mid-transaction or before the log is owned; read by
        # the storer once per transaction (empty in the usual case), never changed
        # from outside.
        self.parked: list[_Catchup] = []
        self._tasks: set[asyncio.Task[None]] = set()
        # Catch-ups reading a batch of the log at once; the rest wait their turn
        # (FIFO), so a crowd of (re)connecting subscribers cannot take the loop from
        # the live stream, and one that leaves while waiting costs no read at all.
        # A turn is one batch, not a whole catch-up: a subscriber that does not read
        # what it was sent waits for that outside its turn, so it cannot hold one.
        self._reading = asyncio.Semaphore(max_concurrent)
        # Catch-ups that last a few seconds show their progress (a bar on a terminal,
        # log lines otherwise); started with the first catch-up.
        self.progress = ProgressView()
        self.from_memory = 0
        self.from_log = 0
        # From request to the end of the read (waits for durability and for a turn
        # included): for /metrics.
        self.seconds = Histogram(CATCHUP_BOUNDS_S)

    @property
    def running(self) -> int:
        """Catch-up tasks not yet ended (waiting for durability or a turn, or reading)."""
        return len(self._tasks)

    def catchup(self, sub: Subscriber, mode: Mode) -> None:
        """Catches ``sub`` up to the stream position of this very call (module doc)."""
        request = _Catchup(sub, self._timers.monotonic())
        # A backlog that passes its hard bound is dropped; the next round reads it.
        # (Without ``sub`` in it: a cycle would keep a closed subscriber for the GC.)
        sub.catch_up_again = partial(self.catchup, mode=mode)
        up_to = self._boundary()
        if up_to is None:
            self.parked.append(request)
        else:
            self._start(request, up_to)

    def release_parked(self, up_to: str) -> None:
        """The transaction they waited for ended: parked catch-ups start, to ``up_to``."""
        parked, self.parked = self.parked, []
        for request in parked:
            self._start(request, up_to)

    def fail_parked(self, error: StorerStopped) -> None:
        """Parked catch-ups can no longer be served: their subscribers reconnect."""
        parked, self.parked = self.parked, []
        for request in parked:
            request.sub.fail(error)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.progress.stop()

    def _start(self, request: _Catchup, up_to: str) -> None:
        request.sub.catchup_to = up_to
        self.progress.start()
        task = asyncio.create_task(self._run(request, up_to), name=f"catchup-{request.sub.id}")
        request.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _batches(self, start: str, up_to: str) -> AsyncGenerator[list[StoredRow], None]:
        """The log's rows from ``start``'s transaction through ``up_to``, in batches
        that start small and double: from memory while the tail holds them all."""
        first = min(CATCHUP_FIRST_BATCH, self._batch)
        held = self._tail.rows_from(start, up_to)
        if held is None:
            self.from_log += 1
            return self._log.read(
                start,
                up_to,
                batch_size=self._batch,
                first_batch=first,
                # A large change comes back in pieces, never whole (decision 44).
                pieces_over=LARGE_TEXT_CHARS,
            )
        self.from_memory += 1
        return _ramped(held, first, self._batch)

    async def _run(self, request: _Catchup, up_to: str) -> None:
        sub = request.sub
        start = sub.watermark
        try:
            await self._wait_durable(up_to, sub=sub)
            if sub.closed:
                return
            job = Job(f"catch-up of {sub.id}", unit="changes", context=sub.log_fields)
            request.job = self.progress.add(job)
            await self._read_for(sub, start, up_to, job)
            if not sub.closed:  # read to its end (not refused, not gone)
                self.seconds.observe(self._timers.monotonic() - request.started)
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

    async def _read_for(self, sub: Subscriber, start: str, up_to: str, job: Job) -> None:
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
                skip = _own_rows(batch, start)
                found = found or skip > 0
                if not found and skip < len(batch):
                    _refuse_too_old(sub, start, batch[skip][0])
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


def _own_rows(batch: list[StoredRow], start: str) -> int:
    """How many rows at the batch's start are of transaction ``start``."""
    skip = 0
    while skip < len(batch) and batch[skip][0] == start:
        skip += 1
    return skip


def _refuse_too_old(sub: Subscriber, start: str, earliest: str) -> None:
    # Whatever the mode: zero's storer resets the service for a backup-mode
    # subscriber here (its own backup replicator), but ours follows the log in a
    # child process (app.runtime.log_follower, which fails with exit code 3 on its
    # own), so a backup-mode subscriber comes from the network, and nothing a client
    # says may stop or reset the service (issue 25).
    sub.close(
        ErrorType.WATERMARK_TOO_OLD,
        f"earliest supported watermark is {earliest} (requested {start})",
    )


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
