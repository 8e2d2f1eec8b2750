"""Reading one backfill from Postgres (spec/source.md §1.8).

A backfill request names a table and the columns to fill (with the table's
metadata and each column's ``attNum`` as the schema change gave them). Reading it:

1. A **temporary** replication slot is created only for its exported snapshot: it
   is the one way to read a table as of a known LSN. That LSN (the slot's
   consistent point) is the backfill's ``watermark``. The slot goes away with the
   replication connection, which is closed once the snapshot is imported.
2. Inside the snapshot the published schema is read again and checked against the
   request: same table (OID, schema OID), same row key, same columns (attnums). A
   mismatch means a schema change is on its way down the stream; the request is
   retried once that change has updated it (:class:`BackfillSchemaError`).
3. ``COPY (SELECT key…, columns… FROM t [WHERE row filters]) TO STDOUT`` in text
   format, parsed with the stream's own value parsers (JSON as text, ``json: "s"``),
   cut into ``backfill`` batches of about :data:`BATCH_BYTES` of COPY data, then one
   ``backfill-completed``. Each message's ``status`` says how far it got.

The reader is blocking and runs in a worker thread a batch at a time
(:func:`stream_backfill`), so parsing a million rows never holds the event loop;
the thread's batches wait for the loop to take them (nothing reads ahead).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from psycopg import sql as pgsql

from app.protocol import canonical_json
from app.protocol.lexi import lsn_to_watermark
from app.sources.base import BackfillRequest, ChangeSourceError
from app.sources.postgres.conninfo import connect
from app.sources.postgres.copy_out import CopyOutError, copy_out_rows
from app.sources.postgres.copy_text import parse_copy_line
from app.sources.postgres.published import (
    TableSpec,
    published_schema_query,
    with_replica_identity_columns,
)
from app.sources.postgres.values import TypeRegistry

__all__ = ["BATCH_BYTES", "BackfillNames", "BackfillSchemaError", "stream_backfill"]

log = logging.getLogger(__name__)

# COPY bytes per backfill message: large enough that per-message costs (a change-log
# row, a frame, a replica transaction's share) vanish, small enough that one message
# is a few ms of work anywhere. The reference cuts at 64 KiB.
BATCH_BYTES: Final = 256 * 1024
CONNECT_TIMEOUT_S: Final = 30
# Creating a slot waits for transactions running upstream to end; past this the
# attempt fails and is retried with backoff.
SNAPSHOT_TIMEOUT_S: Final = 60


class BackfillSchemaError(ChangeSourceError):
    """The table no longer matches the request (renamed, dropped, key or column changed)."""


@dataclass(frozen=True, slots=True)
class BackfillNames:
    """The shard's names a backfill uses upstream."""

    slot_prefix: str  # temporary slots are this plus "bf_<ms>"
    position_prefix: str  # the logical message that marks the snapshot's LSN


@dataclass(frozen=True, slots=True)
class _Plan:
    query: bytes
    count: bytes
    relation: dict[str, Any]
    columns: list[str]
    parsers: list[Callable[[str], Any]]
    relation_oid: int


