"""The change log: group-committed appends, catch-up reads, purge.

A row is one message of one upstream transaction: ``(watermark, pos, change,
precommit)`` where ``watermark`` is the transaction's commit watermark, ``pos``
its position (begin = 0 … commit = last) and ``change`` the stored body text of
the message (see ``app.protocol.codec``): a ``str``, or for a large one the
``Pieces`` it travels as, which no write path here joins and which catch-up
reads give back in pieces when asked to (``read(pieces_over=…)``, decision 44).

Writes happen in a ``WriteTransaction``: one database transaction that may hold
many upstream transactions (group commit), takes the ownership lock first and
moves ``replicationState.lastWatermark`` in the same commit, so the log and its
head never disagree.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import NamedTuple

from sqlalchemy import delete, func, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection

from app.protocol.pieces import Text
from app.storage.backfill import BookkeepingOp, apply_bookkeeping
from app.storage.engine import ChangeDb
from app.storage.errors import OwnershipLostError, PurgeLockedError
from app.storage.fastpath import FastPath
from app.storage.log_reader import StoredRow as StoredRow
from app.storage.tables import change_log, replication_state

DEFAULT_READ_BATCH = 2000


class ChangeRow(NamedTuple):
    """One stored message. ``precommit`` is set only on commit rows."""

    watermark: str
    pos: int
    change: Text
    precommit: str | None = None


@dataclass(slots=True)
class WriteTransaction:
    """An open write transaction of the owner. Use ``ChangeLog.write``."""

    _conn: AsyncConnection
    _fast: FastPath
    _last_watermark: str | None = None
    rows_written: int = 0

    async def append(self, rows: Sequence[StoredRow]) -> None:
        """Inserts rows (of any number of upstream transactions) in one statement
        (and a change in pieces a piece at a time)."""
        if not rows:
            return
        await self._fast.insert(self._conn, rows)
        self.rows_written += len(rows)

    async def apply(self, op: BookkeepingOp) -> None:
        """Backfill / table-metadata bookkeeping for a schema change, in stream order."""
        await apply_bookkeeping(self._conn, op)

    def set_last_watermark(self, watermark: str) -> None:
        """The new durable head, written at commit."""
        self._last_watermark = watermark

    @property
    def connection(self) -> AsyncConnection:
        return self._conn


class ChangeLog:
    """The change log of one shard."""

    def __init__(self, db: ChangeDb) -> None:
        self._db = db
        self._fast = FastPath(db)
        # Told of a purge before it deletes (the storer's in-memory tail must not
        # keep serving what the log no longer has).
        self._before_purge: list[Callable[[str], None]] = []
        # Rows this process's purges deleted. Every row is after the replica version,
        # so once it is > 0 the log no longer starts there (Storer: a subscriber at the
        # replica version is then too old, where the reference would leave it a gap).
        self.purged_rows = 0

    def before_purge(self, callback: Callable[[str], None]) -> None:
        """Calls ``callback(watermark)`` at the start of every ``purge_before``."""
        self._before_purge.append(callback)

    @property
    def db(self) -> ChangeDb:
        return self._db

    @asynccontextmanager
    async def write(self, owner: str) -> AsyncIterator[WriteTransaction]:
        """A write transaction that commits only if ``owner`` still owns the log.

        The ownership row is locked first (``FOR UPDATE`` on Postgres; on SQLite the
        ``BEGIN IMMEDIATE`` write lock), so no takeover can happen between the
        check and the commit. A mismatch raises ``OwnershipLostError`` and nothing
        of the transaction is written.
        """
        async with self._db.writer.connect() as conn:
            try:
                current = await self._fast.begin_write(conn)
                if current != owner:
                    raise OwnershipLostError(current)
                tx = WriteTransaction(conn, self._fast)
                yield tx
                await self._fast.commit_write(conn, tx._last_watermark)
            except BaseException:
                await self._fast.rollback_write(conn)
                raise

    async def start_writer(self) -> None:
        """Starts SQLite's writer process, if there is one, before the first commit
        needs it (its start-up would otherwise delay that commit)."""
        if self._db.sqlite_writer is not None:
            await self._db.sqlite_writer.start()

    async def commit_rows(self, owner: str, rows: Sequence[StoredRow], last_watermark: str) -> None:
        """One write transaction of plain rows that moves ``lastWatermark``: what a
        group commit without bookkeeping is. ``OwnershipLostError`` as ``write``.

        On SQLite the whole transaction is one request to the writer process
        (``storage/sqlite_writer.py``), or one hop to the driver's thread.
        """
        if self._db.dialect != "sqlite":
            async with self.write(owner) as tx:
                await tx.append(rows)
                tx.set_last_watermark(last_watermark)
            return
        if self._db.sqlite_writer is not None:
            current = await self._db.sqlite_writer.commit_rows(owner, rows, last_watermark)
        else:
            async with self._db.writer.connect() as conn:
                current = await self._fast.commit_rows_sqlite(conn, owner, rows, last_watermark)
        if current != owner:
            raise OwnershipLostError(current)

    async def read(
        self,
        from_watermark: str,
        up_to: str,
        *,
        batch_size: int = DEFAULT_READ_BATCH,
        first_batch: int | None = None,
        pieces_over: int | None = None,
    ) -> AsyncGenerator[list[StoredRow], None]:
        """Rows with ``from_watermark <= watermark <= up_to`` in ``(watermark, pos)`` order.

        Rows are ``(watermark, pos, change, precommit)`` tuples; every change is a
        ``str``, unless ``pieces_over`` is given: then a change longer than that
        many characters comes as ``Pieces`` (each piece at most ``PIECE_CHARS``),
        read apart after its batch without the whole text ever being one string
        in this process (it is one of the immutable rows: the reads agree).
        Yields batches of at most ``batch_size`` rows, each read in its own short
        snapshot (long SQLite readers would stall WAL checkpoints). With
        ``first_batch`` the first batch has that many rows and each next one twice
        as many, up to ``batch_size``: a reader that stops early (a subscriber that
        leaves right after subscribing) costs little, and the first rows come soon.
        Rows at or below ``up_to`` are immutable once committed, so batches join up
        exactly as long as no purge removes rows above ``from_watermark`` meanwhile;
        the purge floor (at most every reader's watermark) guarantees that.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if first_batch is not None and first_batch < 1:
            raise ValueError(f"first_batch must be at least 1, got {first_batch}")
        size = min(batch_size, first_batch or batch_size)
        after: tuple[str, int] | None = None
        while True:
            async with self._db.reader.connect() as conn:
                if after is None:
                    rows = await self._fast.read_first(
                        conn, from_watermark, up_to, size, pieces_over
                    )
                else:
                    rows = await self._fast.read_next(conn, after, up_to, size, pieces_over)
            if not rows:
                return
            yield rows
            if len(rows) < size:
                return
            after = (rows[-1][0], rows[-1][1])
            size = min(batch_size, size * 2)

    async def min_watermark(self) -> str | None:
        async with self._db.reader.connect() as conn:
            value: str | None = await conn.scalar(select(func.min(change_log.c.watermark)))
            return value

    async def max_watermark(self) -> str | None:
        async with self._db.reader.connect() as conn:
            value: str | None = await conn.scalar(select(func.max(change_log.c.watermark)))
            return value

    async def count(self) -> int:
        async with self._db.reader.connect() as conn:
            return int(await conn.scalar(select(func.count()).select_from(change_log)) or 0)

    async def size_bytes(self) -> int:
        """Bytes the change log takes: on Postgres its table and indexes; on SQLite
        the file's pages in use (the file holds little else, and freed pages are
        reused by later appends, so this — not the file size — is what grows)."""
        async with self._db.reader.connect() as conn:
            if self._db.dialect == "postgresql":
                name = self._db.table_name("changeLog")
                value = await conn.scalar(text(f"SELECT pg_total_relation_size('{name}')"))
                return int(value or 0)
            pages = await conn.scalar(text("PRAGMA page_count"))
            free = await conn.scalar(text("PRAGMA freelist_count"))
            size = await conn.scalar(text("PRAGMA page_size"))
            return (int(pages or 0) - int(free or 0)) * int(size or 0)

    async def purge_before(self, watermark: str, owner: str) -> int:
        """Deletes transactions below ``watermark``, always keeping the newest one.

        The newest stored transaction is the catch-up boundary even when backups
        are ahead of the log. Raises ``PurgeLockedError`` if a replica restore
        holds the purge lock (Postgres) and ``OwnershipLostError`` if ``owner`` no
        longer owns the log (nothing is deleted then). Returns the rows deleted.
        """
        for callback in self._before_purge:
            callback(watermark)
        async with self._db.writer.connect() as conn, conn.begin():
            if self._db.dialect == "postgresql":
                # One DELETE of a long-unpurged log may outlast the statement timeout
                # (ZERO_CHANGE_STATEMENT_TIMEOUT_MS); failing it would only let it grow.
                await conn.exec_driver_sql("SET LOCAL statement_timeout = 0")
                await _lock_first_row_nowait(conn)
            newest = await conn.scalar(select(func.max(change_log.c.watermark)))
            if newest is None:
                return 0
            result = await conn.execute(
                delete(change_log).where(
                    change_log.c.watermark < watermark, change_log.c.watermark < newest
                )
            )
            await _verify_purge_owner(conn, self._db, owner, watermark)
        deleted = int(result.rowcount)
        self.purged_rows += deleted  # committed
        return deleted


async def _verify_purge_owner(
    conn: AsyncConnection, db: ChangeDb, owner: str, purge_to: str
) -> None:
    stmt = select(replication_state.c.owner)
    if db.dialect == "postgresql":
        stmt = stmt.with_for_update(read=True)
    current = await conn.scalar(stmt)
    if current != owner:
        raise OwnershipLostError(
            current,
            f"aborting changeLog purge to {purge_to} because ownership has been taken by {current}",
        )


async def _lock_first_row_nowait(conn: AsyncConnection) -> None:
    stmt = (
        select(change_log.c.watermark)
        .order_by(change_log.c.watermark, change_log.c.pos)
        .limit(1)
        .with_for_update(nowait=True)
    )
    try:
        await conn.execute(stmt)
    except OperationalError as e:
        if getattr(e.orig, "sqlstate", None) == "55P03":
            raise PurgeLockedError("the change log is locked by a replica restore") from e
        raise
