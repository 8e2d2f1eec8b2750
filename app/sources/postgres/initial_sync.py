"""Initial sync: a new SQLite replica from a Postgres snapshot (spec/source.md §6.1).

1. Check the upstream and set the shard up (publications, triggers).
2. Create the slot on a replication connection; it exports a snapshot whose point is
   exactly where the slot's stream starts, so copy + stream miss and repeat nothing.
   ``replicaVersion`` = LexiVersion of the slot's consistent point.
3. Read the published schema inside that snapshot and create the replica's tables
   (each with ``_0_version`` defaulting to the replica version) and column metadata.
4. Copy every table with ``COPY (SELECT …) TO STDOUT`` (text format, see
   :mod:`~app.sources.postgres.copy_text`) from parallel workers that each import the
   snapshot. Values go through the same parsers as the stream, then into SQLite:
   each worker inserts its rows through its own SQLite connection, a batch of
   about 2 MiB per transaction (:mod:`~app.sources.postgres.copy_load`).
5. Create the unique indexes, commit, record the synced schema in ``replicas``.

The replica is built in ``<file>.syncing`` and renamed into place only when it is
complete, so a failed sync leaves no half-made replica; the slot is dropped too.
Progress (rows, bytes, rate, ETA per table that takes more than a few seconds) is a
live bar on a terminal and a log line every few seconds otherwise (app/progress.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import psycopg
from psycopg import sql as pgsql

from app.progress import Job, ProgressView
from app.replica import metadata
from app.replica.ddl import (
    create_index_statement,
    create_table_statement,
    lite_table_columns,
    lite_table_name,
    quote_id,
)
from app.replica.lite_types import JSON_STRINGIFIED, lite_value
from app.replica.schema import init_replica, open_replica, remove_replica_files
from app.sources.postgres.conninfo import async_connect, connect
from app.sources.postgres.copy_load import copy_table, open_loader
from app.sources.postgres.published import PublishedSchema, TableSpec, published_schema
from app.sources.postgres.shard import ShardConfig, check_published_tables, setup_shard
from app.sources.postgres.slots import CreatedSlot, create_replication_slot, drop_slot
from app.sources.postgres.slots import record_initial_sync as record_sync
from app.sources.postgres.values import (
    DATE,
    FLOAT4,
    FLOAT8,
    INT2,
    INT4,
    INT8,
    NUMERIC,
    OID,
    TIME,
    TIMESTAMP,
    TIMESTAMPTZ,
    TIMETZ,
    TypeRegistry,
    load_type_registry,
)

__all__ = [
    "InitialSyncError",
    "SyncResult",
    "initial_sync",
]

log = logging.getLogger(__name__)

DEFAULT_WORKERS: Final = 3
# Copy threads wait this long for the replica's write lock (another thread's batch).
LITE_BUSY_TIMEOUT_S: Final = 600.0

T = TypeVar("T")


class InitialSyncError(Exception):
    """The sync failed; nothing was left behind (slot dropped, partial file removed)."""


@dataclass(frozen=True, slots=True)
class SyncResult:
    replica_version: str
    slot: str
    replica_id: str
    publications: tuple[str, ...]
    ddl_detection: bool
    initial_schema: PublishedSchema
    rows: int
    seconds: float


async def initial_sync(
    upstream_url: str,
    cfg: ShardConfig,
    replica_file: Path,
    *,
    workers: int = DEFAULT_WORKERS,
    failover: bool = False,
) -> SyncResult:
    """Builds ``replica_file`` from the upstream; replaces an existing one only on success.

    ``workers`` tables are copied at once, each over a connection of its own
    (``ZERO_INITIAL_SYNC_TABLE_COPY_WORKERS``); ``failover`` makes the slot a
    failover slot (``ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER``, Postgres 17+).
    """
    started = time.monotonic()
    async with await async_connect(upstream_url, autocommit=True) as conn:
        internal = await setup_shard(conn, cfg)
        registry = await load_type_registry(conn)
    publications = tuple(sorted(internal.publications))
    log.info("upstream is set up with publications %s", list(publications))
    slot = await create_replication_slot(upstream_url, cfg, failover=failover)
    log.info(
        "created replication slot %s at %s (replica version %s)",
        slot.slot_name,
        slot.consistent_point,
        slot.replica_version,
    )
    staging = replica_file.with_name(replica_file.name + ".syncing")
    remove_replica_files(staging)
    try:
        schema, rows = await _copy_into(
            upstream_url, slot, publications, registry, staging, workers
        )
        context = _server_context()
        async with await async_connect(upstream_url, autocommit=True) as conn:
            await record_sync(conn, cfg, slot.replica_id, schema, context)
    except BaseException as e:
        await slot.close()
        remove_replica_files(staging)
        await drop_slot(upstream_url, slot.slot_name)
        if isinstance(e, Exception) and not isinstance(e, InitialSyncError):
            raise InitialSyncError(f"initial sync failed: {e}") from e
        raise
    await slot.close()
    remove_replica_files(replica_file)
    os.replace(staging, replica_file)
    seconds = time.monotonic() - started
    log.info(
        "initial sync done: %d rows in %d tables in %.1f s (%.0f rows/s), replica version %s",
        rows,
        len(schema["tables"]),
        seconds,
        rows / seconds if seconds > 0 else 0,
        slot.replica_version,
    )
    return SyncResult(
        replica_version=slot.replica_version,
        slot=slot.slot_name,
        replica_id=slot.replica_id,
        publications=publications,
        ddl_detection=internal.ddl_detection,
        initial_schema=schema,
        rows=rows,
        seconds=seconds,
    )


async def _copy_into(
    upstream_url: str,
    slot: CreatedSlot,
    publications: Sequence[str],
    registry: TypeRegistry,
    staging: Path,
    workers: int,
) -> tuple[PublishedSchema, int]:
    async with await _snapshot_connection(upstream_url, slot.snapshot_name) as conn:
        await check_published_tables(conn, publications)
        schema = await published_schema(conn, publications)
        estimates = await _estimates(conn, schema["tables"])
    lite = _LiteThread(staging)
    try:
        # Tables and metadata are committed first: the copy threads write the rows
        # through connections of their own.
        await lite.run(_create_tables, schema, slot.replica_version, publications)
        # A job per table; a copy thread restarts its clock when the table's turn comes.
        progress = [
            Job(
                f"initial sync of {lite_table_name(t['schema'], t['name'])}",
                total=estimates.get(t["oid"]) or None,
                waiting=True,
            )
            for t in schema["tables"]
        ]
        pending = list(zip(schema["tables"], progress, strict=True))
        n_workers = max(1, min(workers, len(pending)))
        stop = threading.Event()
        view = ProgressView(progress)
        view.start()
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(n_workers, thread_name_prefix="initial-sync-copy") as pool:
            copiers = [
                loop.run_in_executor(
                    pool,
                    _copy_tables,
                    upstream_url,
                    slot.snapshot_name,
                    pending,
                    registry,
                    staging,
                    stop,
                )
                for _ in range(n_workers)
            ]
            try:
                await asyncio.gather(*copiers)
            finally:
                stop.set()  # the others stop at their next batch
                await asyncio.gather(*copiers, return_exceptions=True)
                await view.stop()
        await lite.run(_create_indexes, schema)
        await lite.run(_commit)
        return schema, int(sum(p.done for p in progress))
    finally:
        await lite.close()


async def _snapshot_connection(url: str, snapshot: str) -> psycopg.AsyncConnection[Any]:
    conn = await async_connect(url)
    try:
        await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        await conn.execute(pgsql.SQL("SET TRANSACTION SNAPSHOT {}").format(pgsql.Literal(snapshot)))
    except BaseException:
        await conn.close()
        raise
    return conn


async def _estimates(conn: psycopg.AsyncConnection[Any], tables: list[TableSpec]) -> dict[int, int]:
    oids = [t["oid"] for t in tables]
    if not oids:
        return {}
    cur = await conn.execute(
        "SELECT oid::int8, greatest(reltuples, 0)::int8 FROM pg_class WHERE oid = ANY(%s)",
        (oids,),
    )
    return {int(oid): int(n) for oid, n in await cur.fetchall()}


def _copy_tables(
    url: str,
    snapshot: str,
    pending: list[tuple[TableSpec, Job]],
    registry: TypeRegistry,
    staging: Path,
    stop: threading.Event,
) -> None:
    """A copy thread: takes tables from ``pending`` until none is left.

    Blocking on purpose. Nothing else runs during an initial sync, so a thread that
    reads COPY rows from libpq, converts them and inserts them with its own SQLite
    connection does the whole job with no hand-offs (in C, without the GIL, where
    the helper is built: app/sources/postgres/copy_load.py); the event loop only
    waits (and logs progress).
    """
    with connect(url, autocommit=True) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        conn.execute(pgsql.SQL("SET TRANSACTION SNAPSHOT {}").format(pgsql.Literal(snapshot)))
        try:
            while not stop.is_set():
                try:
                    table, progress = pending.pop(0)
                except IndexError:
                    return
                _copy_table(conn, staging, table, progress, registry, stop)
        except BaseException:
            # A failure can leave the COPY half read: close now, so that leaving the
            # block does not send a ROLLBACK into it and raise that instead.
            conn.close()
            raise


def _copy_table(
    conn: psycopg.Connection[Any],
    staging: Path,
    table: TableSpec,
    progress: Job,
    registry: TypeRegistry,
    stop: threading.Event,
) -> None:
    name = lite_table_name(table["schema"], table["name"])
    progress.begin()
    columns = sorted(table["columns"].items(), key=lambda kv: kv[1]["pos"])
    names = [c for c, _ in columns]
    if not names:
        progress.finish()  # SQLite has no zero-column tables; nothing to copy
        return
    lite_columns = lite_table_columns(name, table["columns"])
    # Only the columns whose text is not already the stored value need a call per row.
    converters = [
        _converter(registry, spec["typeOID"], lite_columns[col].data_type) for col, spec in columns
    ]
    query = pgsql.SQL("COPY (SELECT {} FROM {}.{}) TO STDOUT").format(
        pgsql.SQL(", ").join(pgsql.Identifier(c) for c in names),
        pgsql.Identifier(table["schema"]),
        pgsql.Identifier(table["name"]),
    )
    insert = (
        f"INSERT INTO {quote_id(name)} ({', '.join(quote_id(c) for c in names)}) "
        f"VALUES ({', '.join('?' for _ in names)})"
    )

    def on_batch(rows: int, size: int) -> None:
        progress.done += rows  # plain int adds: the view reads them from the loop
        progress.bytes += size
        if stop.is_set():
            raise InitialSyncError("stopped: another table's copy failed")

    loader = open_loader(staging, insert, converters, int(LITE_BUSY_TIMEOUT_S * 1000))
    try:
        copy_table(conn, query.as_bytes(conn), loader, on_batch)
    finally:
        loader.close()
    progress.finish()


# Parsers whose JSON value is also the SQLite value (numbers, ms timestamps, and the
# strings "NaN"/"infinity" some of them give): no lite conversion needed.
_STORED_AS_PARSED: Final = frozenset(
    {INT2, INT4, INT8, OID, FLOAT4, FLOAT8, NUMERIC, TIMESTAMP, TIMESTAMPTZ, TIME, TIMETZ, DATE}
)


_INTEGERS: Final = frozenset({INT2, INT4, INT8, OID})


def _converter(
    registry: TypeRegistry, type_oid: int, lite_type: str
) -> Callable[[str], Any] | None:
    """Text → SQLite value for one column; None when the text is stored as it is."""
    parse = registry.parser(type_oid, json_as_string=True)
    if parse is str:
        return None  # text-like, and json/jsonb kept as their text
    if "INT" in lite_type.upper() and any(
        parse is registry.parser(oid, json_as_string=True) for oid in _INTEGERS
    ):
        # SQLite's INTEGER affinity turns the decimal text into the same 64-bit integer
        # (exactly, extremes included), so the text goes as it is.
        return None
    if any(parse is registry.parser(oid, json_as_string=True) for oid in _STORED_AS_PARSED):
        return parse

    def convert(text: str) -> Any:
        return lite_value(parse(text), lite_type, JSON_STRINGIFIED)

    return convert


# -- the SQLite side, all on one thread ------------------------------------------


class _LiteThread:
    """One thread owns the replica's connection; every call runs there, in order."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="initial-sync-sqlite")
        self._conn: sqlite3.Connection | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._call, fn, args)

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        if self._conn is None:
            self._conn = open_replica(self._path, create=True)
            self._conn.execute("BEGIN IMMEDIATE")
        return fn(self._conn, *args)

    async def close(self) -> None:
        def close() -> None:
            if self._conn is not None:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                self._conn.close()
                self._conn = None

        await asyncio.get_running_loop().run_in_executor(self._pool, close)
        self._pool.shutdown(wait=True)


