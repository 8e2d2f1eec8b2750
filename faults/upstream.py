"""The upstream side: a scratch ``flt_*`` database, its schema, and the seeded writer.

Every writer transaction changes 1–3 rows of ``items`` (insert, update or delete,
chosen by a seeded RNG) and inserts one row into ``seq``: the transaction's number,
1, 2, 3… So a subscriber that got a transaction twice has a ``seq`` twice, and one
that missed a transaction lacks its ``seq`` — whatever happened to ``items``.

The writer survives a Postgres restart: it reconnects, and re-reads the ids and the
last ``seq`` from Postgres (a commit whose answer was lost may or may not have
happened; Postgres is the truth the oracle compares against).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

__all__ = [
    "PG_URL",
    "SCHEMA",
    "Writer",
    "pg_rows",
    "scratch_database",
]

# The test suite's server (``CHANGESTREAMER_TEST_PG_URL``, as tests/conftest.py reads
# it); the harness connects to its ``postgres`` database to create and drop its own.
PG_URL = make_conninfo(
    os.environ.get(
        "CHANGESTREAMER_TEST_PG_URL", "postgresql://postgres:postgres@127.0.0.1:5432/postgres"
    ),
    dbname="postgres",
)
SCHEMA = (
    "CREATE TABLE items (id int4 PRIMARY KEY, n int4 NOT NULL, s text)",
    "CREATE TABLE seq (seq int4 PRIMARY KEY)",
)
DROP_ATTEMPTS = 100
# Pace of the write load: transactions per second, at most.
DEFAULT_RATE = 40.0


async def pg_rows(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(sql.encode(), params)
        return await cur.fetchall() if cur.description else []


async def drop_database(name: str) -> None:
    """Ends this database's walsenders, drops its slots, then the database."""
    assert name.startswith("flt_"), name
    async with await psycopg.AsyncConnection.connect(PG_URL, autocommit=True) as c:
        for _ in range(DROP_ATTEMPTS):
            cur = await c.execute(
                "SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = %s",
                (name,),
            )
            slots = await cur.fetchall()
            if not slots:
                break
            for slot, pid in slots:
                if pid is not None:
                    await c.execute("SELECT pg_terminate_backend(%s)", (pid,))
                with contextlib.suppress(
                    psycopg.errors.ObjectInUse, psycopg.errors.UndefinedObject
                ):
                    await c.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"could not drop the replication slots of database {name}")
        await c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())


@contextlib.asynccontextmanager
async def scratch_database(name: str) -> AsyncIterator[str]:
    """A new database ``name`` (``flt_*``) with :data:`SCHEMA`; dropped afterwards."""
    await drop_database(name)
    async with await psycopg.AsyncConnection.connect(PG_URL, autocommit=True) as c:
        await c.execute(f'CREATE DATABASE "{name}"'.encode())
    url = make_conninfo(PG_URL, dbname=name)
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
            for statement in SCHEMA:
                await c.execute(statement.encode())
        yield url
    finally:
        await drop_database(name)


class Writer:
    """Seeded random transactions at a bounded pace until :meth:`stop`.

    ``commits`` maps each seq to the monotonic time its commit returned, so a
    fault's recovery can be measured from the first transaction written after it.
    """

    def __init__(self, url: str, seed: int, rate: float = DEFAULT_RATE) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.interval = 1.0 / rate
        self.commits: dict[int, float] = {}
        self.reconnects = 0
        self._ids: list[int] = []
        self._next_id = 1
        self._last_seq = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._committed = asyncio.Condition()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="flt-writer")

    async def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, timeout_s)

    def check(self) -> None:
        """Raises the writer's own failure (so a wait does not run into its timeout)."""
        if self._task is not None and self._task.done():
            self._task.result()
            if not self._stop.is_set():
                raise RuntimeError("the writer stopped early")

    @property
    def last_seq(self) -> int:
        return self._last_seq

    async def first_commit_after(self, t0: float, timeout_s: float) -> int:
        """The seq of the first transaction whose commit returned after ``t0``."""
        deadline = time.monotonic() + timeout_s
        async with self._committed:
            while True:
                self.check()
                later = [s for s, t in self.commits.items() if t > t0]
                if later:
                    return min(later)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no upstream commit within {timeout_s} s of the fault")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._committed.wait(), min(remaining, 1.0))

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.url, autocommit=True, connect_timeout=5
                ) as conn:
                    await self._resync(conn)
                    await self._write(conn)
            except psycopg.OperationalError:
                # Postgres went away (a restart fault): try again, bounded by stop().
                self.reconnects += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 0.2)

    async def _resync(self, conn: psycopg.AsyncConnection[Any]) -> None:
        cur = await conn.execute(b"SELECT id FROM items ORDER BY id")
        self._ids = [r[0] for r in await cur.fetchall()]
        cur = await conn.execute(b"SELECT coalesce(max(seq), 0) FROM seq")
        row = await cur.fetchone()
        assert row is not None
        self._last_seq = int(row[0])
        self._next_id = max(self._ids, default=0) + 1

    async def _write(self, conn: psycopg.AsyncConnection[Any]) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while not self._stop.is_set():
            await self._one(conn, self._last_seq + 1)
            next_at += self.interval
            delay = next_at - loop.time()
            if delay > 0:
                # The pace of the load, not a wait for a condition.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
            else:
                next_at = loop.time()

    async def _one(self, conn: psycopg.AsyncConnection[Any], seq: int) -> None:
        rng = self.rng
        ids = list(self._ids)
        next_id = self._next_id
        async with conn.transaction():
            for _ in range(rng.randint(1, 3)):
                op = rng.random()
                if op < 0.5 or len(ids) < 5:
                    s = rng.choice([None, f"v{seq}", 'é✓ "q" \\ \t', ""])
                    await conn.execute(
                        "INSERT INTO items VALUES (%s, %s, %s)",
                        (next_id, rng.randint(-(2**31), 2**31 - 1), s),
                    )
                    ids.append(next_id)
                    next_id += 1
                elif op < 0.8:
                    await conn.execute(
                        "UPDATE items SET n = %s, s = %s WHERE id = %s",
                        (rng.randint(-1000, 1000), f"u{seq}", rng.choice(ids)),
                    )
                else:
                    target = ids.pop(rng.randrange(len(ids)))
                    await conn.execute("DELETE FROM items WHERE id = %s", (target,))
            await conn.execute("INSERT INTO seq VALUES (%s)", (seq,))
        self._ids = ids
        self._next_id = next_id
        self._last_seq = seq
        async with self._committed:
            self.commits[seq] = time.monotonic()
            self._committed.notify_all()
