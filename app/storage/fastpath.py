"""The change log's hot paths, on the database driver itself.

Appends and catch-up reads move hundreds of thousands of rows a second; going
through SQLAlchemy's statement execution and row objects cost 2–3× in
``bench/storage.py`` (SQLite appends 55k→ rows/s, catch-up reads 150k rows/s).
So these two paths take the driver connection that SQLAlchemy pooled and
opened the transaction on, and talk to it directly:

* SQLite (aiosqlite): ``executemany`` for appends, one ``fetchall`` per batch.
* Postgres (psycopg 3): ``COPY … FROM STDIN`` for appends, ``fetchall`` per batch.

Everything else (DDL, config, ownership, purge) stays on SQLAlchemy Core.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection

from app.storage.engine import ChangeDb
from app.storage.errors import DuplicateChangeError

Row = tuple[str, int, str, str | None]


class FastPath:
    """Driver-level statements for one change DB, built once."""

    def __init__(self, db: ChangeDb) -> None:
        self._dialect = db.dialect
        table = db.table_name("changeLog")
        columns = '"watermark", "pos", "change", "precommit"'
        if db.dialect == "postgresql":
            self._insert = f"COPY {table} ({columns}) FROM STDIN"
            p = "%s"
        else:
            self._insert = f"INSERT INTO {table} ({columns}) VALUES (?, ?, ?, ?)"
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

    async def insert(self, conn: AsyncConnection, rows: Sequence[Row]) -> None:
        driver = await _driver(conn)
        try:
            if self._dialect == "postgresql":
                async with driver.cursor() as cur, cur.copy(self._insert) as copy:
                    for row in rows:
                        await copy.write_row(row)
            else:
                cursor = await driver.executemany(self._insert, rows)
                await cursor.close()
        except (sqlite3.IntegrityError, psycopg.errors.UniqueViolation) as e:
            detail = " ".join(str(e).split())
            raise DuplicateChangeError(
                f"a change is already stored at the same (watermark, pos): {detail}"
            ) from e

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
        async with driver.execute(sql, params) as cur:
            return await cur.fetchall()  # type: ignore[no-any-return]


async def _driver(conn: AsyncConnection) -> Any:
    raw = await conn.get_raw_connection()
    return raw.driver_connection
