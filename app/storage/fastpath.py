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

A change text too large to hold whole (``Pieces``, decision 44) is written and,
with ``pieces_over``, read back without any call here touching it whole while
holding the GIL:

* SQLite writes stage its UTF-8 in a TEMP blob (``sqlite_group``), in the
  driver's thread; reads copy the row's text into such a blob inside SQLite
  and read it back a piece at a time (``Blob.read``), in the same thread.
  Substring queries were the alternative: SQLite 3.40 loads the whole value
  for every ``substr``, which makes reading by ranges quadratic.
* Postgres writes send the row to ``COPY`` piece by piece, each escaped on its
  own (COPY's text escapes are per character, so that equals escaping the
  whole); reads stream the text's UTF-8 as rows of ``PIECE_CHARS`` bytes cut
  server-side from one ``convert_to`` of it (by bytes: a character offset costs
  a scan from the start of the value, which is quadratic again), decoded in a
  thread.

Everything else (DDL, config, purge, the rare bookkeeping statements inside a
write) stays on SQLAlchemy Core; those join the driver's open transaction.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from operator import itemgetter
from typing import Any, Final, TypeVar, cast

import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection

from app.protocol.pieces import PIECE_CHARS, Pieces, Text, decode_pieces
from app.storage import sqlite_group
from app.storage.engine import ChangeDb
from app.storage.errors import ChangeTooLargeError, DuplicateChangeError, StorageError
from app.storage.log_reader import read_statements
from app.storage.sqlite_group import CREATE_STAGE, STAGE_TABLE, UNSTAGE, SqliteStatements

