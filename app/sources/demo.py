"""A synthetic change source for the embedded default: a small issue tracker that keeps changing.

Each stream emits whole transactions at ``rate_per_s`` per second: inserts of new
issues and comments, and updates and deletes of rows it inserted earlier
(:mod:`app.sources.demo_ids`). Every ``status_every`` transactions it adds a
``status`` with ``ack: true`` so the upstream-ack path is exercised too. Every
message goes through :func:`parse_change_source_message`, exactly like custom-source
input.

Watermarks are LexiVersions of a 64-bit counter. A stream started after ``A`` begins
at ``max(high-water mark, A) + 1``, where the high-water mark is persisted in the
state file (:mod:`app.sources.demo_state`), so watermarks keep increasing across
restarts whether the change log is ahead of the file (file lost or old) or behind
it (change log restored or re-created).

The schema rule: the demo persists the commit watermark ``S`` of the transaction
that created its tables. A stream started after ``A`` first (re-)creates them when
there is no ``S`` yet or ``A < S``: the change log then cannot hold that
transaction (it is durable exactly up to ``A``), e.g. it was sent but never stored,
or the change log is older than the state file. Otherwise the tables exist and the
stream goes straight to row changes. The state file therefore belongs with the
change database: delete both or neither (with a state file lost but a change log
that has the tables, the demo would create them a second time).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

from app.protocol.lexi import parse_state_version, to_lexi
from app.protocol.messages import ChangeSourceMessage, parse_change_source_message
from app.sources.base import BackfillRequest, ChangeSource, ChangeSourceError, ChangeStream
from app.sources.demo_ids import LiveIds, RowOp
from app.sources.demo_state import DemoState, load_demo_state, save_demo_state

__all__ = ["DEMO_TABLES", "DemoChangeSource", "DemoChangeStream", "schema_changes"]

Sleep = Callable[[float], Awaitable[None]]
WallClockMs = Callable[[], float]

_SCHEMA: Final = "public"
# table -> column -> dataType, in column order; "id" is the primary key of each.
DEMO_TABLES: Final[dict[str, dict[str, str]]] = {
    "issues": {
        "id": "text",
        "title": "text",
        "status": "text",
        "priority": "int4",
        "modified": "timestamptz",  # float ms since the epoch, as the PG source sends it
    },
    "comments": {
        "id": "text",
        "issue_id": "text",
        "body": "text",
        "created": "timestamptz",
    },
}

_ADJECTIVES: Final = ("flaky", "slow", "broken", "missing", "confusing", "stale", "odd", "noisy")
_NOUNS: Final = ("login", "sync", "query", "cache", "upload", "search", "export", "sidebar")
_PROBLEMS: Final = ("fails", "hangs", "crashes", "is wrong", "times out", "flickers")
_STATUSES: Final = ("open", "in-progress", "review", "closed")
_REMARKS: Final = (
    "Can reproduce on main.",
    "Fixed in the latest build?",
    "Still happens after restart.",
    "Looks related to the cache change.",
    "Needs a test.",
    "Closing as duplicate.",
)


def _relation(table: str) -> dict[str, Any]:
    return {"schema": _SCHEMA, "name": table, "rowKey": {"columns": ["id"], "type": "default"}}


def schema_changes() -> list[dict[str, Any]]:
    """The ``create-table`` and ``create-index`` changes of the demo schema (spec §1.6)."""
    changes: list[dict[str, Any]] = []
    for table, columns in DEMO_TABLES.items():
        changes.append(
            {
                "tag": "create-table",
                "spec": {
                    "schema": _SCHEMA,
                    "name": table,
                    "columns": {
                        name: {"pos": pos, "dataType": data_type, "notNull": name == "id"}
                        for pos, (name, data_type) in enumerate(columns.items(), start=1)
                    },
                    "primaryKey": ["id"],
                },
                "metadata": {"rowKey": {"columns": ["id"]}},
            }
        )
        changes.append(
            {
                "tag": "create-index",
                "spec": {
                    "schema": _SCHEMA,
                    "tableName": table,
                    "name": f"{table}_pkey",
                    "unique": True,
                    "columns": {"id": "ASC"},
                },
            }
        )
    return changes


def _wall_ms() -> float:
    return time.time() * 1000.0


class DemoChangeSource(ChangeSource):
    """Generates transactions for one stream at a time (a new stream closes the old one)."""

    upstream_type = "demo"  # /statz upstream group

    def __init__(
        self,
        state_file: Path,
        *,
        rate_per_s: float = 50.0,
        rows_per_tx: tuple[int, int] = (1, 5),
        seed: int | None = None,
        status_every: int = 20,
        max_live_ids: int = 10_000,
        reserve_block: int = 1_000,
        sleep: Sleep = asyncio.sleep,
        wall_ms: WallClockMs = _wall_ms,
    ) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be positive, got {rate_per_s}")
        lo, hi = rows_per_tx
        if not 1 <= lo <= hi:
            raise ValueError(f"rows_per_tx must be (lo, hi) with 1 <= lo <= hi, got {rows_per_tx}")
        if status_every < 1 or reserve_block < 1 or max_live_ids < 1:
            raise ValueError("status_every, reserve_block and max_live_ids must be positive")
        self._state_file = state_file
        self._state: DemoState = load_demo_state(state_file)
        self._interval_s = 1.0 / rate_per_s
        self._rows_per_tx = (lo, hi)
        self._rng = random.Random(seed)
        self._status_every = status_every
        self._reserve_block = reserve_block
        self._sleep = sleep
        self._wall_ms = wall_ms
        self._last_watermark = self._state.reserved_through  # the last value handed out
        self._live = LiveIds(DEMO_TABLES, max_ids=max_live_ids, max_journal=max_live_ids)
        self._tx_count = 0
        self._stream: DemoChangeStream | None = None
        self._acked_watermark: str | None = None

    @property
    def acked_watermark(self) -> str | None:
        """The newest watermark acked on any stream of this source."""
        return self._acked_watermark

    async def start_stream(
        self, after_watermark: str, backfill_requests: list[BackfillRequest]
    ) -> DemoChangeStream:
        if backfill_requests:
            raise ChangeSourceError("the demo change source does not support backfill")
        after = parse_state_version(after_watermark).major
        if self._stream is not None:
            self._stream.close_nowait()
        self._last_watermark = max(self._last_watermark, after)
        self._live.restart_at(after)
        schema_at = self._state.schema_watermark
        stream = DemoChangeStream(
            self, create_schema=schema_at is None or after < schema_at, sleep=self._sleep
        )
        self._stream = stream
        return stream

    def _record_ack(self, watermark: str) -> None:
        self._acked_watermark = watermark
        self._live.confirm(parse_state_version(watermark).major)

    def _next_watermark(self) -> int:
        value = self._last_watermark + 1
        if value > self._state.reserved_through:
            # Persist before handing it out, a block at a time.
            self._state.reserved_through = value + self._reserve_block - 1
            save_demo_state(self._state_file, self._state)
        self._last_watermark = value
        return value

    def _schema_transaction(self) -> list[list[Any]]:
        watermark = self._next_watermark()
        self._state.schema_watermark = watermark
        save_demo_state(self._state_file, self._state)
        self._live.clear()
        return self._transaction(watermark, schema_changes())

    def _row_transaction(self) -> list[list[Any]]:
        watermark = self._next_watermark()
        ops: list[RowOp] = []
        changes = [
            self._row_change(watermark, i, ops)
            for i in range(self._rng.randint(*self._rows_per_tx))
        ]
        self._live.record(watermark, ops)
        messages = self._transaction(watermark, changes)
        self._tx_count += 1
        if self._tx_count % self._status_every == 0:
            messages.append(["status", {"ack": True}, {"watermark": to_lexi(watermark)}])
        return messages

    def _transaction(self, watermark: int, changes: list[dict[str, Any]]) -> list[list[Any]]:
        wm = to_lexi(watermark)
        return [
            ["begin", {"tag": "begin", "json": "p"}, {"commitWatermark": wm}],
            *(["data", change] for change in changes),
            ["commit", {"tag": "commit", "commitTimeMs": int(self._wall_ms())}, {"watermark": wm}],
        ]

    def _row_change(self, watermark: int, n: int, ops: list[RowOp]) -> dict[str, Any]:
        rng = self._rng
        table = "issues" if rng.random() < 0.6 else "comments"
        ids = self._live.working(table)
        roll = rng.random()
        if not ids or roll < 0.5:
            row = self._new_row(table, f"{table[0]}{to_lexi(watermark)}-{n}")
            ids.add(row["id"])
            ops.append(("insert", table, row["id"]))
            return {"tag": "insert", "relation": _relation(table), "new": row}
        row_id = ids.choice(rng)
        if roll < 0.85:
            return {
                "tag": "update",
                "relation": _relation(table),
                "key": None,
                # Only the changed columns: absent ones keep their value (spec §1.5).
                "new": {"id": row_id, **self._changed_columns(table)},
            }
        ids.discard(row_id)
        ops.append(("delete", table, row_id))
        return {"tag": "delete", "relation": _relation(table), "key": {"id": row_id}}

    def _new_row(self, table: str, row_id: str) -> dict[str, Any]:
        rng = self._rng
        if table == "issues":
            return {
                "id": row_id,
                "title": f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_PROBLEMS)}",
                "status": "open",
                "priority": rng.randint(1, 4),
                "modified": self._wall_ms(),
            }
        issues = self._live.working("issues")
        return {
            "id": row_id,
            "issue_id": issues.choice(rng) if issues else None,
            "body": rng.choice(_REMARKS),
            "created": self._wall_ms(),
        }

    def _changed_columns(self, table: str) -> dict[str, Any]:
        rng = self._rng
        if table == "issues":
            if rng.random() < 0.7:
                return {"status": rng.choice(_STATUSES), "modified": self._wall_ms()}
            return {"priority": rng.randint(1, 4), "modified": self._wall_ms()}
        return {"body": rng.choice(_REMARKS)}


class DemoChangeStream(ChangeStream):
    """One demo connection: validated messages until closed."""

    def __init__(self, source: DemoChangeSource, *, create_schema: bool, sleep: Sleep) -> None:
        self._source = source
        self._create_schema = create_schema
        self._sleep = sleep
        self._pending: deque[ChangeSourceMessage] = deque()
        self._first = True
        self._closed = asyncio.Event()
        self.acked_watermark: str | None = None

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __aiter__(self) -> DemoChangeStream:
        return self

    async def __anext__(self) -> ChangeSourceMessage:
        while not self._pending:
            if self._closed.is_set():
                raise StopAsyncIteration
            if self._create_schema:
                self._create_schema = False
                tuples = self._source._schema_transaction()
            else:
                if not self._first and not await self._pause():
                    raise StopAsyncIteration
                tuples = self._source._row_transaction()
            self._first = False
            self._pending.extend(parse_change_source_message(t) for t in tuples)
        return self._pending.popleft()

    async def _pause(self) -> bool:
        """Waits one rate interval; False if the stream was closed meanwhile."""
        sleep = asyncio.ensure_future(self._sleep(self._source._interval_s))
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait((sleep, closed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleep, closed):
                task.cancel()
            for task in (sleep, closed):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return not self._closed.is_set()

    def ack(self, status: list[Any]) -> None:
        watermark = status[2]["watermark"]
        self.acked_watermark = watermark
        self._source._record_ack(watermark)

    def close_nowait(self) -> None:
        self._closed.set()
        self._pending.clear()

    async def close(self) -> None:
        self.close_nowait()
