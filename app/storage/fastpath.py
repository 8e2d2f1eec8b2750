"""The change log's hot paths, on the database driver itself.

Group commits and catch-up reads move hundreds of thousands of rows a second.
Through SQLAlchemy's async layer each statement costs 0.5–0.9 ms of greenlet and
adapter overhead (a one-row group commit took 3.7 ms on SQLite, against 0.4 ms on
the bare driver), and its row objects halve read throughput. So these paths take
the driver connection that SQLAlchemy pooled and talk to it directly:

* the write transaction's own statements: begin (``BEGIN IMMEDIATE`` on SQLite),
  the ownership check (``FOR UPDATE`` on Postgres), the ``lastWatermark`` update,
  commit and rollback;
* appends: ``executemany`` on SQLite, ``COPY … FROM STDIN`` on Postgres;
* catch-up reads: one ``fetchall`` per batch, plain tuples.

Everything else (DDL, config, purge, the rare bookkeeping statements inside a
write) stays on SQLAlchemy Core; those join the driver's open transaction.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection

from app.storage import sqlite_group
from app.storage.engine import ChangeDb
from app.storage.errors import DuplicateChangeError
from app.storage.sqlite_group import SqliteStatements

Row = tuple[str, int, str, str | None]
_T = TypeVar("_T")


class FastPath:
    """Driver-level statements for one change DB, built once."""

    def __init__(self, db: ChangeDb) -> None:
        self._dialect = db.dialect
        state = db.table_name("replicationState")
        table = db.table_name("changeLog")
        if db.dialect == "postgresql":
            columns = '"watermark", "pos", "change", "precommit"'
            self._insert = f"COPY {table} ({columns}) FROM STDIN"
            self._select_owner = f'SELECT "owner" FROM {state} FOR UPDATE'
            self._set_head = f'UPDATE {state} SET "lastWatermark" = %s'
            p = "%s"
        else:
            # The group commit's statements, shared with the writer process.
            self._sqlite = SqliteStatements.for_tables(table, state)
            self._select_owner = self._sqlite.select_owner
            self._set_head = self._sqlite.set_head
            p = "?"
        # The change column is read as text so the driver never parses it.
        select = f'SELECT "watermark", "pos", "change"::text, "precommit" FROM {table}'
        if db.dialect == "sqlite":
            select = f'SELECT "watermark", "pos", "change", "precommit" FROM {table}'
        order = 'ORDER BY "watermark", "pos" LIMIT ' + p
        self._read_first = f'{select} WHERE "watermark" >= {p} AND "watermark" <= {p} {order}'
        self._read_next = (
            f'{select} WHERE ("watermark", "pos") > ({p}, {p}) AND "watermark" <= {p} {order}'
        )

    async def begin_write(self, conn: AsyncConnection) -> str | None:
        """Opens the write transaction and returns the owner, whose row it now locks."""
        driver = await _driver(conn)
        if self._dialect == "sqlite":
            # Each aiosqlite call is a hop to its thread (~0.1 ms): one per statement,
            # with cursors left to the garbage collector instead of a hop to close them.
            await driver.execute("BEGIN IMMEDIATE")
            rows = await driver.execute_fetchall(self._select_owner)
            row = rows[0] if rows else None
        else:
            async with driver.cursor() as cur:
                await cur.execute(self._select_owner)
                row = await cur.fetchone()
        return None if row is None else row[0]

    async def commit_write(self, conn: AsyncConnection, last_watermark: str | None) -> None:
        driver = await _driver(conn)
        if last_watermark is not None:
            if self._dialect == "sqlite":
                await driver.execute(self._set_head, (last_watermark,))
            else:
                async with driver.cursor() as cur:
                    await cur.execute(self._set_head, (last_watermark,))
        await driver.commit()

    async def rollback_write(self, conn: AsyncConnection) -> None:
        driver = await _driver(conn)
        await driver.rollback()

    async def insert(self, conn: AsyncConnection, rows: Sequence[Row]) -> None:
        driver = await _driver(conn)
        try:
            if self._dialect == "postgresql":
                async with driver.cursor() as cur, cur.copy(self._insert) as copy:
                    for row in rows:
                        await copy.write_row(row)
            else:
                await _in_driver_thread(driver, self._insert_sqlite, rows)
        except (sqlite3.IntegrityError, psycopg.errors.UniqueViolation) as e:
            raise _duplicate(e) from e

    async def commit_rows_sqlite(
        self, conn: AsyncConnection, owner: str, rows: Sequence[Row], last_watermark: str
    ) -> str | None:
        """SQLite: a whole write transaction of plain rows in one hop to the driver's
        thread — begin, ownership check, inserts, ``lastWatermark``, commit — where
        the general path takes a hop (and GIL hand-overs with the event loop) per
        statement. Writes nothing unless ``owner`` still owns the log; returns the
        owner found."""
        driver = await _driver(conn)
        try:
            current: str | None = await _in_driver_thread(
                driver, self._commit_rows_sqlite, owner, rows, last_watermark
            )
        except sqlite3.IntegrityError as e:
            raise _duplicate(e) from e
        return current

    def _commit_rows_sqlite(
        self, sq: sqlite3.Connection, owner: str, rows: Sequence[Row], last_watermark: str
    ) -> str | None:
        return sqlite_group.commit_rows(sq, self._sqlite, owner, rows, last_watermark)

    def _insert_sqlite(self, sq: sqlite3.Connection, rows: Sequence[Row]) -> None:
        sqlite_group.insert_rows(sq, self._sqlite, rows)

    async def read_first(
        self, conn: AsyncConnection, from_watermark: str, up_to: str, limit: int
    ) -> list[Row]:
        return await self._fetch(conn, self._read_first, (from_watermark, up_to, limit))

    async def read_next(
        self, conn: AsyncConnection, after: tuple[str, int], up_to: str, limit: int
    ) -> list[Row]:
        return await self._fetch(conn, self._read_next, (after[0], after[1], up_to, limit))

    async def _fetch(self, conn: AsyncConnection, sql: str, params: tuple[Any, ...]) -> list[Row]:
        driver = await _driver(conn)
        if self._dialect == "postgresql":
            async with driver.cursor() as cur:
                await cur.execute(sql, params)
                return await cur.fetchall()  # type: ignore[no-any-return]
        return await driver.execute_fetchall(sql, params)  # type: ignore[no-any-return]


async def _driver(conn: AsyncConnection) -> Any:
    raw = await conn.get_raw_connection()
    return raw.driver_connection


async def _in_driver_thread(driver: Any, fn: Callable[..., _T], *args: Any) -> _T:
    """Runs ``fn(sqlite3_connection, *args)`` in an aiosqlite connection's own thread.

    aiosqlite's public calls are one statement each; this uses the queue they all
    go through (``_execute``) and the connection it owns (``_conn``), private names
    that have been stable since aiosqlite 0.17 (tests/storage exercise every use).
    """
    result: _T = await driver._execute(fn, driver._conn, *args)
    return result


def _duplicate(e: Exception) -> DuplicateChangeError:
    return DuplicateChangeError.from_driver(str(e))