Row = tuple[str, int, Text, str | None]
# A row of a read with pieces_over: its change is None where it is to be read apart.
_ReadRow = tuple[str, int, Text | None, str | None]
_T = TypeVar("_T")
_CHANGE = itemgetter(2)
_OFFSET = itemgetter(0)


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
            # The change column is read as text so the driver never parses it.
            change = '"change"::text'
            size = f"octet_length({change})"
            # A text's UTF-8 in rows of %s bytes, cut from one convert_to of it
            # (OFFSET 0 keeps the subquery apart, so it is not redone for each row).
            self._read_text = (
                "SELECT g.i, substring(v.b FROM g.i FOR %s)"
                f" FROM (SELECT convert_to({change}, 'UTF8') AS b FROM {table}"
                ' WHERE "watermark" = %s AND "pos" = %s OFFSET 0) AS v,'
                " generate_series(1, octet_length(v.b), %s) AS g(i)"
            )
        else:
            # The group commit's statements, shared with the writer process.
            self._sqlite = SqliteStatements.for_tables(table, state)
            self._select_owner = self._sqlite.select_owner
            self._set_head = self._sqlite.set_head
            p = "?"
            change = '"change"'
            size = 'length(CAST("change" AS BLOB))'
            # A text's UTF-8 into a staged blob, copied inside SQLite.
            self._read_text = (
                f'INSERT INTO temp."{STAGE_TABLE}" ("utf8") SELECT CAST("change" AS BLOB)'
                f' FROM {table} WHERE "watermark" = ? AND "pos" = ?'
            )
        self._read_first, self._read_next = read_statements(table, change, p)
        # With pieces_over: NULL (no stored change is NULL) for a change of more
        # bytes than that, to be read apart. Bytes, not characters: counting the
        # characters of every small change would cost every catch-up batch.
        self._read_first_pieces, self._read_next_pieces = read_statements(
            table, f"CASE WHEN {size} <= {p} THEN {change} END", p
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
                encoding = driver.info.encoding
                async with driver.cursor() as cur, cur.copy(self._insert) as copy:
                    for row in rows:
                        change = row[2]
                        if isinstance(change, str):
                            await copy.write_row(row)
                        else:
                            await _copy_text_row(copy, row, change, encoding)
            else:
                await _in_driver_thread(driver, self._insert_sqlite, rows)
        except (sqlite3.IntegrityError, psycopg.errors.UniqueViolation) as e:
            raise _duplicate(e) from e
        except sqlite_group.ChangeTooLarge as e:
            raise ChangeTooLargeError(str(e)) from None

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
        except sqlite_group.ChangeTooLarge as e:
            raise ChangeTooLargeError(str(e)) from None
        return current

    def _commit_rows_sqlite(
        self, sq: sqlite3.Connection, owner: str, rows: Sequence[Row], last_watermark: str
    ) -> str | None:
        plain, texts = sqlite_group.split_texts(rows)
        return sqlite_group.commit_rows(sq, self._sqlite, owner, plain, last_watermark, texts)

    def _insert_sqlite(self, sq: sqlite3.Connection, rows: Sequence[Row]) -> None:
        plain, texts = sqlite_group.split_texts(rows)
        sqlite_group.insert_rows(sq, self._sqlite, plain, texts)

    async def read_first(
        self,
        conn: AsyncConnection,
        from_watermark: str,
        up_to: str,
        limit: int,
        pieces_over: int | None = None,
    ) -> list[Row]:
        """The first rows of a catch-up; see ``ChangeLog.read`` for ``pieces_over``."""
        if pieces_over is None:
            return await self._fetch(conn, self._read_first, (from_watermark, up_to, limit))
        params = (pieces_over, from_watermark, up_to, limit)
        return await self._fetch_pieces(conn, self._read_first_pieces, params, pieces_over)

    async def read_next(
        self,
        conn: AsyncConnection,
        after: tuple[str, int],
        up_to: str,
        limit: int,
        pieces_over: int | None = None,
    ) -> list[Row]:
        if pieces_over is None:
            return await self._fetch(conn, self._read_next, (after[0], after[1], up_to, limit))
        params = (pieces_over, after[0], after[1], up_to, limit)
        return await self._fetch_pieces(conn, self._read_next_pieces, params, pieces_over)

    async def _fetch(self, conn: AsyncConnection, sql: str, params: tuple[Any, ...]) -> list[Row]:
        driver = await _driver(conn)
        if self._dialect == "postgresql":
            async with driver.cursor() as cur:
                await cur.execute(sql, params)
                return await cur.fetchall()  # type: ignore[no-any-return]
        return await driver.execute_fetchall(sql, params)  # type: ignore[no-any-return]

    async def _fetch_pieces(
        self, conn: AsyncConnection, sql: str, params: tuple[Any, ...], pieces_over: int
    ) -> list[Row]:
        """A batch whose changes longer than ``pieces_over`` come as ``Pieces``."""
        driver = await _driver(conn)
        if self._dialect == "sqlite":
            return await _in_driver_thread(
                driver, self._select_pieces_sqlite, sql, params, pieces_over
            )
        async with driver.cursor() as cur:
            await cur.execute(sql, params)
            rows: list[_ReadRow] = await cur.fetchall()
        if None in map(_CHANGE, rows):
            for i, (watermark, pos, change, precommit) in enumerate(rows):
                if change is None:
                    text = await self._read_text_pg(driver, watermark, pos)
                    rows[i] = (watermark, pos, _pieces_over(text, pieces_over), precommit)
        return cast(list[Row], rows)  # no change is None now

    def _select_pieces_sqlite(
        self, sq: sqlite3.Connection, sql: str, params: tuple[Any, ...], pieces_over: int
    ) -> list[Row]:
        rows: list[_ReadRow] = sq.execute(sql, params).fetchall()
        if None in map(_CHANGE, rows):
            for i, (watermark, pos, change, precommit) in enumerate(rows):
                if change is None:
                    text = self._read_text_sqlite(sq, watermark, pos)
                    rows[i] = (watermark, pos, _pieces_over(text, pieces_over), precommit)
        return cast(list[Row], rows)  # no change is None now

    def _read_text_sqlite(self, sq: sqlite3.Connection, watermark: str, pos: int) -> Text:
        """A stored change through a staged blob, read back a piece at a time (in
        the driver's thread: the copy into the blob is one ``sqlite3_step``, which
        does not hold the GIL, and each read and decode is one piece)."""
        sq.execute(CREATE_STAGE)
        staged = sq.execute(self._read_text, (watermark, pos))
        rowid = staged.lastrowid
        if staged.rowcount != 1 or rowid is None:
            raise StorageError(f"change ({watermark}, {pos}) is no longer in the change log")
        try:
            with sq.blobopen(STAGE_TABLE, "utf8", rowid, readonly=True, name="temp") as blob:
                return decode_pieces(iter(partial(blob.read, PIECE_CHARS), b""))
        finally:
            sq.execute(UNSTAGE, (rowid,))

    async def _read_text_pg(self, driver: Any, watermark: str, pos: int) -> Text:
        """A stored change as rows of ``PIECE_CHARS`` bytes, decoded in a thread."""
        chunks: list[tuple[int, bytes]] = []
        params = (PIECE_CHARS, watermark, pos, PIECE_CHARS)
        async with driver.cursor(binary=True) as cur:
            async for offset, chunk in cur.stream(self._read_text, params):
                chunks.append((offset, chunk))
                await asyncio.sleep(0)  # rows libpq already holds come without a wait
        if not chunks:
            raise StorageError(f"change ({watermark}, {pos}) is no longer in the change log")
        chunks.sort(key=_OFFSET, reverse=True)
        return await asyncio.to_thread(decode_pieces, _taken(chunks))


def _taken(chunks: list[tuple[int, bytes]]) -> Iterator[bytes]:
    """The chunks of a list in reverse order, each let go of as it is taken."""
    while chunks:
        yield chunks.pop()[1]


def _pieces_over(text: Text, pieces_over: int) -> Text:
    """``text`` as ``Pieces`` if it is longer than ``pieces_over`` characters, else
    whole. (A text read apart has more bytes than that, but may still have no more
    characters; joining it then copies at most ``pieces_over`` characters.)"""
    if len(text) <= pieces_over:
        return text if isinstance(text, str) else text.join()
    return text if isinstance(text, Pieces) else Pieces((text,))


def copy_escape(text: str) -> str:
    """``text`` as a field of COPY's text format. Every escape replaces one
    character, so escaping a text's pieces one by one equals escaping the whole."""
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


# Postgres' largest allocation (MaxAllocSize, 1 GiB - 1): a COPY line, and so a
# stored change, must fit in it.
_PG_MAX_LINE: Final = (1 << 30) - 1


async def _copy_text_row(copy: Any, row: Row, text: Pieces, encoding: str) -> None:
    """One row of COPY's text format whose change is written a piece per call,
    the event loop running between pieces. (Rows that ``write_row`` buffers go
    out whole, before or after this one: the stream stays a sequence of rows.)"""
    watermark, pos, _, precommit = row

    def too_large(size: int) -> ChangeTooLargeError:
        return ChangeTooLargeError(
            f"the change at watermark {watermark}, position {pos} is over {size:,} bytes, "
            f"more than Postgres takes in one COPY line ({_PG_MAX_LINE:,})"
        )

    if text.utf8_length() > _PG_MAX_LINE:  # before any of it is sent
        raise too_large(text.utf8_length())
    line = 0
    await copy.write(f"{copy_escape(watermark)}\t{pos}\t".encode(encoding))
    for part in text.parts:
        data = copy_escape(part).encode(encoding)
        line += len(data)
        if line > _PG_MAX_LINE:  # escapes made it longer: COPY is aborted
            raise too_large(line)
        await copy.write(data)
        del data
        await asyncio.sleep(0)
    end = "\\N" if precommit is None else copy_escape(precommit)
    await copy.write(f"\t{end}\n".encode(encoding))


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
