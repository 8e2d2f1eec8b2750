"""BackfillManager, the scheduler of backfill streams (spec/source.md §1.6, §1.8).

The manager is driven here the way the replication stream drives it (``start``,
``on_begin``/``on_commit``/``on_position``, ``observe``, ``transaction``) with a test
reader in place of Postgres: each call of the reader is a :class:`Read`, an async
generator that yields the bodies the test feeds it, raises what it is given, or ends.
Every wait is on a condition (a batch queued, a reader called, a task ended),
bounded by :data:`WAIT_S`; nothing asserts on timing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from app.protocol.messages import Begin, ChangeSourceMessage, Commit, Data
from app.sources.postgres import backfills
from app.sources.postgres.backfills import QUEUED_BATCHES, BackfillManager, MissingRowKeyError

WAIT_S = 10.0

T1 = {"schema": "public", "name": "t1"}
T2 = {"schema": "public", "name": "t2"}
T9 = {"schema": "other", "name": "t9"}


def metadata(oid: int = 16400, key: tuple[str, ...] = ("id",)) -> dict[str, Any]:
    return {
        "schemaOID": 2200,
        "relationOID": oid,
        "rowKey": {k: {"attNum": i + 1} for i, k in enumerate(key)},
    }


def request(
    table: dict[str, str] = T1,
    columns: tuple[str, ...] = ("v",),
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "table": {**table, "metadata": meta or metadata()},
        "columns": {c: {"attNum": 10 + i} for i, c in enumerate(columns)},
    }


def relation(req: dict[str, Any]) -> dict[str, Any]:
    table = req["table"]
    key = list((table["metadata"] or {}).get("rowKey") or {})
    return {"schema": table["schema"], "name": table["name"], "rowKey": {"columns": key}}


def batch(req: dict[str, Any], watermark: str, *rows: list[Any]) -> dict[str, Any]:
    rel = relation(req)
    columns = [c for c in req["columns"] if c not in rel["rowKey"]["columns"]]
    return {
        "tag": "backfill",
        "relation": rel,
        "columns": columns,
        "watermark": watermark,
        "rowValues": [list(r) for r in rows],
        "status": {"rows": len(rows), "totalRows": len(rows)},
    }


def completed(req: dict[str, Any], watermark: str) -> dict[str, Any]:
    rel = relation(req)
    return {
        "tag": "backfill-completed",
        "relation": rel,
        "columns": [c for c in req["columns"] if c not in rel["rowKey"]["columns"]],
        "watermark": watermark,
        "status": {"rows": 0, "totalRows": 0},
    }


def data(tag: str, **body: Any) -> Data:
    return Data({"tag": tag, **body}, tag)


# -- the test reader --------------------------------------------------------------

_END = object()


class Changes:
    """Something happened (a batch queued, a reader called or closed): waiters recheck."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()

    async def until(self, check: Callable[[], bool], what: str) -> None:
        try:
            async with asyncio.timeout(WAIT_S):
                while not check():
                    self._event.clear()
                    await self._event.wait()
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}") from None


class Read:
    """One call of the reader: yields what the test feeds, in order."""

    def __init__(self, req: dict[str, Any], changes: Changes) -> None:
        self.request = req
        self.task = asyncio.current_task()  # the manager's reader task
        self.sent = 0
        self.closed = False
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._changes = changes

    def feed(self, *bodies: dict[str, Any]) -> None:
        for body in bodies:
            self._items.put_nowait(body)

    def end(self) -> None:
        self._items.put_nowait(_END)

    def fail(self, error: BaseException) -> None:
        self._items.put_nowait(error)

    async def bodies(self) -> AsyncGenerator[dict[str, Any], None]:
        try:
            while True:
                item = await self._items.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                self.sent += 1
                yield item
        finally:
            self.closed = True
            self._changes.notify()