def _create_tables(
    conn: sqlite3.Connection,
    schema: PublishedSchema,
    replica_version: str,
    publications: Sequence[str],
) -> None:
    init_replica(conn, replica_version, publications, _server_context())
    for t in schema["tables"]:
        name = lite_table_name(t["schema"], t["name"])
        columns = lite_table_columns(name, t["columns"], default_version=replica_version)
        conn.execute(create_table_statement(name, columns))
        for column, spec in t["columns"].items():
            metadata.insert_column(conn, name, column, spec, None)
    conn.execute("COMMIT")


def _create_indexes(conn: sqlite3.Connection, schema: PublishedSchema) -> None:
    conn.execute("BEGIN IMMEDIATE")
    for index in schema["indexes"]:
        conn.execute(
            create_index_statement(
                lite_table_name(index["schema"], index["name"]),
                lite_table_name(index["schema"], index["tableName"]),
                index["columns"],
                unique=index["unique"],
            )
        )


def _commit(conn: sqlite3.Connection) -> None:
    conn.execute("COMMIT")
    # The planner uses the statistics; zero analyzes a freshly synced replica too.
    conn.execute("ANALYZE")


def _server_context() -> dict[str, Any]:
    return {"app": "changestreamer", "hostname": socket.gethostname(), "pid": os.getpid()}
