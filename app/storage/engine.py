"""Connections to the change DB: which database, which schema, which engines.

SQLite (the default) gets two engines over one file in WAL mode: a writer with
exactly one connection whose transactions start with ``BEGIN IMMEDIATE`` (the
single writer takes the lock up front, so it never fails a lock upgrade), and a
small pool of readers for catch-up, whose snapshots never block the writer. A
new file is created ``0600`` (``app.private_files``).

Postgres gets one pooled engine; every statement is routed to the shard's
``"<app>_<shard>/cdc"`` schema with a schema translate map, and every
connection carries ``application_name = 'zero-change-streamer'`` like the
reference, so operators (and the reset path) can find its sessions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from app.logs import redact
from app.private_files import create_private
from app.storage.errors import ChangeDbConfigError
from app.storage.shard import APPLICATION_NAME as APPLICATION_NAME
from app.storage.shard import Shard as Shard
from app.storage.sqlite_group import TEMP_AUTO_VACUUM, SqliteStatements
from app.storage.sqlite_writer import SqliteWriterProcess

Dialect = Literal["sqlite", "postgresql"]
SqliteSynchronous = Literal["OFF", "NORMAL", "FULL", "EXTRA"]
SqliteWriter = Literal["process", "thread"]


@dataclass(frozen=True, slots=True)
class ChangeDbOptions:
    """Tuning that is not part of the URL."""

    # FULL: every group commit is fsynced before upstream is acked, so an ack
    # survives power loss, not only a process crash. Group commit keeps the
    # cost to one fsync per batch.
    sqlite_synchronous: SqliteSynchronous = "FULL"
    sqlite_busy_timeout_ms: int = 10_000
    # Where group commits run on SQLite: a writer process of their own (off the
    # event loop's GIL; storage/sqlite_writer.py) or aiosqlite's thread.
    sqlite_writer: SqliteWriter = "process"
    sqlite_readers: int = 4
    pg_pool_size: int = 5
    pg_max_overflow: int = 5
    pool_timeout_s: float = 30.0
    # The reference lets a change-log transaction idle at most 60 s.
    pg_idle_in_transaction_timeout_ms: int = 60_000
    # statement_timeout of every session (ZERO_CHANGE_STATEMENT_TIMEOUT_MS); 0: none.
    # Purges and migrations lift it for their transaction.
    pg_statement_timeout_ms: int = 0


def parse_change_db_url(value: str) -> URL:
    """Turns a ``ZERO_CHANGE_DB`` value into a SQLAlchemy URL with an async driver.

    Accepts ``postgres://`` / ``postgresql://`` URLs, ``sqlite:///path`` URLs and
    plain file paths (which mean SQLite).
    """
    text = value.strip()
    if not text:
        raise ChangeDbConfigError("change DB URL is empty")
    if "://" not in text:
        return URL.create("sqlite+aiosqlite", database=str(Path(text)))
    try:
        url = make_url(text)
    except ArgumentError as e:
        raise ChangeDbConfigError(f"change DB URL {redact(text)!r} is malformed: {e}") from e
    backend = url.get_backend_name()
    if backend in ("postgres", "postgresql"):
        return url.set(drivername="postgresql+psycopg")
    if backend == "sqlite":
        if not url.database or url.database == ":memory:":
            raise ChangeDbConfigError(
                "a SQLite change DB needs a file path (sqlite:///path/to/file.db); "
                "in-memory databases cannot be shared by the writer and the readers"
            )
        return url.set(drivername="sqlite+aiosqlite")
    raise ChangeDbConfigError(
        f"change DB URL {redact(text)!r} has unsupported scheme {url.drivername!r}: "
        "use postgres://, postgresql://, sqlite:/// or a file path"
    )


def reader_target(url: URL) -> str:
    """Where ``log_reader.open_log_reader`` finds the log of ``url``: the SQLite file's
    absolute path, or a libpq URL (password included: it goes to a child's
    environment, never to argv or a log line)."""
    if url.get_backend_name() == "sqlite":
        assert url.database is not None
        return str(Path(url.database).resolve())
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def describe_url(url: URL) -> str:
    """A URL for messages: password hidden, driver suffix dropped."""
    if url.get_backend_name() == "sqlite":
        return f"SQLite file {url.database}"
    shown = url.set(drivername=url.get_backend_name())
    return shown.render_as_string(hide_password=True)


@dataclass(frozen=True, slots=True)
class ChangeDb:
    """The engines of one shard's change DB.

    ``writer`` is for the single writer (storer, ownership, config, purge);
    ``reader`` is for catch-up reads. On Postgres they are the same engine.
    """

    url: URL
    shard: Shard
    dialect: Dialect
    writer: AsyncEngine
    reader: AsyncEngine
    # The schema holding the tables, or None on SQLite.
    schema: str | None
    # SQLite's group commits, when they run in a process of their own.
    sqlite_writer: SqliteWriterProcess | None = None

    @property
    def description(self) -> str:
        return describe_url(self.url)

    async def dispose(self) -> None:
        if self.sqlite_writer is not None:
            await self.sqlite_writer.close()
        await self.writer.dispose()
        if self.reader is not self.writer:
            await self.reader.dispose()

    def table_name(self, name: str) -> str:
        """A table's fully qualified, quoted name for hand-written SQL."""
        if self.schema is None:
            return f'"{name}"'
        return f'"{self.schema}"."{name}"'