class Reads:
    """The reader passed to the manager. ``script[table name]``: what the next reads
    of that table get before anything the test feeds them, one list per read."""

    def __init__(self) -> None:
        self.changes = Changes()
        self.calls: list[Read] = []
        self.woken = 0
        self.script: dict[str, list[list[Any]]] = {}

    def __call__(self, req: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        read = Read(req, self.changes)
        scripted = self.script.get(req["table"]["name"])
        for item in scripted.pop(0) if scripted else []:
            if item is _END:
                read.end()
            elif isinstance(item, BaseException):
                read.fail(item)
            else:
                read.feed(item)
        self.calls.append(read)
        self.changes.notify()
        return read.bodies()

    def wake(self) -> None:
        self.woken += 1
        self.changes.notify()

    async def until(self, check: Callable[[], bool], what: str) -> None:
        await self.changes.until(check, what)

    async def call(self, n: int) -> Read:
        """The ``n``-th read (1-based), once the manager has started it."""
        await self.until(lambda: len(self.calls) >= n, f"reader call #{n}")
        return self.calls[n - 1]

    async def queued(self, n: int) -> None:
        await self.until(lambda: self.woken >= n, f"{n} bodies queued")


def new_manager(reads: Reads, **options: Any) -> BackfillManager:
    options.setdefault("min_backoff_s", 0.001)
    options.setdefault("max_backoff_s", 0.004)
    options.setdefault("priority_wait_s", 0.05)
    return BackfillManager(reads, wake=reads.wake, **options)


@pytest.fixture
async def reads() -> Reads:
    return Reads()


@pytest.fixture
async def manager(reads: Reads) -> AsyncIterator[BackfillManager]:
    m = new_manager(reads)
    yield m
    await m.close()


async def ended(read: Read) -> None:
    assert read.task is not None
    done, _ = await asyncio.wait({read.task}, timeout=WAIT_S)
    assert done, "the reader task did not end"


def begin(watermark: str) -> Begin:
    return Begin({"tag": "begin", "json": "s", "skipAck": True}, watermark, True)


def commit(watermark: str) -> Commit:
    return Commit({"tag": "commit"}, watermark)


def backfill_tx(watermark: str, *bodies: dict[str, Any]) -> list[ChangeSourceMessage]:
    return [begin(watermark), *(Data(b, b["tag"]) for b in bodies), commit(watermark)]


def bodies_of(tx: list[ChangeSourceMessage]) -> list[dict[str, Any]]:
    return [m.body for m in tx if isinstance(m, Data)]


# -- (a) what is owed ---------------------------------------------------------------


async def test_requests_given_at_start_are_run_one_at_a_time(
    reads: Reads, manager: BackfillManager
) -> None:
    r1, r2 = request(T1), request(T2, ("w",))
    manager.start("0a", [r1, r2])
    assert manager.required == [r1, r2]
    first = await reads.call(1)
    assert first.request in (r1, r2)
    assert manager.running_table == ("public", first.request["table"]["name"])

    first.feed(batch(first.request, "0b", [1, "x"]), completed(first.request, "0b"))
    first.end()
    await reads.queued(2)
    assert len(reads.calls) == 1  # one at a time
    manager.on_position("0b")
    out = manager.transaction("0a", False)
    assert out == backfill_tx("0a.01", batch(first.request, "0b", [1, "x"]))
    out = manager.transaction("0a.01", False)
    assert out == backfill_tx("0b", completed(first.request, "0b"))

    second = await reads.call(2)
    assert [first.request, second.request] in ([r1, r2], [r2, r1])
    assert manager.required == [second.request]
    second.feed(completed(second.request, "0b"))
    await reads.queued(3)
    assert manager.transaction("0b", False) == backfill_tx("0b.01", completed(second.request, "0b"))
    assert manager.required == []
    assert manager.running_table is None


async def test_create_table_with_backfill_adds_a_request_started_at_commit(
    reads: Reads, manager: BackfillManager
) -> None:
    manager.start("0a", [])
    assert manager.transaction("0a", False) == []
    spec = {
        "schema": "other",
        "name": "t9",
        "columns": {"id": {"pos": 1, "dataType": "int4"}, "v": {"pos": 2, "dataType": "text"}},
    }
    meta = metadata(16500)
    manager.on_begin("0b")
    manager.observe(data("create-table", spec={**spec, "name": "plain"}, metadata=meta))
    assert manager.required == []  # no backfill field: nothing owed
    manager.observe(
        data(
            "create-table",
            spec=spec,
            metadata=meta,
            backfill={"id": {"attNum": 1}, "v": {"attNum": 2}},
        )
    )
    expected = {
        "table": {"schema": "other", "name": "t9", "metadata": meta},
        "columns": {"id": {"attNum": 1}, "v": {"attNum": 2}},
    }
    assert manager.required == [expected]
    assert manager.running_table is None  # not before the table's transaction commits
    manager.on_commit("0b")
    assert (await reads.call(1)).request == expected
    assert manager.running_table == ("other", "t9")


async def test_add_column_with_backfill_adds_or_merges_into_a_request(
    reads: Reads, manager: BackfillManager
) -> None:
    manager.start("0a", [request(T1, ("v",))])
    read = await reads.call(1)
    meta2 = {**metadata(), "note": "after add-column"}
    manager.on_begin("0b")
    manager.observe(
        data("add-column", table=T1, column={"name": "w", "spec": {"pos": 11}}, tableMetadata=meta2)
    )
    assert manager.required == [request(T1, ("v",))]  # without backfill: nothing owed
    manager.observe(
        data(
            "add-column",
            table=T1,
            column={"name": "w", "spec": {"pos": 11}},
            tableMetadata=meta2,
            backfill={"attNum": 11},
        )
    )
    manager.observe(
        data(
            "add-column",
            table=T2,
            column={"name": "x", "spec": {"pos": 3}},
            tableMetadata=metadata(16401),
            backfill={"attNum": 3},
        )
    )
    manager.on_commit("0b")
    assert manager.required == [
        {
            "table": {**T1, "metadata": meta2},
            "columns": {"v": {"attNum": 10}, "w": {"attNum": 11}},
        },
        {"table": {**T2, "metadata": metadata(16401)}, "columns": {"x": {"attNum": 3}}},
    ]
    # The running backfill of v goes on.
    assert read.task is not None
    assert not read.task.done()
    assert manager.running_table == ("public", "t1")
    assert len(reads.calls) == 1


# -- (b) schema changes that affect the running backfill -----------------------------


AFFECTING: dict[str, tuple[Data, list[dict[str, Any]]]] = {
    # change → required afterwards (with the running request t1 {v, w})
    "rename-table": (
        data("rename-table", old=T1, new={"schema": "public", "name": "t1b"}),
        [request({"schema": "public", "name": "t1b"}, ("v", "w"))],
    ),
    "drop-table": (data("drop-table", id=T1), []),
    "rename-column": (
        data(
            "update-column",
            table=T1,
            old={"name": "v", "spec": {"pos": 10}},
            new={"name": "v2", "spec": {"pos": 10}},
        ),
        [
            {
                "table": {**T1, "metadata": metadata()},
                "columns": {"v2": {"attNum": 10}, "w": {"attNum": 11}},
            }
        ],
    ),
    "drop-column": (
        data("drop-column", table=T1, column="v"),
        [{"table": {**T1, "metadata": metadata()}, "columns": {"w": {"attNum": 11}}}],
    ),
    "update-table-metadata": (
        data("update-table-metadata", table=T1, old=metadata(), new=metadata(key=("id", "k"))),
        [request(T1, ("v", "w"), metadata(key=("id", "k")))],
    ),
}


@pytest.mark.parametrize("change", AFFECTING.values(), ids=AFFECTING.keys())
async def test_a_change_to_the_running_backfill_cancels_it_and_drops_its_batches(
    reads: Reads, manager: BackfillManager, change: tuple[Data, list[dict[str, Any]]]
) -> None:
    message, required = change
    running = request(T1, ("v", "w"))
    manager.start("0a", [running])
    read = await reads.call(1)
    read.feed(batch(running, "0b", [1, "old", "old"]), batch(running, "0b", [2, "old", "old"]))
    await reads.queued(2)

    manager.on_begin("0c")
    manager.observe(message)
    assert manager.required == required
    await ended(read)
    assert read.task is not None
    assert read.task.cancelled()
    assert read.closed
    manager.on_commit("0c")
    if required:
        again = await reads.call(2)  # starts over, at a new snapshot, as the request is now
        assert again.request == required[0]
        again.feed(batch(again.request, "0d", [1, "new", "new"]))
        await reads.queued(3)
        # The cancelled read's queued batches never go out.
        assert bodies_of(manager.transaction("0c", False)) == [
            batch(again.request, "0d", [1, "new", "new"])
        ]
    else:
        assert manager.running_table is None
        assert manager.transaction("0c", False) == []
        assert len(reads.calls) == 1


V = {"v": {"attNum": 10}}
W = {"w": {"attNum": 11}}
X = {"x": {"attNum": 2}}


def owed(
    table: dict[str, str], columns: dict[str, Any], meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"table": {**table, "metadata": meta or metadata()}, "columns": columns}


T1_OWED = owed(T1, {**V, **W})
T9_OWED = owed(T9, X, metadata(16409))

NOT_AFFECTING: dict[str, tuple[Data, list[dict[str, Any]]]] = {
    # change → required afterwards (running: t1 {v}; also owed: t1 {w} and t9 {x})
    "rename-other-table": (
        data("rename-table", old=T9, new={"schema": "other", "name": "t9b"}),
        [T1_OWED, owed({"schema": "other", "name": "t9b"}, X, metadata(16409))],
    ),
    "drop-other-table": (data("drop-table", id=T9), [T1_OWED]),
    "rename-owed-column": (
        data(
            "update-column",
            table=T1,
            old={"name": "w", "spec": {"pos": 11}},
            new={"name": "w2", "spec": {"pos": 11}},
        ),
        [owed(T1, {**V, "w2": {"attNum": 11}}), T9_OWED],
    ),
    "retype-running-column": (
        data(
            "update-column",
            table=T1,
            old={"name": "v", "spec": {"pos": 10, "dataType": "int4"}},
            new={"name": "v", "spec": {"pos": 10, "dataType": "int8"}},
        ),
        [T1_OWED, T9_OWED],
    ),
    "rename-unowed-column": (
        data(
            "update-column",
            table=T1,
            old={"name": "n", "spec": {"pos": 3}},
            new={"name": "n2", "spec": {"pos": 3}},
        ),
        [T1_OWED, T9_OWED],
    ),
    "drop-owed-column": (data("drop-column", table=T1, column="w"), [owed(T1, V), T9_OWED]),
    "drop-unowed-column": (data("drop-column", table=T1, column="n"), [T1_OWED, T9_OWED]),
    "other-table-metadata": (
        data("update-table-metadata", table=T9, old=metadata(16409), new=metadata(16410)),
        [T1_OWED, owed(T9, X, metadata(16410))],
    ),
}


@pytest.mark.parametrize("change", NOT_AFFECTING.values(), ids=NOT_AFFECTING.keys())
async def test_a_change_elsewhere_updates_what_is_owed_and_the_backfill_goes_on(
    reads: Reads, manager: BackfillManager, change: tuple[Data, list[dict[str, Any]]]
) -> None:
    message, required = change
    running = request(T1, ("v",))
    manager.start("0a", [running])
    read = await reads.call(1)
    read.feed(batch(running, "0b", [1, "a"]))
    await reads.queued(1)
    # Owed as well, not running: t1's column w and t9's column x.
    manager.on_begin("0c")
    manager.observe(
        data(
            "add-column",
            table=T1,
            column={"name": "w", "spec": {"pos": 11}},
            tableMetadata=metadata(),
            backfill=W["w"],
        )
    )
    manager.observe(
        data("create-table", spec={**T9, "columns": {}}, metadata=metadata(16409), backfill=X)
    )
    manager.on_commit("0c")
    assert manager.required == [T1_OWED, T9_OWED]

    manager.on_begin("0d")
    manager.observe(message)
    manager.on_commit("0d")
    assert manager.required == required
    assert manager.running_table == ("public", "t1")
    assert read.task is not None
    assert not read.task.done()
    read.feed(batch(running, "0b", [2, "b"]))
    await reads.queued(2)
    assert bodies_of(manager.transaction("0d", False)) == [
        batch(running, "0b", [1, "a"]),
        batch(running, "0b", [2, "b"]),
    ]
    assert len(reads.calls) == 1


# -- (c) the stream's turn ---------------------------------------------------------------


async def test_nothing_ready_is_no_transaction(reads: Reads, manager: BackfillManager) -> None:
    manager.start("0a", [])
    assert manager.transaction("0a", False) == []
    manager.observe(data("create-table", spec={**T1, "columns": {}}, backfill={"v": {}}))
    assert manager.transaction("0a", False) == []  # owed, not started yet
    manager.on_commit("0b")
    await reads.call(1)
    assert manager.transaction("0b", False) == []  # started, nothing read yet
    assert manager.transaction("0b", True) == []


@pytest.mark.parametrize(
    ("last", "version"), [("0a", "0a.01"), ("0a.01", "0a.02"), ("4d7lu8", "4d7lu8.01")]
)
async def test_a_backfill_transaction_is_versioned_after_the_last_commit(
    reads: Reads, manager: BackfillManager, last: str, version: str
) -> None:
    req = request()
    manager.start("0a", [req])
    read = await reads.call(1)
    read.feed(batch(req, "0a", [1, "a"]))
    await reads.queued(1)
    out = manager.transaction(last, False)
    assert out == backfill_tx(version, batch(req, "0a", [1, "a"]))
    first = out[0]
    assert isinstance(first, Begin)
    assert first.as_list() == [
        "begin",
        {"tag": "begin", "json": "s", "skipAck": True},
        {"commitWatermark": version},
    ]
    assert out[-1].as_list() == ["commit", {"tag": "commit"}, {"watermark": version}]


async def test_a_transaction_carries_at_most_what_is_ready(
    reads: Reads, manager: BackfillManager
) -> None:
    req = request()
    manager.start("0a", [req])
    read = await reads.call(1)
    bodies = [batch(req, "0a", [i, f"v{i}"]) for i in range(QUEUED_BATCHES + 3)]
    read.feed(*bodies)
    # The reader queues QUEUED_BATCHES and waits with the next one in hand.
    await reads.until(lambda: read.sent == QUEUED_BATCHES + 1, "the reader to wait for room")
    assert reads.woken == QUEUED_BATCHES
    out = manager.transaction("0a", False)
    assert bodies_of(out) == bodies[:QUEUED_BATCHES]
    assert manager.transaction("0a.01", False) == []  # the rest is not read yet
    await reads.queued(len(bodies))
    assert bodies_of(manager.transaction("0a.01", False)) == bodies[QUEUED_BATCHES:]
    assert manager.transaction("0a.02", False) == []


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


async def test_a_waiting_upstream_goes_first_until_a_batch_has_waited_long_enough(
    reads: Reads, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(backfills, "time", SimpleNamespace(monotonic=clock.monotonic))
    manager = new_manager(reads, priority_wait_s=0.5)
    try:
        req = request()
        manager.start("0a", [req])
        read = await reads.call(1)
        read.feed(batch(req, "0a", [1, "a"]))
        await reads.queued(1)
        assert manager.transaction("0a", True) == []
        clock.now += 0.25
        read.feed(batch(req, "0a", [2, "b"]))
        await reads.queued(2)
        assert manager.transaction("0a", True) == []
        clock.now += 0.25  # the first batch has now waited priority_wait_s
        assert bodies_of(manager.transaction("0a", True)) == [
            batch(req, "0a", [1, "a"]),
            batch(req, "0a", [2, "b"]),
        ]
        read.feed(batch(req, "0a", [3, "c"]))
        await reads.queued(3)
        assert manager.transaction("0a.01", True) == []
        # With nothing waiting upstream a batch goes at once.
        assert bodies_of(manager.transaction("0a.01", False)) == [batch(req, "0a", [3, "c"])]
    finally:
        await manager.close()


async def test_a_busy_upstream_cannot_starve_a_backfill(reads: Reads) -> None:
    """The same with the real clock: once the batch has waited ``priority_wait_s``
    it goes although the upstream always has more waiting."""
    manager = new_manager(reads, priority_wait_s=0.02)
    try:
        req = request()
        manager.start("0a", [req])
        read = await reads.call(1)
        read.feed(batch(req, "0a", [1, "a"]))
        await reads.queued(1)
        waited = asyncio.Event()
        asyncio.get_running_loop().call_later(0.04, waited.set)  # twice priority_wait_s
        await asyncio.wait_for(waited.wait(), WAIT_S)
        assert manager.transaction("0a", True) == backfill_tx("0a.01", batch(req, "0a", [1, "a"]))
    finally:
        await manager.close()


# -- (d) completion --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("passed", "last", "version"),
    [
        (lambda m: m.on_position("0c"), "0b", "0c"),  # a keepalive or a logical message
        (lambda m: m.on_commit("0c"), "0c", "0c.01"),  # an upstream commit at the snapshot
        (lambda m: m.on_commit("0d"), "0d", "0d.01"),  # and after it
    ],
    ids=["position", "commit-at-snapshot", "commit-after"],
)
async def test_completion_waits_for_the_stream_to_pass_its_snapshot(
    reads: Reads,
    manager: BackfillManager,
    passed: Callable[[BackfillManager], None],
    last: str,
    version: str,
) -> None:
    req = request(T1, ("id", "v"))  # as a table added to a publication asks
    manager.start("0a", [req])
    read = await reads.call(1)
    read.feed(batch(req, "0c", [1, "a"]), completed(req, "0c"))
    read.end()
    await reads.queued(2)
    assert manager.transaction("0a", False) == backfill_tx("0a.01", batch(req, "0c", [1, "a"]))
    assert manager.transaction("0a.01", False) == []
    manager.on_begin("0b")
    manager.on_commit("0b")  # an upstream transaction before the snapshot
    assert manager.transaction("0b", False) == []
    manager.on_position("0b")
    assert manager.transaction("0b", False) == []
    assert manager.required == [req]

    passed(manager)
    assert manager.transaction(last, False) == backfill_tx(version, completed(req, "0c"))
    assert manager.required == []  # the key and v: all it asked for
    assert manager.running_table is None
    assert manager.transaction(version, False) == []


async def test_completion_goes_in_its_own_transaction_at_the_snapshot_version(
    reads: Reads, manager: BackfillManager
) -> None:
    req = request()
    manager.start("0a", [req])
    manager.on_position("0f")  # the stream is already past the snapshot
    read = await reads.call(1)
    read.feed(batch(req, "0c", [1, "a"]), batch(req, "0c", [2, "b"]), completed(req, "0c"))
    await reads.queued(3)
    assert bodies_of(manager.transaction("0a", False)) == [
        batch(req, "0c", [1, "a"]),
        batch(req, "0c", [2, "b"]),
    ]
    # max("0a.02", "0c"): the replica's version never predates the backfilled rows.
    assert manager.transaction("0a.01", False) == backfill_tx("0c", completed(req, "0c"))


async def test_completion_of_some_columns_leaves_the_rest_owed_and_starts_it(
    reads: Reads, manager: BackfillManager
) -> None:
    req = request(T1, ("v",))
    manager.start("0a", [req])
    read = await reads.call(1)
    meta2 = {**metadata(), "note": "new"}
    manager.on_begin("0b")
    manager.observe(
        data(
            "add-column",
            table=T1,
            column={"name": "w", "spec": {"pos": 11}},
            tableMetadata=meta2,
            backfill={"attNum": 11},
        )
    )
    manager.on_commit("0b")
    read.feed(completed(req, "0b"))
    read.end()
    await reads.queued(1)
    assert manager.transaction("0b", False) == backfill_tx("0b.01", completed(req, "0b"))
    rest = {"table": {**T1, "metadata": meta2}, "columns": {"w": {"attNum": 11}}}
    assert manager.required == [rest]
    assert (await reads.call(2)).request == rest


async def test_the_next_request_starts_after_a_completion_even_while_the_reader_runs_on(
    reads: Reads, manager: BackfillManager
) -> None:
    r1, r2 = request(T1), request(T2)
    manager.start("0a", [r1])
    read = await reads.call(1)
    manager.observe(
        data(
            "create-table", spec={**T2, "columns": {}}, metadata=metadata(), backfill=r2["columns"]
        )
    )
    read.feed(completed(r1, "0a"))  # the reader has not ended yet
    await reads.queued(1)
    assert manager.transaction("0a", False) == backfill_tx("0a.01", completed(r1, "0a"))
    assert (await reads.call(2)).request == r2
    assert manager.running_table == ("public", "t2")
    read.end()
    await ended(read)
    assert manager.running_table == ("public", "t2")


# -- (e) changed row keys --------------------------------------------------------------


def key_update(key: dict[str, Any] | None, new: dict[str, Any], table: dict[str, str] = T1) -> Data:
    rel = {**table, "rowKey": {"columns": ["id"], "type": "default"}}
    return data("update", relation=rel, key=key, old=None, new=new)


@pytest.mark.parametrize("reader_done", [False, True], ids=["reading", "read-to-the-end"])
async def test_a_changed_row_key_voids_older_batches_and_the_backfill_starts_over(
    reads: Reads, manager: BackfillManager, reader_done: bool
) -> None:
    req = request()
    manager.start("0a", [req])
    read = await reads.call(1)
    read.feed(batch(req, "0b", [1, "a"]))
    if reader_done:
        read.feed(completed(req, "0b"))
        read.end()
        await ended(read)
    else:
        await reads.queued(1)
    manager.on_begin("0c")
    manager.observe(key_update({"id": 1}, {"id": 5, "v": "a"}))
    manager.on_commit("0c")
    assert manager.transaction("0c", False) == []
    again = await reads.call(2)  # at a snapshot after the key change
    assert again.request == req
    assert manager.required == [req]
    before = reads.woken
    again.feed(batch(req, "0d", [5, "a"]))
    await reads.queued(before + 1)
    assert bodies_of(manager.transaction("0c", False)) == [batch(req, "0d", [5, "a"])]


UNCHANGED_KEYS = {
    "no-key": key_update(None, {"id": 1, "v": "b"}),
    "full-identity-same-key": key_update({"id": 1, "v": "a"}, {"id": 1, "v": "b"}),
    "other-table": key_update({"id": 1}, {"id": 5, "v": "a"}, T2),
}


@pytest.mark.parametrize("update", UNCHANGED_KEYS.values(), ids=UNCHANGED_KEYS.keys())
async def test_updates_that_keep_the_backfilled_keys_void_nothing(
    reads: Reads, manager: BackfillManager, update: Data
) -> None:
    req = request()
    manager.start("0a", [req])
    read = await reads.call(1)
    read.feed(batch(req, "0b", [1, "a"]))
    await reads.queued(1)
    manager.on_begin("0c")
    manager.observe(update)
    manager.on_commit("0c")
    assert bodies_of(manager.transaction("0c", False)) == [batch(req, "0b", [1, "a"])]
    assert len(reads.calls) == 1


# -- (f) failures ----------------------------------------------------------------------


@pytest.fixture
async def retry_delays(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, asyncio.TimerHandle]]:
    """The manager's retry timers (delay, handle), as it schedules them."""
    loop = asyncio.get_running_loop()
    scheduled: list[tuple[float, asyncio.TimerHandle]] = []
    call_later = loop.call_later

    def recording(delay: float, callback: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        handle = call_later(delay, callback, *args, **kw)
        if getattr(callback, "__name__", "") == "_retry_now":
            scheduled.append((delay, handle))
        return handle

    monkeypatch.setattr(loop, "call_later", recording)
    return scheduled


async def test_a_failed_read_is_retried_with_doubling_backoff_up_to_the_max(
    reads: Reads,
    manager: BackfillManager,
    retry_delays: list[tuple[float, asyncio.TimerHandle]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=backfills.__name__)
    req = request()
    reads.script["t1"] = [[RuntimeError("connection refused")]] * 4
    manager.start("0a", [req])
    read = await reads.call(5)  # four failures, each retried
    assert all(r.request == req for r in reads.calls)
    assert all(r.closed for r in reads.calls[:4])
    assert [d for d, _ in retry_delays] == [0.001, 0.002, 0.004, 0.004]
    failures = [r for r in caplog.records if "backfill failed" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.WARNING] * 2 + [logging.ERROR] * 2
    assert all("connection refused" in r.getMessage() for r in failures)

    # A read to the end resets the backoff: the next failure waits the minimum again.
    read.feed(completed(req, "0a"))
    read.end()
    await ended(read)
    reads.script["t2"] = [[RuntimeError("again")]]
    manager.observe(
        data("create-table", spec={**T2, "columns": {}}, metadata=metadata(), backfill={"w": {}})
    )
    manager.transaction("0a", False)  # completes t1: t2 starts, fails
    await reads.call(7)
    assert [d for d, _ in retry_delays][4] == 0.001


async def test_batches_queued_before_a_failure_are_not_streamed(
    reads: Reads, manager: BackfillManager
) -> None:
    req = request()
    manager.start("0a", [req])
    read = await reads.call(1)
    read.feed(batch(req, "0b", [1, "a"]))
    await reads.queued(1)
    read.fail(RuntimeError("lost the connection"))
    again = await reads.call(2)
    assert manager.transaction("0a", False) == []
    again.feed(batch(req, "0c", [1, "b"]))
    await reads.queued(2)
    assert bodies_of(manager.transaction("0a", False)) == [batch(req, "0c", [1, "b"])]


async def test_rows_without_a_row_key_fail_the_read(reads: Reads, manager: BackfillManager) -> None:
    req = request(T1, ("v",), metadata(key=()))
    manager.start("0a", [req])
    read = await reads.call(1)
    read.feed(batch(req, "0b"))  # no rows: nothing to identify, fine
    await reads.queued(1)
    read.feed(batch(req, "0b", ["a"]))
    again = await reads.call(2)
    assert read.task is not None
    error = read.task.exception()
    assert isinstance(error, MissingRowKeyError)
    assert str(error) == (
        "cannot backfill public.t1: it has rows but no PRIMARY KEY or unique index"
    )
    assert read.closed
    assert again.request == req
    assert manager.transaction("0a", False) == []  # neither batch of the failed read


# -- (g) close ---------------------------------------------------------------------------


async def test_close_cancels_the_running_reader(reads: Reads, manager: BackfillManager) -> None:
    req = request()
    manager.start("0a", [req])
    read = await reads.call(1)
    read.feed(batch(req, "0b", [1, "a"]))
    await reads.queued(1)
    await manager.close()
    assert read.task is not None
    assert read.task.cancelled()
    assert read.closed
    assert manager.transaction("0a", False) == []
    manager.on_commit("0b")
    assert manager.running_table is None  # nothing starts after close
    assert manager.required == [req]  # still owed: the change DB keeps it
    assert len(reads.calls) == 1


async def test_close_cancels_a_pending_retry(
    reads: Reads, retry_delays: list[tuple[float, asyncio.TimerHandle]]
) -> None:
    manager = new_manager(reads, min_backoff_s=30.0, max_backoff_s=60.0)
    req = request()
    reads.script["t1"] = [[RuntimeError("boom")]]
    manager.start("0a", [req])
    read = await reads.call(1)
    await ended(read)
    assert len(retry_delays) == 1  # (ended() returns after the manager's callback)
    handle = retry_delays[0][1]
    assert not handle.cancelled()
    await manager.close()
    assert handle.cancelled()
    manager.on_commit("0b")
    assert manager.running_table is None
    assert len(reads.calls) == 1