class BackfillReader:
    """One backfill, read blocking in a worker thread (see the module docstring)."""

    def __init__(
        self,
        url: str,
        names: BackfillNames,
        publications: Sequence[str],
        request: BackfillRequest,
        registry: TypeRegistry,
        *,
        batch_bytes: int = BATCH_BYTES,
    ) -> None:
        self._url = url
        self._slot_prefix = names.slot_prefix
        self._position_prefix = names.position_prefix
        self._publications = list(publications)
        self._request = request
        self._registry = registry
        self._batch_bytes = batch_bytes
        self._conn: psycopg.Connection[Any] | None = None
        self._rows: Iterator[bytes] | None = None
        self._plan: _Plan | None = None
        self._status: dict[str, Any] = {"rows": 0, "totalRows": 0}
        self._watermark = ""
        self._done = False
        # next_batch and close may be called from different threads (a cancelled
        # backfill closes while its batch is being read): one at a time.
        self._lock = threading.Lock()

    @property
    def watermark(self) -> str:
        return self._watermark

    def open(self) -> None:
        with self._lock:
            conn = connect(self._url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
            self._conn = conn
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            self._watermark = _import_snapshot_of_new_slot(
                self._url, conn, self._slot_prefix, self._position_prefix
            )
            self._plan = self._validated_plan(conn)
            total_rows, total_bytes = _totals(conn, self._plan)
            self._status = {"rows": 0, "totalRows": total_rows, "totalBytes": total_bytes}
            self._rows = copy_out_rows(conn, self._plan.query)
            table = self._request["table"]
            log.info(
                "backfilling %s.%s %s at %s: %d rows",
                table["schema"],
                table["name"],
                self._plan.columns,
                self._watermark,
                total_rows,
            )

    def next_batch(self) -> dict[str, Any] | None:
        """The next ``backfill`` message body, then ``backfill-completed``, then None."""
        with self._lock:
            if self._done:
                return None
            plan, rows = self._plan, self._rows
            assert plan is not None, "open() first"
            assert rows is not None, "open() first"
            parsers = plan.parsers
            n = len(parsers)
            values: list[list[Any]] = []
            size = 0
            try:
                for line in rows:
                    size += len(line)
                    fields = parse_copy_line(line, n)
                    values.append(
                        [None if f is None else p(f) for p, f in zip(parsers, fields, strict=True)]
                    )
                    if size >= self._batch_bytes:
                        break
            except CopyOutError as e:
                raise _schema_error_or(e, self._request) from e
            self._status["rows"] += len(values)
            if values:
                return self._body("backfill", rowValues=values)
            self._done = True
            return self._body("backfill-completed")

    def close(self) -> None:
        conn = self._conn
        if conn is not None and not conn.closed:
            # A batch being read in another thread ends at once (the COPY fails).
            conn.cancel_safe(timeout=5.0)
        with self._lock:
            self._rows = None
            if conn is not None:
                conn.close()

    def _body(self, tag: str, **extra: Any) -> dict[str, Any]:
        plan = self._plan
        assert plan is not None
        body: dict[str, Any] = {
            "tag": tag,
            "relation": plan.relation,
            "columns": plan.columns,
            "watermark": self._watermark,
        }
        body.update(extra)
        body["status"] = dict(self._status)
        return body

    def _validated_plan(self, conn: psycopg.Connection[Any]) -> _Plan:
        request = self._request
        table_id = request["table"]
        cur = conn.execute(
            f'SELECT "publishedSchema"::text FROM ({published_schema_query(self._publications)})'
            " AS q".encode()
        )
        row = cur.fetchone()
        if row is None or row[0] is None:
            raise ChangeSourceError("published schema query returned no row")
        schema = with_replica_identity_columns(canonical_json.loads(row[0]))
        spec = next(
            (
                t
                for t in schema["tables"]
                if t["schema"] == table_id["schema"] and t["name"] == table_id["name"]
            ),
            None,
        )
        if spec is None:
            raise BackfillSchemaError(f"{_describe(request)}: table has been renamed or dropped")
        return _plan(spec, request, self._registry)


def _plan(spec: TableSpec, request: BackfillRequest, registry: TypeRegistry) -> _Plan:
    """The COPY for ``request`` after checking it against the table as published now."""
    what = _describe(request)
    metadata = request["table"].get("metadata")
    if not isinstance(metadata, Mapping) or not isinstance(metadata.get("rowKey"), Mapping):
        raise BackfillSchemaError(f"{what}: the request has no table metadata with a row key")
    if spec.get("schemaOID") != metadata.get("schemaOID"):
        raise BackfillSchemaError(f"{what}: schema no longer corresponds to the original schema")
    if spec["oid"] != metadata.get("relationOID"):
        raise BackfillSchemaError(f"{what}: table no longer corresponds to the original table")
    row_key: Mapping[str, Any] = metadata["rowKey"]
    if set(row_key) != set(spec["replicaIdentityColumns"]):
        raise BackfillSchemaError(f"{what}: row key (e.g. PRIMARY KEY or INDEX) has changed")
    requested: Mapping[str, Any] = request["columns"]
    for name, ident in [*row_key.items(), *requested.items()]:
        column = spec["columns"].get(name)
        if column is None:
            raise BackfillSchemaError(f"{what}: column {name} has been renamed or dropped")
        if not isinstance(ident, Mapping) or ident.get("attNum") != column["pos"]:
            raise BackfillSchemaError(
                f"{what}: column {name} no longer corresponds to the original column"
            )
    key_columns = list(row_key)
    columns = [c for c in requested if c not in row_key]
    selected = [*key_columns, *columns]
    source = pgsql.SQL("SELECT {} FROM {}.{}{}").format(
        pgsql.SQL(", ").join(pgsql.Identifier(c) for c in selected),
        pgsql.Identifier(spec["schema"]),
        pgsql.Identifier(spec["name"]),
        pgsql.SQL(_row_filter(spec)),
    )
    count = pgsql.SQL("SELECT count(*), pg_table_size({}) FROM ({}) AS rows").format(
        pgsql.Literal(spec["oid"]), source
    )
    return _Plan(
        query=pgsql.SQL("COPY ({}) TO STDOUT").format(source).as_string().encode(),
        count=count.as_string().encode(),
        relation={
            "schema": spec["schema"],
            "name": spec["name"],
            "rowKey": {"columns": key_columns},
        },
        columns=columns,
        parsers=[
            registry.parser(spec["columns"][c]["typeOID"], json_as_string=True) for c in selected
        ],
        relation_oid=spec["oid"],
    )


def _row_filter(spec: TableSpec) -> str:
    """Rows only some publications' filters let through: a row published by any of
    them belongs, and one published without a filter lets every row through."""
    filters = [p.get("rowFilter") for p in spec["publications"].values()]
    if not filters or any(not f for f in filters):
        return ""
    return " WHERE " + " OR ".join(f"({f})" for f in filters)


def _totals(conn: psycopg.Connection[Any], plan: _Plan) -> tuple[int, int]:
    row = conn.execute(plan.count).fetchone()
    assert row is not None
    return int(row[0]), int(row[1] or 0)


def _import_snapshot_of_new_slot(
    url: str, conn: psycopg.Connection[Any], prefix: str, position_prefix: str
) -> str:
    """Imports into ``conn``'s open transaction the snapshot of a temporary slot made
    for the purpose; returns the watermark of the slot's consistent point.

    Then emits an empty non-transactional logical message (``position_prefix``): the
    replication stream passes the snapshot's LSN when it reaches it, which tells the
    stream it may complete the backfill even when nothing else is written upstream."""
    name = f"{prefix}bf_{time.time_ns() // 1_000_000}"
    with connect(
        url, replication="database", autocommit=True, connect_timeout=CONNECT_TIMEOUT_S
    ) as repl:
        # Replication connections speak the simple protocol only: no parameters. The
        # name is the shard's checked prefix and digits.
        repl.execute(f"SET statement_timeout = {SNAPSHOT_TIMEOUT_S * 1000}".encode())
        cur = repl.execute(
            pgsql.SQL("CREATE_REPLICATION_SLOT {} TEMPORARY LOGICAL pgoutput").format(
                pgsql.Identifier(name)
            )
        )
        row = cur.fetchone()
        assert row is not None
        _slot, consistent_point, snapshot = row[0], row[1], row[2]
        conn.execute(pgsql.SQL("SET TRANSACTION SNAPSHOT {}").format(pgsql.Literal(snapshot)))
        # Only now: any command on ``repl`` ends its exported snapshot.
        repl.execute(
            pgsql.SQL("SELECT pg_logical_emit_message(false, {}, '')").format(
                pgsql.Literal(position_prefix)
            )
        )
    # Leaving the block closed the replication connection: the slot is gone, and the
    # imported snapshot stays valid for ``conn``'s transaction.
    return lsn_to_watermark(str(consistent_point))


# undefined_table, undefined_column
_SCHEMA_SQLSTATES: Final = frozenset({"42P01", "42703"})


def _schema_error_or(e: CopyOutError, request: BackfillRequest) -> Exception:
    # Some ALTER TABLE forms are not MVCC-safe: the snapshot can still miss a column
    # or table that the schema check saw. Such failures are schema changes too.
    if e.sqlstate in _SCHEMA_SQLSTATES:
        return BackfillSchemaError(f"{_describe(request)}: {e}")
    return ChangeSourceError(f"{_describe(request)}: {e}")


def _describe(request: BackfillRequest) -> str:
    table = request.get("table", {})
    columns = ",".join(request.get("columns", {}))
    return f"cannot backfill {table.get('schema')}.{table.get('name')}[{columns}]"


async def stream_backfill(
    url: str,
    names: BackfillNames,
    publications: Sequence[str],
    request: BackfillRequest,
    registry: TypeRegistry,
    *,
    batch_bytes: int = BATCH_BYTES,
) -> AsyncGenerator[dict[str, Any], None]:
    """The request's ``backfill`` message bodies, then its ``backfill-completed``.

    Each batch is read in a worker thread when asked for; closing the iterator
    (a cancelled backfill) ends the COPY and the connection."""
    reader = BackfillReader(url, names, publications, request, registry, batch_bytes=batch_bytes)
    try:
        await asyncio.to_thread(reader.open)
        while (body := await asyncio.to_thread(reader.next_batch)) is not None:
            yield body
    finally:
        await asyncio.shield(asyncio.to_thread(reader.close))