def create_change_db(url: URL, shard: Shard, options: ChangeDbOptions | None = None) -> ChangeDb:
    """Creates the engines. No connection is made until first use."""
    opts = options or ChangeDbOptions()
    backend = url.get_backend_name()
    if backend == "sqlite":
        return _create_sqlite(url, shard, opts)
    if backend == "postgresql":
        return _create_postgres(url, shard, opts)
    raise ChangeDbConfigError(f"unsupported change DB backend {backend!r}")


def _create_sqlite(url: URL, shard: Shard, opts: ChangeDbOptions) -> ChangeDb:
    assert url.database is not None
    Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    writer = create_async_engine(url, pool_size=1, max_overflow=0, pool_timeout=opts.pool_timeout_s)
    # No rollback when a reader goes back to the pool: SQLAlchemy already rolls back
    # the transactions it began (Connection.close), and the catch-up reads
    # (storage.fastpath) run one autocommit SELECT each, so the pool's own reset was
    # a thread hop for nothing after every catch-up batch (~7 % of the event loop
    # under connection churn). tests/storage check no reader comes back in a
    # transaction.
    reader = create_async_engine(
        url,
        pool_size=opts.sqlite_readers,
        max_overflow=0,
        pool_timeout=opts.pool_timeout_s,
        pool_reset_on_return=None,
    )
    _configure_sqlite(writer, opts, begin="BEGIN IMMEDIATE")
    _configure_sqlite(reader, opts, begin="BEGIN")
    group_writer = None
    if opts.sqlite_writer == "process":
        group_writer = SqliteWriterProcess(
            str(Path(url.database).resolve()),
            SqliteStatements.for_tables('"changeLog"', '"replicationState"'),
            synchronous=opts.sqlite_synchronous,
            busy_timeout_ms=opts.sqlite_busy_timeout_ms,
        )
    return ChangeDb(
        url=url,
        shard=shard,
        dialect="sqlite",
        writer=writer,
        reader=reader,
        schema=None,
        sqlite_writer=group_writer,
    )


def _configure_sqlite(engine: AsyncEngine, opts: ChangeDbOptions, *, begin: str) -> None:
    database = engine.url.database
    assert database is not None

    @event.listens_for(engine.sync_engine, "do_connect")
    def _on_do_connect(*_: Any) -> None:
        # Before SQLite's open, which would create the file 0644: it holds every change.
        create_private(database)

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_conn: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
        # Let SQLAlchemy's "begin" event below issue BEGIN, instead of the sqlite3
        # module's implicit, DML-only transactions (which make DDL and reads
        # non-transactional).
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA synchronous={opts.sqlite_synchronous}")
            cursor.execute(f"PRAGMA busy_timeout={int(opts.sqlite_busy_timeout_ms)}")
            # Large changes pass through a TEMP table (storage/sqlite_group.py).
            cursor.execute(TEMP_AUTO_VACUUM)
        finally:
            cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        # A write transaction opened on the driver (storage.fastpath) is joined,
        # not begun again.
        if not conn.connection.driver_connection.in_transaction:
            conn.exec_driver_sql(begin)


def _create_postgres(url: URL, shard: Shard, opts: ChangeDbOptions) -> ChangeDb:
    options = (
        f"-c idle_in_transaction_session_timeout={int(opts.pg_idle_in_transaction_timeout_ms)}"
    )
    if opts.pg_statement_timeout_ms > 0:
        options += f" -c statement_timeout={int(opts.pg_statement_timeout_ms)}"
    engine = create_async_engine(
        url,
        pool_size=opts.pg_pool_size,
        max_overflow=opts.pg_max_overflow,
        pool_timeout=opts.pool_timeout_s,
        pool_pre_ping=True,
        connect_args={"application_name": APPLICATION_NAME, "options": options},
    ).execution_options(schema_translate_map={None: shard.cdc_schema})
    return ChangeDb(
        url=url,
        shard=shard,
        dialect="postgresql",
        writer=engine,
        reader=engine,
        schema=shard.cdc_schema,
    )
