"""Backfill streams: schema changes whose data the replica cannot make itself.

Each trigger (a table added to the publication, a column with a volatile default,
a column whose default the replica cannot apply) is run while another connection
keeps writing to the same table, so the backfill's snapshot races live changes.
Then:

* the subscriber's stream is well framed: every transaction begin…commit with equal
  watermarks, commit watermarks strictly increasing; backfill transactions carry
  ``skipAck`` and a minor version (or the snapshot's version for the completion);
* the backfill ends with ``backfill-completed`` and the new data is visible;
* the replica ends equal to Postgres row by row, at the same replicaVersion
  (nothing was reset), and no reset was flagged.

And one race made on purpose (issue 26): a key-changing UPDATE of a row in a frame
over a chunk (the large-frame decoder), committed after the backfill's snapshot and
before its batch is streamed, voids that batch as a small one does; the backfill
runs again and the replica ends equal to Postgres, out-of-line columns included.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import string
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from app.protocol.lexi import parse_state_version
from app.sources.postgres import source as source_module
from app.sources.postgres.backfill_stream import stream_backfill
from tests.e2e_pg.conftest import (
    WAIT_S,
    Message,
    StartUpstream,
    Upstream,
    commit_watermark,
    data,
    reset_required,
)

ROWS = 8000  # over 256 KiB of COPY even for an (id, timestamp) backfill: several batches
MAX_RACE_TX = 3000


@dataclass(frozen=True)
class Trigger:
    setup: list[str]
    ddl: list[str]
    table: str  # upstream, schema-qualified
    lite: str  # on the replica
    pg_query: str  # the rows, comparable to lite_query's
    lite_query: str
    convert: Callable[[tuple[Any, ...]], tuple[Any, ...]] = lambda r: r
    batches: int = 2  # at least this many backfill messages (the COPY's size / 256 KiB)


FOO = [
    "CREATE TABLE foo (id int PRIMARY KEY, v text, n int)",
    f"INSERT INTO foo SELECT g, repeat('x', 100) || g, g FROM generate_series(1, {ROWS}) g",
]
TRIGGERS = {
    "publication-add": Trigger(
        setup=[
            *FOO,
            "CREATE SCHEMA other",
            "CREATE TABLE other.t (id int PRIMARY KEY, v text, n int)",
            f"INSERT INTO other.t SELECT g, repeat('y', 100) || g, g "
            f"FROM generate_series(1, {ROWS}) g",
        ],
        ddl=["ALTER PUBLICATION _hpe_public_0 ADD TABLES IN SCHEMA other"],
        table="other.t",
        lite="other.t",
        pg_query="SELECT id, v, n FROM other.t ORDER BY id",
        lite_query='SELECT id, v, n FROM "other.t" ORDER BY id',
    ),
    "volatile-default": Trigger(
        setup=FOO,
        ddl=["ALTER TABLE foo ADD COLUMN at timestamptz DEFAULT now()"],
        table="foo",
        lite="foo",
        pg_query=(
            "SELECT id, v, n, (extract(epoch FROM at) * 1000000)::bigint FROM foo ORDER BY id"
        ),
        lite_query="SELECT id, v, n, at FROM foo ORDER BY id",
        convert=lambda r: (*r[:3], None if r[3] is None else r[3] / 1000),
    ),
    "non-replicable-default": Trigger(
        setup=FOO,
        ddl=["ALTER TABLE foo ADD COLUMN code text DEFAULT upper('abc')"],
        table="foo",
        lite="foo",
        pg_query="SELECT id, v, n, code FROM foo ORDER BY id",
        lite_query="SELECT id, v, n, code FROM foo ORDER BY id",
        batches=1,  # (id, 'ABC') rows: under 100 KB
    ),
}


async def race(url: str, table: str, stop: asyncio.Event) -> int:
    """Small transactions on ``table`` until ``stop``: updates, inserts, deletes."""
    rng = random.Random(7)
    n = 0
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while not stop.is_set() and n < MAX_RACE_TX:
            k = rng.randint(1, ROWS)
            if n % 7 == 3:
                await conn.execute(f"DELETE FROM {table} WHERE id = %s".encode(), (k,))
            elif n % 5 == 1:
                await conn.execute(
                    f"INSERT INTO {table} (id, v, n) VALUES (%s, 'new', 0)".encode(),
                    (ROWS + 1 + n,),
                )
            else:
                await conn.execute(
                    f"UPDATE {table} SET n = n + 1, v = v || '!' WHERE id = %s".encode(), (k,)
                )
            n += 1
            await asyncio.sleep(0)
    return n


def check_framing(transactions: list[list[Message]], after: str) -> None:
    last = parse_state_version(after)
    for tx in transactions:
        begin, commit = tx[0], tx[-1]
        assert begin[0] == "begin", tx[:1]
        assert commit[0] == "commit", tx[-1:]
        watermark = begin[2]["commitWatermark"]
        assert commit[2]["watermark"] == watermark
        version = parse_state_version(watermark)
        assert version > last, f"{watermark} after {last}"
        last = version
        tags = [m[1]["tag"] for m in tx[1:-1]]
        if any(t in ("backfill", "backfill-completed") for t in tags):
            assert set(tags) <= {"backfill", "backfill-completed"}, tags
            assert begin[1] == {"tag": "begin", "json": "s", "skipAck": True}
            assert version.minor is not None or tags == ["backfill-completed"]


async def rows_equal(env: Upstream, trigger: Trigger) -> None:
    expected = [trigger.convert(r) for r in await env.query(trigger.pg_query)]
    actual = env.replica_query(trigger.lite_query)
    assert len(actual) == len(expected)
    assert [e for e, a in zip(expected, actual, strict=True) if e != a] == []


@pytest.mark.parametrize("trigger", TRIGGERS.values(), ids=TRIGGERS.keys())
async def test_backfill_races_writes_and_ends_equal(
    upstream: StartUpstream, trigger: Trigger
) -> None:
    env = await upstream(trigger.setup)
    replica_version = env.replica_version
    after = env.replica_watermark()
    stop = asyncio.Event()
    await env.execute(*trigger.ddl)
    writer = asyncio.create_task(race(env.url, trigger.table, stop))
    transactions: list[list[Message]] = []
    try:
        completed = None
        async with asyncio.timeout(WAIT_S * 4):
            while completed is None:
                tx = await env.next_transaction()
                transactions.append(tx)
                for m in tx:
                    if m[0] == "data" and m[1]["tag"] == "backfill-completed":
                        completed = m[1]
    finally:
        stop.set()
        writes = await writer
    assert writes > 0
    # A last write after the writer's: once it arrives, everything before it has.
    await env.execute(f"INSERT INTO {trigger.table} (id, n) VALUES (-1, -1)")
    async with asyncio.timeout(WAIT_S * 4):
        while True:
            tx = await env.next_transaction()
            transactions.append(tx)
            if any(m[0] == "data" and m[1].get("new", {}).get("n") == -1 for m in tx):
                break

    check_framing(transactions, after)
    backfills = [m[1] for tx in transactions for m in tx if m[0] == "data"]
    batches = [b for b in backfills if b["tag"] == "backfill"]
    assert len(batches) >= trigger.batches
    assert sum(len(b["rowValues"]) for b in batches) >= ROWS - MAX_RACE_TX
    assert completed["status"]["rows"] == sum(len(b["rowValues"]) for b in batches)
    schema, _, name = trigger.table.rpartition(".")
    assert completed["relation"]["schema"] == (schema or "public")
    assert completed["relation"]["name"] == name

    await env.wait_replica(transactions[-1][0][2]["commitWatermark"], within_s=WAIT_S * 2)
    await rows_equal(env, trigger)
    assert env.replica_version == replica_version
    assert env.replica_query('SELECT "replicaVersion" FROM "_zero.replicationConfig"') == [
        (replica_version,)
    ]
    assert not await reset_required(env)


BackfillBatches = AsyncGenerator[dict[str, Any], None]


class HeldFirstBackfill:
    """``stream_backfill`` whose first run, once it has taken its snapshot and read
    its first batch, holds that batch until :meth:`release`: a backfill running at
    the moment the test chooses. Later runs are the real reader as it is."""

    def __init__(self, real: Callable[..., BackfillBatches]) -> None:
        self._real = real
        self.runs = 0
        self.snapshot_taken = asyncio.Event()
        self._released = asyncio.Event()

    def __call__(self, *args: Any) -> BackfillBatches:
        self.runs += 1
        batches = self._real(*args)
        return self._held(batches) if self.runs == 1 else batches

    def release(self) -> None:
        self._released.set()

    async def _held(self, batches: BackfillBatches) -> BackfillBatches:
        try:
            first = await anext(batches)
            self.snapshot_taken.set()
            await self._released.wait()
            yield first
            async for body in batches:
                yield body
        finally:
            await batches.aclose()


BIG = 2 * 1024 * 1024  # one value over a replication chunk: the large-frame decoder
OUT_OF_LINE = 8192


def digest(value: Any) -> Any:
    """A text column as its length and hash: a 2 MiB mismatch stays readable."""
    if not isinstance(value, str):
        return value
    return (len(value), hashlib.sha256(value.encode()).hexdigest()[:16])


async def test_a_key_change_in_a_large_row_during_its_backfill_ends_equal(
    upstream: StartUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldFirstBackfill(stream_backfill)
    monkeypatch.setattr(source_module, "stream_backfill", held)
    # Random, so incompressible; EXTERNAL, so out of line: an UPDATE that leaves it
    # alone carries it as unchanged TOAST ('u'), which only a backfill can fill.
    rng = random.Random(26)
    ext = "".join(rng.choices(string.ascii_letters + string.digits, k=OUT_OF_LINE))
    env = await upstream(
        [
            "CREATE SCHEMA other",
            "CREATE TABLE other.items (id int PRIMARY KEY, big text, ext text)",
            "ALTER TABLE other.items ALTER COLUMN ext SET STORAGE EXTERNAL",
            f"INSERT INTO other.items VALUES (1, repeat('a', {BIG}), '{ext}')",
        ]
    )
    await env.execute("ALTER PUBLICATION _hpe_public_0 ADD TABLES IN SCHEMA other")
    await asyncio.wait_for(held.snapshot_taken.wait(), WAIT_S)  # the row read under id 1

    await env.execute(f"UPDATE other.items SET id = 5, big = repeat('b', {BIG}) WHERE id = 1")
    update = None
    while update is None:
        update = next((d for d in data(await env.next_transaction()) if d["tag"] == "update"), None)
    assert update["key"] == {"id": 1}
    assert update["new"]["id"] == 5
    assert len(update["new"]["big"]) == BIG
    assert "ext" not in update["new"], "the update must carry ext as unchanged TOAST"
    held.release()  # the batch read before the key change goes to the stream now

    completed_at = None
    while completed_at is None:
        tx = await env.next_transaction()
        if any(d["tag"] == "backfill-completed" for d in data(tx)):
            completed_at = commit_watermark(tx)
    columns = ("id", "big", "ext")
    expected = [
        {c: digest(v) for c, v in zip(columns, r, strict=True)}
        for r in await env.query("SELECT id, big, ext FROM other.items ORDER BY id")
    ]
    actual = [
        {c: digest(v) for c, v in r.items()}
        for r in await env.replica_rows("other.items", at=completed_at, order_by="id")
    ]
    assert expected == [{"id": 5, "big": digest("b" * BIG), "ext": digest(ext)}]
    assert actual == expected
    assert not await reset_required(env)
