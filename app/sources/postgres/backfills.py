"""Backfills interleaved with the replication stream (spec/source.md §1.8, §5.4).

A table added to a publication, or a column whose values the replica cannot make
itself (a volatile default), arrives as a schema change with a ``backfill`` field:
the replica creates it hidden, and the data follows as ``backfill`` batches read
from a snapshot (:mod:`~app.sources.postgres.backfill_stream`), closed by
``backfill-completed``. :class:`BackfillManager` does the bookkeeping and the
scheduling; the replication stream asks it for work between its own transactions.

* **What is owed.** The requests the stream was started with (the change DB keeps
  unfinished ones across restarts), plus what the stream's schema changes ask for,
  kept current as tables and columns are renamed or dropped and as backfills
  complete (:meth:`observe`).
* **One at a time.** A backfill is picked at random (so one that keeps failing, a
  table without a primary key say, cannot hold the others up) and read by a task
  that keeps at most :data:`QUEUED_BATCHES` batches ready. A failure is retried
  with exponential backoff (2 s to 60 s). A schema change that invalidates the
  running backfill cancels it; it starts again at a new snapshot.
* **Fairness.** The stream calls :meth:`transaction` only between its own
  transactions. Backfill batches go when the upstream has nothing waiting, or when
  they have waited :data:`PRIORITY_WAIT_S` (so a busy upstream cannot starve them);
  a transaction carries at most what is ready, so it delays the live stream by at
  most a few batches.
* **Versions.** A backfill transaction's watermark is the last one streamed with
  its minor part + 1 (``4d7lu8`` → ``4d7lu8.01``): after everything streamed
  before it, before the next upstream commit. It has ``skipAck`` (it is no
  upstream position). ``backfill-completed`` waits until the stream has passed the
  snapshot's LSN, and its transaction is at least that version, so the replica's
  version never predates the backfilled rows.
* **Changed keys.** An update that changes a row's key while its table is being
  backfilled is seen by the replica as a delete and an insert, and the backfill
  cannot know the new row; batches read before that update are dropped and the
  backfill starts over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from app.protocol.lexi import StateVersion, parse_state_version
from app.protocol.messages import Begin, ChangeSourceMessage, Commit, Data
from app.sources.base import BackfillRequest

__all__ = ["BackfillManager", "BackfillReader"]

log = logging.getLogger(__name__)

# Batches a running backfill keeps read ahead of the stream (each ~256 KiB of COPY).
QUEUED_BATCHES: Final = 4
# A ready batch waits at most this long for an upstream that always has more.
PRIORITY_WAIT_S: Final = 1.0
MIN_BACKOFF_S: Final = 2.0
MAX_BACKOFF_S: Final = 60.0

_BEGIN_BODY: Final = {"tag": "begin", "json": "s", "skipAck": True}

# Reads one request: its backfill message bodies, then backfill-completed.
BackfillReader = Callable[[BackfillRequest], AsyncGenerator[dict[str, Any], None]]
TableKey = tuple[str, str]


class MissingRowKeyError(Exception):
    """A non-empty table without a row key cannot be backfilled (retries would
    duplicate rows); retried until a key is added or the table is emptied."""


@dataclass(slots=True)
class _Running:
    request: BackfillRequest
    key: TableKey
    ready: deque[tuple[dict[str, Any], float]] = field(default_factory=deque)
    room: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    min_watermark: str = ""
    canceled: str | None = None


class BackfillManager:
    def __init__(
        self,
        reader: BackfillReader,
        *,
        wake: Callable[[], None],
        min_backoff_s: float = MIN_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        priority_wait_s: float = PRIORITY_WAIT_S,
    ) -> None:
        self._reader = reader
        self._wake = wake
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._backoff_s = min_backoff_s
        self._priority_wait_s = priority_wait_s
        self._required: dict[TableKey, BackfillRequest] = {}
        self._running: _Running | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._reached = ""  # the furthest position the stream has passed
        self._tx: str | None = None  # the upstream transaction being streamed
        self._closed = False

    # -- lifecycle --------------------------------------------------------

    def start(self, last_watermark: str, requests: list[BackfillRequest]) -> None:
        self._reached = last_watermark
        for request in requests:
            self._set("resumed", request)
        self._check_and_start()

    async def close(self) -> None:
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        await self._stop("the stream closed")

    @property
    def required(self) -> list[BackfillRequest]:
        return list(self._required.values())

    @property
    def running_table(self) -> TableKey | None:
        """The table being backfilled: updates to it are worth a look (:meth:`observe`)."""
        r = self._running
        return r.key if r is not None else None

    # -- what the stream passes ---------------------------------------------

    def on_begin(self, watermark: str) -> None:
        self._tx = watermark

    def on_commit(self, watermark: str) -> None:
        self._tx = None
        self.on_position(watermark)
        self._check_and_start()

    def on_position(self, watermark: str) -> None:
        if watermark > self._reached:
            self._reached = watermark

    def observe(self, change: Data) -> None:
        """Keeps the required backfills current with a change the stream carries."""
        handler = _HANDLERS.get(change.tag)
        if handler is not None:
            handler(self, change.body)

    # -- the stream's turn ------------------------------------------------------

    def transaction(self, last_watermark: str, upstream_waiting: bool) -> list[ChangeSourceMessage]:
        """A backfill transaction to stream now (begin, data…, commit), or nothing.

        ``last_watermark``: the last commit streamed (upstream's or a backfill's);
        ``upstream_waiting``: whether upstream messages are waiting to be read."""
        r = self._running
        if r is None or not r.ready:
            return []
        if upstream_waiting and time.monotonic() - r.ready[0][1] < self._priority_wait_s:
            return []
        last = parse_state_version(last_watermark)
        tx = str(StateVersion(last.major, (last.minor or 0) + 1))
        data: list[ChangeSourceMessage] = []
        while r.ready and r is self._running:
            body = r.ready[0][0]
            if body["tag"] == "backfill" and body["watermark"] < r.min_watermark:
                self._cancel(
                    f"a row key changed at {r.min_watermark}, after the backfill's snapshot at "
                    f"{body['watermark']}"
                )
                break
            if body["tag"] == "backfill-completed":
                snapshot = body["watermark"]
                if self._reached < snapshot:
                    break  # the stream passes the snapshot's LSN soon: then it completes
                if data and tx < snapshot:
                    break  # it needs a transaction of its own, at the snapshot's version
                tx = max(tx, snapshot)
            r.ready.popleft()
            message = Data(body, body["tag"])
            data.append(message)
            self.observe(message)  # a completion updates what is owed
        if r is self._running:
            r.room.set()
        if not data:
            return []
        return [Begin(dict(_BEGIN_BODY), tx, True), *data, Commit({"tag": "commit"}, tx)]

    # -- bookkeeping ----------------------------------------------------------

    def _set(self, why: str, request: BackfillRequest) -> None:
        key = _key(request["table"])
        action = "updated" if key in self._required else "added"
        log.info("backfill %s (%s): %s.%s %s", action, why, *key, list(request["columns"]))
        self._required[key] = request

    def _drop(self, why: str, key: TableKey) -> None:
        if self._required.pop(key, None) is not None:
            log.info("backfill of %s.%s %s", *key, why)

    def _cancel(self, reason: str, key: TableKey | None = None) -> None:
        r = self._running
        if r is None or (key is not None and r.key != key):
            return
        log.info("backfill of %s.%s canceled: %s", *r.key, reason)
        r.canceled = reason
        self._running = None
        if r.task is not None:
            r.task.cancel()
        if r.task is None or r.task.done():
            # Its reader had read to the end: no done callback is coming to start it
            # again (a key change voiding the queued batches of a small table).
            self._check_and_start()

    async def _stop(self, reason: str) -> None:
        r = self._running
        self._cancel(reason)
        if r is not None and r.task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await r.task

    def _check_and_start(self) -> None:
        if self._closed or self._running is not None or self._retry is not None:
            return
        if not self._required:
            return
        request = random.choice(list(self._required.values()))
        r = _Running(request, _key(request["table"]))
        r.room.set()
        r.task = asyncio.create_task(self._read(r), name=f"backfill {r.key[0]}.{r.key[1]}")
        r.task.add_done_callback(lambda t: self._read_ended(r, t))
        self._running = r

    async def _read(self, r: _Running) -> None:
        batches = self._reader(r.request)
        try:
            async for body in batches:
                if (
                    body["tag"] == "backfill"
                    and body["rowValues"]
                    and not body["relation"]["rowKey"]["columns"]
                ):
                    table = r.request["table"]
                    raise MissingRowKeyError(
                        f"cannot backfill {table['schema']}.{table['name']}: "
                        "it has rows but no PRIMARY KEY or unique index"
                    )
                while len(r.ready) >= QUEUED_BATCHES:
                    r.room.clear()
                    await r.room.wait()
                r.ready.append((body, time.monotonic()))
                self._wake()
        finally:
            await batches.aclose()

    def _read_ended(self, r: _Running, task: asyncio.Task[None]) -> None:
        if task.cancelled() or r.canceled is not None:
            self._check_and_start()
            return
        error = task.exception()
        if error is None:
            self._backoff_s = self._min_backoff_s  # read to the end; completes when streamed
            return
        if self._running is r:
            self._running = None
        level = logging.ERROR if self._backoff_s >= self._max_backoff_s else logging.WARNING
        log.log(level, "backfill failed, retrying in %.0f s: %s", self._backoff_s, error)
        self._retry = asyncio.get_running_loop().call_later(self._backoff_s, self._retry_now)
        self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)

    def _retry_now(self) -> None:
        self._retry = None
        self._check_and_start()

    # -- schema changes (what the reference's BackfillManager listens to) ------

    def _on_create_table(self, body: Mapping[str, Any]) -> None:
        backfill = body.get("backfill")
        if backfill:
            spec = body["spec"]
            table = {"schema": spec["schema"], "name": spec["name"]}
            request = {"table": {**table, "metadata": body.get("metadata")}, "columns": backfill}
            self._set("create-table", request)

    def _on_add_column(self, body: Mapping[str, Any]) -> None:
        backfill = body.get("backfill")
        if not backfill:
            return
        table = body["table"]
        key = _key(table)
        existing = self._required.get(key)
        columns = dict(existing["columns"]) if existing is not None else {}
        columns[body["column"]["name"]] = backfill
        # A running backfill of other columns goes on; this one follows it.
        metadata = body.get("tableMetadata")
        self._set("add-column", {"table": {**table, "metadata": metadata}, "columns": columns})

    def _on_update_table_metadata(self, body: Mapping[str, Any]) -> None:
        key = _key(body["table"])
        existing = self._required.get(key)
        if existing is not None:
            table = {**existing["table"], "metadata": body["new"]}
            self._set("update-table-metadata", {**existing, "table": table})
            self._cancel("the table's metadata changed", key)

    def _on_rename_table(self, body: Mapping[str, Any]) -> None:
        old, new = _key(body["old"]), _key(body["new"])
        existing = self._required.pop(old, None)
        if existing is not None:
            table = {**existing["table"], "schema": new[0], "name": new[1]}
            self._set("rename-table", {**existing, "table": table})
            self._cancel("the table was renamed", old)

    def _on_drop_table(self, body: Mapping[str, Any]) -> None:
        key = _key(body["id"])
        self._drop("dropped: the table was dropped", key)
        self._cancel("the table was dropped", key)

    def _on_update_column(self, body: Mapping[str, Any]) -> None:
        old, new = body["old"]["name"], body["new"]["name"]
        key = _key(body["table"])
        existing = self._required.get(key)
        if old == new or existing is None or old not in existing["columns"]:
            return
        columns = {(new if c == old else c): v for c, v in existing["columns"].items()}
        self._set("update-column", {**existing, "columns": columns})
        r = self._running
        if r is not None and r.key == key and old in r.request["columns"]:
            self._cancel(f"column {old} was renamed", key)

    def _on_drop_column(self, body: Mapping[str, Any]) -> None:
        key = _key(body["table"])
        column = body["column"]
        existing = self._required.get(key)
        if existing is None or column not in existing["columns"]:
            return
        remaining = {c: v for c, v in existing["columns"].items() if c != column}
        if remaining:
            self._set("drop-column", {**existing, "columns": remaining})
        else:
            self._drop("dropped: its last column was dropped", key)
        r = self._running
        if r is not None and r.key == key and column in r.request["columns"]:
            self._cancel(f"column {column} was dropped", key)

    def _on_update(self, body: Mapping[str, Any]) -> None:
        r = self._running
        key = body.get("key")
        if r is None or key is None or self._tx is None or _key(body["relation"]) != r.key:
            return
        metadata = r.request["table"].get("metadata") or {}
        new = body.get("new") or {}
        for column in metadata.get("rowKey") or ():
            if key.get(column) != new.get(column):
                r.min_watermark = max(r.min_watermark, self._tx)
                log.info(
                    "a row key of %s.%s changed at %s: backfill data must not predate it",
                    *r.key,
                    self._tx,
                )
                return

    def _on_backfill_completed(self, body: Mapping[str, Any]) -> None:
        relation = body["relation"]
        key = _key(relation)
        done = {*body["columns"], *relation["rowKey"]["columns"]}
        existing = self._required.get(key)
        if existing is not None:
            remaining = {c: v for c, v in existing["columns"].items() if c not in done}
            if remaining:
                self._set("backfill-completed", {**existing, "columns": remaining})
            else:
                self._drop("completed", key)
        r = self._running
        if r is not None and r.key == key:
            self._running = None
            self._check_and_start()


def _key(table: Mapping[str, Any]) -> TableKey:
    return (str(table["schema"]), str(table["name"]))


_HANDLERS: Final[dict[str, Callable[[BackfillManager, Mapping[str, Any]], None]]] = {
    "create-table": BackfillManager._on_create_table,
    "add-column": BackfillManager._on_add_column,
    "update-table-metadata": BackfillManager._on_update_table_metadata,
    "rename-table": BackfillManager._on_rename_table,
    "drop-table": BackfillManager._on_drop_table,
    "update-column": BackfillManager._on_update_column,
    "drop-column": BackfillManager._on_drop_column,
    "update": BackfillManager._on_update,
    "backfill-completed": BackfillManager._on_backfill_completed,
}
