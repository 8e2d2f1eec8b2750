"""One subscriber: its position, its catch-up backlog, its acks.

A subscriber starts at the watermark its replica is at. Until catch-up from the
change log is done, live changes go to a backlog (bounded by bytes: at the high
water mark the live send returns a gate that opens at the low water mark, which
is how a catching-up subscriber eventually holds up flow control). Live batches,
catch-up batches and then the backlog are all emitted by ``_emit``, through one
filter (``select_live``: ``watermark <= self.watermark ⇒ drop``, plus the tags its
protocol version does not know), which is what makes the catch-up → live handoff
duplicate-free.

The gate bounds the backlog only where flow control waits on it: not for a
subscriber that has acked nothing yet (one still waiting for a catch-up slot, or
one that never reads), nor once a consensus timeout went on without it. So the
backlog also has a hard bound (twice high water, or ``max_backlog_changes``
changes: each costs the subscriber a slot even though the change is shared).
Past it the backlog is dropped and the subscriber takes no more live changes;
when its catch-up round ends it starts another, from its watermark to the
stream's position then, with a fresh backlog (``catch_up_again``, set by the
storer): what was dropped is read from the change log, which holds all of it.

``acked`` advances only when a *commit* message is consumed (acked by the
client); it is the subscriber's durable position and feeds the purge floor.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any, Literal, NamedTuple

from app import speedups
from app.flow_gate import HighLowGate
from app.logs import log_extra
from app.protocol.errors import ErrorType, error_message_json
from app.protocol.pieces import Text
from app.protocol.subscription_messages import status_json
from app.streamer.downstream import Downstream

log = logging.getLogger(__name__)

Mode = Literal["serving", "backup"]

BACKLOG_HIGH_WATER = 16 * 1024 * 1024
BACKLOG_LOW_WATER_FRACTION = 0.8
# The backlog's hard bound: this times high water in bytes, or this many changes.
BACKLOG_MAX_FACTOR = 2
BACKLOG_MAX_CHANGES = 16_384
# The backlog is emitted in chunks of about this many bytes.
DRAIN_CHUNK_BYTES = 256 * 1024
# A closing error is delivered in-band first; a client that does not ack it within
# this long (it stopped reading, say) has its channel closed anyway.
ERROR_DELIVERY_S = 5.0
# Protocol versions below 5 do not know this tag (spec/source.md §1.9).
_MIN_VERSION: dict[str, int] = {"update-table-metadata": 5}


class Change(NamedTuple):
    """One message of the stream, as every stage takes it: its transaction's
    watermark, its tag (begin, commit, rollback, or the data change's) and the
    message's JSON text (``["data",{…}]``; the change log stores the change object
    cut out of it, ``Storer.append``), in pieces when it is large (``Pieces``)."""

    watermark: str
    tag: str
    json: Text


def new_change(watermark: str, tag: str, json: Text) -> Change:
    """``Change(watermark, tag, json)`` without NamedTuple's generated Python
    ``__new__`` (~0.2 against ~0.4-0.6 us): for the per-transaction paths."""
    return _tuple_new(Change, (watermark, tag, json))


_tuple_new = tuple.__new__


def _select_live_py(
    changes: list[Change],
    watermark: str,
    unsupported: frozenset[str],
    pushed: int,
    texts: list[Text],
    commits: deque[tuple[int, str]],
) -> str:
    """What a subscriber at ``watermark`` takes of a batch (live, caught up or
    drained from its backlog): appends
    the texts to ``texts`` and (message number, watermark) of each commit to
    ``commits`` (messages numbered on from ``pushed``); returns the new watermark.
    ``app/streamer/_fanout.c`` is the same in C (it runs per change per subscriber)."""
    for change in changes:
        if change.watermark <= watermark or change.tag in unsupported:
            continue
        texts.append(change.json)
        if change.tag == "commit":
            watermark = change.watermark
            commits.append((pushed + len(texts), watermark))
    return watermark


select_live: Callable[
    [list[Change], str, frozenset[str], int, list[Text], deque[tuple[int, str]]], str
]
# C unless not built here or CHANGESTREAMER_SPEEDUPS=0 (same results, slower).
_fanout = speedups.module("fanout")
select_live = _select_live_py if _fanout is None else _fanout.select_live


def subscriber_log_fields(
    id: str, task_id: str | None, mode: Mode, protocol_version: int
) -> dict[str, object]:
    """What every log line about a subscriber carries (``app.logs``), as zero-cache's
    ``subscriber`` context: its id, its view-syncer task (if it said), mode, protocol."""
    fields: dict[str, object] = {"subscriber": id}
    if task_id:
        fields["task"] = task_id
    fields["mode"] = mode
    fields["protocol"] = protocol_version
    return fields


class Subscriber:
    def __init__(
        self,
        *,
        id: str,
        protocol_version: int,
        watermark: str,
        mode: Mode,
        downstream: Downstream,
        latest_lag_report: Callable[[], dict[str, object] | None],
        high_water: int = BACKLOG_HIGH_WATER,
        max_backlog_changes: int = BACKLOG_MAX_CHANGES,
        task_id: str | None = None,
    ) -> None:
        self.id = id
        self.task_id = task_id  # the view-syncer task it says it belongs to, if any
        self.protocol_version = protocol_version
        self.mode = mode
        self.watermark = watermark
        self.acked = watermark
        # Catch-up: from the watermark it came with to the bound the storer reads up
        # to (set when the read starts; /statz and /dashboard show the progress).
        self.catchup_from = watermark
        self.catchup_to: str | None = None
        self.downstream = downstream
        self._latest_lag_report = latest_lag_report
        self._unsupported = frozenset(t for t, v in _MIN_VERSION.items() if protocol_version < v)
        # Closed while the backlog is at high water, until it is back at low water.
        self._gate = HighLowGate(high_water, int(high_water * BACKLOG_LOW_WATER_FRACTION))
        self._max_backlog_bytes = high_water * BACKLOG_MAX_FACTOR
        self._max_backlog_changes = max_backlog_changes
        self._backlog: deque[Change] | None = deque()
        self._backlog_bytes = 0
        # The backlog passed its hard bound: live changes are not kept until the
        # next catch-up round (``catch_up_again``) reads them from the change log.
        self._backlog_dropped = False
        self.backlog_drops = 0
        # Starts another catch-up round to the stream's position (the storer sets it).
        self.catch_up_again: Callable[[Subscriber], None] | None = None
        self._drain_bytes = 0  # drained from the backlog, not yet consumed
        self._drain_task: asyncio.Task[None] | None = None
        # The drain's own pause: drained-but-unconsumed bytes at high water, until low.
        self._room = HighLowGate(high_water, int(high_water * BACKLOG_LOW_WATER_FRACTION))
        self._initialized = False
        self._closed = False
        # Commits pushed and not yet consumed: (message number, watermark).
        self._commits: deque[tuple[int, str]] = deque()
        # Flow-control bookkeeping (broadcast / laggard detection).
        self.missed_last_timeout = False
        self.missed_releases = 0  # consensus-timeout releases that went on without it
        self.lagging_since: float | None = None
        downstream.on_close(self._on_downstream_closed)
        downstream.on_consumed(self._on_consumed)

    # -- state --------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def backlogged(self) -> bool:
        """Still catching up (live changes go to the backlog)."""
        return self._backlog is not None

    @property
    def backlog_size(self) -> int:
        return 0 if self._backlog is None else len(self._backlog)

    @property
    def buffered_bytes(self) -> int:
        return self._backlog_bytes + self._drain_bytes

    @property
    def started(self) -> bool:
        """Its first message (the status, or a v1 subscriber's first change) was sent."""
        return self._initialized

    @property
    def processed(self) -> int:
        return self.downstream.consumed

    @property
    def unacked_commits(self) -> int:
        """Transactions sent to it and not acked yet."""
        return len(self._commits)

    # -- live path ----------------------------------------------------------

    def send(self, changes: list[Change], *, track: bool = False) -> asyncio.Future[Any] | None:
        """Live changes, in stream order. With ``track``, returns what flow control
        waits on for the last one, if anything.

        Emitted directly: the consumption of the last change (None if this
        subscriber does not take it). In catch-up: None while the backlog is below
        high water, else the gate that opens at low water (returned whether tracked
        or not: it is also the backlog's bound).
        """
        if self._closed:
            return None
        backlog = self._backlog
        if backlog is None:
            return self._emit(changes, track=track)
        if self._backlog_dropped:
            return None
        watermark = self.watermark
        size = 0
        for change in changes:
            if change.watermark > watermark:
                backlog.append(change)
                size += len(change.json)
        self._backlog_bytes += size
        if self._backlog_bytes >= self._max_backlog_bytes or (
            len(backlog) > self._max_backlog_changes
        ):
            self._drop_backlog()
            return None
        return self._gate.wait() if self._gate.rise(self.buffered_bytes) else None

    def send_status(self) -> None:
        """Forwards the latest lag report; ignored before the initial status was sent."""
        if self._initialized and not self._closed and self.protocol_version >= 2:
            self.downstream.push([status_json(self._latest_lag_report())])

    # -- catch-up path ------------------------------------------------------

    def catchup(self, changes: list[Change]) -> asyncio.Future[bool] | None:
        """Changes read from the change log; returns the consumption of the last one
        this subscriber takes (the caller waits on it before reading much more)."""
        self._initialize()
        return self._emit(changes, track=True)

    def set_caught_up(self) -> None:
        """Catch-up is done: drain the backlog (bounded in flight), then go live."""
        self._initialize()
        if self._closed or self._drain_task is not None:
            return
        self._drain_task = asyncio.create_task(self._drain(), name=f"drain-{self.id}")

    async def _drain(self) -> None:
        # Emit the backlog oldest first, in chunks, keeping at most high-water bytes
        # emitted but unconsumed. Live sends keep appending meanwhile, preserving order.
        backlog = self._backlog
        assert backlog is not None
        while backlog and not self._closed:
            chunk: list[Change] = []
            size = 0
            while backlog and size < DRAIN_CHUNK_BYTES:
                change = backlog.popleft()
                chunk.append(change)
                size += len(change.json)
            self._backlog_bytes -= size
            consumed = self._emit(chunk, track=True)
            if consumed is not None:
                self._drain_bytes += size
                consumed.add_done_callback(partial(self._drained, size))
            self._maybe_open_gate()
            if self._room.rise(self._drain_bytes):
                await self._room.opened()
        if self._closed:
            return
        if self._backlog_dropped:  # what it dropped is in the change log: read it
            self._backlog_dropped = False
            self._drain_task = None
            self.catchup_from = self.watermark
            if self.catch_up_again is not None:
                self.catch_up_again(self)  # its bound is now, and the backlog collects from now
            return
        self._backlog = None
        self._maybe_open_gate(force=True)

    def _drop_backlog(self) -> None:
        backlog = self._backlog
        assert backlog is not None
        log.info(
            "subscriber %s: its catch-up backlog passed %d changes or %d bytes; "
            "it reads them from the change log after this catch-up round",
            self.id,
            self._max_backlog_changes,
            self._max_backlog_bytes,
            extra=self.log_extra,
        )
        backlog.clear()
        self._backlog_bytes = 0
        self._backlog_dropped = True
        self.backlog_drops += 1
        self._maybe_open_gate(force=True)  # nothing is held for it now

    def _drained(self, size: int, _consumed: asyncio.Future[bool]) -> None:
        self._drain_bytes -= size
        self._room.fall(self._drain_bytes)
        self._maybe_open_gate()

    def _maybe_open_gate(self, *, force: bool = False) -> None:
        if force:
            self._gate.open()
        else:
            self._gate.fall(self.buffered_bytes)

    # -- emitting -----------------------------------------------------------

    def _initialize(self) -> None:
        if self._initialized:
            return
        self._initialized = True
        if self.protocol_version >= 2 and not self._closed:
            self.downstream.push([status_json(self._latest_lag_report())])

    def _emit(self, changes: list[Change], *, track: bool) -> asyncio.Future[bool] | None:
        """Pushes what this subscriber takes of ``changes`` (``select_live``); with
        ``track``, returns the consumption of the last change if it was taken."""
        if self._closed or not changes:
            return None
        texts: list[Text] = []
        before = self.watermark
        after = self.watermark = select_live(
            changes, before, self._unsupported, self.downstream.pushed, texts, self._commits
        )
        if track:
            last = changes[-1]
            if last.tag == "commit":  # taken: it moved the watermark to its own
                track = after == last.watermark and before < after
            else:
                track = last.watermark > after and last.tag not in self._unsupported
        return self.downstream.push(texts, track=track)

    def _on_consumed(self, consumed: int) -> None:
        """Acks arrived: the newest consumed commit is the acked watermark."""
        commits = self._commits
        acked = None
        while commits and commits[0][0] <= consumed:
            acked = commits.popleft()[1]
        if acked is not None and acked > self.acked:
            self.acked = acked

    # -- closing ------------------------------------------------------------

    def close(self, error_type: ErrorType | None = None, message: str = "") -> None:
        """Ends the subscription; with an error type, sends it first (in-band)."""
        if self._closed:
            return
        if error_type is None or error_type == ErrorType.UNKNOWN:
            # Type 0 is never sent (spec/core.md §8 B2): a silent close makes the
            # client reconnect instead of wiping its replica.
            self.downstream.close(message or None)
            return
        self._stop_buffering()
        sent = self.downstream.push([error_message_json(error_type, message)], track=True)
        self._closed = True
        sent.add_done_callback(lambda _: self.downstream.close(message))
        asyncio.get_running_loop().call_later(ERROR_DELIVERY_S, self.downstream.close, message)

    @property
    def log_fields(self) -> dict[str, object]:
        return subscriber_log_fields(self.id, self.task_id, self.mode, self.protocol_version)

    @property
    def log_extra(self) -> dict[str, object]:
        """``extra=`` for a line about this subscriber logged outside its connection's
        tasks (the forwarder's timers, a catch-up); built only when a line is."""
        return log_extra(self.log_fields)

    def fail(self, error: BaseException) -> None:
        """Drops the subscriber silently; it will reconnect and resume."""
        log.info("subscriber %s dropped: %s", self.id, error, extra=self.log_extra)
        self.close(None, str(error))

    def _on_downstream_closed(self) -> None:
        self._closed = True
        self._stop_buffering()

    def _stop_buffering(self) -> None:
        if self._backlog is not None:
            self._backlog.clear()
        self._backlog_bytes = 0
        self._drain_bytes = 0
        self._room.open()
        self._maybe_open_gate(force=True)
        # Let go of the task too: a cancelled one keeps its CancelledError, whose
        # traceback holds the drain's frame and so this subscriber, in a cycle.
        drain, self._drain_task = self._drain_task, None
        if drain is not None and not drain.done():
            drain.cancel()
