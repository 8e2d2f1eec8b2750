"""The change log for a process that only reads it: the replica follower's child.

The service reads the log through its engines (``changelog`` and ``fastpath``: pooled
connections, a writer process, SQLAlchemy for the bookkeeping). A process that only
follows the log needs three reads — the replica version, the head
(``lastWatermark``) and rows in ``(watermark, pos)`` order — and here they run on
one plain connection: ``sqlite3`` from the standard library, or a synchronous
``psycopg`` connection. Importing this module loads neither SQLAlchemy nor aiosqlite
(about 50 MiB of the follower's RSS), and a read is a call on the caller's thread,
not a hop to a driver thread and back (decision 36).

Where to read comes from the service as a *target* (``engine.reader_target``): an
absolute SQLite file path, or a libpq URL, which libpq reads as it reads the same
URL for the change DB's engine (the upstream's rules, ``conninfo.py``, are for
``ZERO_UPSTREAM_DB``; docs/architecture.md, decision 50). Each batch is its own short read, as the
catch-up reads are (decision 8): no snapshot is held between batches, and on
Postgres every statement runs in autocommit, so a follower never holds a lock a
reset or a migration waits on.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final, Self
from urllib.parse import quote

from app.protocol.pieces import Text
from app.storage.shard import APPLICATION_NAME, Shard

if TYPE_CHECKING:
    import psycopg

__all__ = ["LogReader", "StoredRow", "open_log_reader", "read_statements"]

# A row as catch-up reads it: (watermark, pos, change, precommit). Plain tuples
# straight from the driver; wrapping 400k rows/s in objects costs a third.
StoredRow = tuple[str, int, Text, str | None]

POSTGRES_PREFIX: Final = "postgresql://"
BUSY_TIMEOUT_MS: Final = 10_000


def read_statements(table: str, change: str, p: str) -> tuple[str, str]:
    """The first and the next batch of a read in ``(watermark, pos)`` order, selecting
    ``change`` as the change (``p`` is the driver's placeholder)."""
    select = f'SELECT "watermark", "pos", {change}, "precommit" FROM {table}'
    order = 'ORDER BY "watermark", "pos" LIMIT ' + p
    return (
        f'{select} WHERE "watermark" >= {p} AND "watermark" <= {p} {order}',
        f'{select} WHERE ("watermark", "pos") > ({p}, {p}) AND "watermark" <= {p} {order}',
    )


class LogReader:
    """Reads of one shard's change log on one connection (not thread-safe)."""

    def __init__(self, conn: sqlite3.Connection | psycopg.Connection[Any], shard: Shard) -> None:
        self._conn = conn
        if isinstance(conn, sqlite3.Connection):
            p, prefix, change = "?", "", '"change"'
        else:
            # The change column is read as text, so the driver never parses it.
            p, prefix, change = "%s", f'"{shard.cdc_schema}".', '"change"::text'
        self._config = f'SELECT "replicaVersion" FROM {prefix}"replicationConfig"'
        self._head = f'SELECT "lastWatermark" FROM {prefix}"replicationState"'
        self._first, self._next = read_statements(f'{prefix}"changeLog"', change, p)

    def replica_version(self) -> str | None:
        """The replica version the log is for (None: the change DB is not set up)."""
        return self._scalar(self._config)

    def last_watermark(self) -> str | None:
        """The log's durable head."""
        return self._scalar(self._head)

    def read(self, start: str, up_to: str, batch_size: int) -> Iterator[list[StoredRow]]:
        """Rows with ``start <= watermark <= up_to``, in batches of at most
        ``batch_size``, each its own read (see ``ChangeLog.read`` for why batches
        join up exactly)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        rows = self._fetch(self._first, (start, up_to, batch_size))
        while rows:
            yield rows
            if len(rows) < batch_size:
                return
            last = rows[-1]
            rows = self._fetch(self._next, (last[0], last[1], up_to, batch_size))

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _scalar(self, sql: str) -> str | None:
        rows = self._fetch(sql, ())
        return None if not rows else rows[0][0]

    def _fetch(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        return self._conn.execute(sql, params).fetchall()


def open_log_reader(target: str, shard: Shard) -> LogReader:
    """A reader of ``shard``'s log at ``target`` (``engine.reader_target``)."""
    if target.startswith(POSTGRES_PREFIX):
        import psycopg  # only a follower of a Postgres change DB loads it

        conn: sqlite3.Connection | psycopg.Connection[Any] = psycopg.connect(
            target, autocommit=True, application_name=APPLICATION_NAME
        )
    else:
        # mode=rw: a missing file is an error, not a new empty database;
        # isolation_level=None: every SELECT is its own autocommit read; query_only
        # makes a write through this connection an error, whatever calls it.
        uri = f"file:{quote(target)}?mode=rw"
        conn = sqlite3.connect(uri, uri=True, isolation_level=None)
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA query_only=1")
    return LogReader(conn, shard)
