"""Applies upstream transactions to a replica file, one SQLite transaction each.

:class:`ReplicaWriter` follows zero's change processor (``change-processor.ts``):

* ``begin`` opens ``BEGIN IMMEDIATE``. The commit watermark is known at begin, so each
  row written gets ``_0_version`` = that watermark as it is written (zero does the
  same), and ``commit`` only has to move ``"_zero.replicationState"``.
* inserts are upserts (``INSERT OR REPLACE``); updates are ``UPDATE … WHERE key``
  (partial rows: unchanged TOAST columns are simply absent) by the old key if the key
  changed, else the new one, and fall back to an upsert when no row matched (a table
  added to the publication later has rows the replica never saw);
* row operations go to ``"_zero.changeLog2"`` (always in ``serving`` mode, in
  ``backup`` mode only while columns are being backfilled); schema changes log a
  table reset and, where every row's content changes (add/update/drop column, rename,
  backfill completed), set the table's ``minRowVersion`` instead of touching rows;
* ``commit`` checks the watermark against begin's, stores it as ``stateVersion``
  with ``writeTimeMs``, runs ``PRAGMA optimize`` after a schema change, and commits
  (``synchronous=FULL``: durable before the caller acks it). A group of commits
  (``commit(flush=False)`` … ``flush``) stores the state version once, at its end.

Per row the writer does as little Python as it can (the follower applies every row
the service stores): row statements are built once per table and column set, and a
commit watermark is checked with one regex (``is_state_version``).

Any error while applying rolls the whole transaction back, leaves the writer outside
a transaction, and raises :class:`~app.replica.errors.ReplicaError`: nothing of a
transaction is ever half-applied. Unlike zero, which stops its processor for good,
the writer accepts a new ``begin`` afterwards (the caller decides whether to go on).

The writer is synchronous and owns its connection; async callers run every call on
one thread (see :mod:`app.replica.replicator`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from app.protocol.lexi import InvalidWatermarkError, is_state_version, parse_state_version
from app.replica import metadata
from app.replica.catalog import TableInfo, declared_columns, list_indexes, load_tables
from app.replica.changelog import DEL_OP, SET_OP, ChangeLog
from app.replica.ddl import (
    ZERO_VERSION_COLUMN,
    LiteColumn,
    column_def,
    create_index_statement,
    create_table_statement,
    lite_column,
    lite_table_columns,
    lite_table_name,
    quote_id,
)
from app.replica.errors import ReplicaError
from app.replica.lite_types import JSON_PARSED, JSON_STRINGIFIED, JsonFormat, LiteValue, lite_row
from app.replica.schema import (
    check_schema_version,
    open_replica,
    read_replica_state,
    set_state_version,
)

__all__ = ["CommitResult", "ReplicaWriter", "WriterMode"]

WriterMode = Literal["serving", "backup"]

# After a commit that bound a text or blob value of at least this many characters
# (bytes), the connection is reopened: sqlite3 keeps a cached statement's last
# bindings — SQLite's own copy of each bound value — until the statement runs
# again, so one 100 MB value stayed resident for as long as its table saw no other
# write of the same shape (decision 42). Reopening costs a few statement
# preparations, once per such commit.
LARGE_VALUE_CHARS = 1 << 20
# Row statements kept by table and column set (ReplicaWriter._statement).
STATEMENT_CACHE = 1024


@dataclass(frozen=True, slots=True)
class CommitResult:
    watermark: str
    schema_updated: bool
    change_log_updated: bool
    completed_backfill: dict[str, Any] | None = None
    upstream_commit_time_ms: float | None = None


@dataclass(slots=True)
class _Transaction:
    version: str
    json_format: JsonFormat
    pos: int = 0
    schema_changed: bool = False
    change_log_entries: int = 0
    completed_backfill: dict[str, Any] | None = None


class ReplicaWriter:
    """Applies transactions to one replica file; see the module docstring."""

    def __init__(
        self, path: str | Path, *, mode: WriterMode = "serving", checkpoints: bool = True
    ) -> None:
        """``checkpoints=False``: litestream backs the file up and does all its
        checkpoints (``schema.open_replica``)."""
        if mode not in ("serving", "backup"):
            raise ValueError(f"mode must be 'serving' or 'backup', got {mode!r}")
        self._mode = mode
        self._path = path
        self._checkpoints = checkpoints
        self._conn = open_replica(path, checkpoints=checkpoints)
        self._large_bound = False  # see LARGE_VALUE_CHARS
        try:
            check_schema_version(self._conn)
            state = read_replica_state(self._conn)
        except BaseException:
            self._conn.close()
            raise
        self._replica_version = state.replica_version
        self._state_version = state.state_version
        # Grouped commits (see commit(flush=False)): the last state version that
        # reached the file, and whether an outer SQLite transaction holds more.
        self._durable_version = state.state_version
        self._grouping = False
        self._change_log = ChangeLog(self._conn)
        self._tables: dict[str, TableInfo] | None = None
        self._statements: dict[tuple[str | tuple[str, ...], ...], str] = {}
        self._tx: _Transaction | None = None
        self._handlers: dict[str, Callable[[_Transaction, Mapping[str, Any]], None]] = {
            "insert": self._insert,
            "update": self._update,
            "delete": self._delete,
            "truncate": self._truncate,
            "create-table": self._create_table,
            "rename-table": self._rename_table,
            "update-table-metadata": self._update_table_metadata,
            "add-column": self._add_column,
            "update-column": self._update_column,
            "drop-column": self._drop_column,
            "drop-table": self._drop_table,
            "create-index": self._create_index,
            "drop-index": self._drop_index,
            "backfill": self._backfill,
            "backfill-completed": self._backfill_completed,
        }

    @property
    def replica_version(self) -> str:
        return self._replica_version

    @property
    def state_version(self) -> str:
        """The watermark of the last committed transaction (the replica version at first)."""
        return self._state_version

    @property
    def in_transaction(self) -> bool:
        return self._tx is not None

    # -- transaction boundaries ---------------------------------------------------

    def begin(self, commit_watermark: str, begin_body: Mapping[str, Any] | None = None) -> None:
        if self._tx is not None:
            raise ReplicaError(
                f"begin {commit_watermark} while transaction {self._tx.version} is open"
            )
        if not is_state_version(commit_watermark):
            try:
                parse_state_version(commit_watermark)  # for its precise message
            except InvalidWatermarkError as e:
                raise ReplicaError(f"invalid commit watermark: {e}") from e
        if commit_watermark <= self._state_version:
            raise ReplicaError(
                f"transaction {commit_watermark} is not after the replica's "
                f"state version {self._state_version}"
            )
        json_format = (begin_body or {}).get("json", JSON_PARSED)
        if json_format not in (JSON_PARSED, JSON_STRINGIFIED):
            raise ReplicaError(f'begin "json" must be "p" or "s", got {json_format!r}')
        try:
            if self._grouping:
                # Inside a group: this transaction is a savepoint, so a failure rolls
                # back only it and the group's earlier transactions stay.
                self._conn.execute("SAVEPOINT upstream_tx")
            else:
                self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise ReplicaError(f"cannot begin a replica transaction: {e}") from e
        self._tx = _Transaction(commit_watermark, json_format)

    def apply(self, change: Mapping[str, Any]) -> None:
        """Applies one data or schema change of the open transaction."""
        tx = self._tx
        if tx is None:
            raise ReplicaError(f"change outside a transaction: {_describe(change)}")
        try:
            tag = change.get("tag") if isinstance(change, Mapping) else None
            handler = self._handlers.get(tag) if isinstance(tag, str) else None
            if handler is None:
                raise ReplicaError(f"unknown change: {_describe(change)}")
            handler(tx, change)
        except BaseException as e:
            self._rollback()
            if isinstance(e, ReplicaError):
                raise
            if isinstance(e, (sqlite3.Error, KeyError, TypeError, ValueError, AttributeError)):
                raise ReplicaError(
                    f"cannot apply {_describe(change)} at {tx.version}: {type(e).__name__}: {e}"
                ) from e
            raise

    def commit(
        self,
        watermark: str,
        commit_body: Mapping[str, Any] | None = None,
        *,
        flush: bool = True,
    ) -> CommitResult:
        """Ends the transaction; with ``flush=False`` it joins a group written by :meth:`flush`.

        A caller with several transactions at hand (a replicator that is behind)
        groups them: each is complete and in order, and one SQLite commit writes them
        all, which saves rewriting the same pages once per upstream transaction.
        Until the flush, ``state_version`` is ahead of the file's ``durable_version``.
        """
        tx = self._tx
        if tx is None:
            raise ReplicaError(f"commit {watermark} outside a transaction")
        if watermark != tx.version:
            self._rollback()
            raise ReplicaError(
                f"'commit' version {watermark} does not match 'begin' version {tx.version}"
            )
        try:
            if tx.schema_changed:
                self._conn.execute("PRAGMA optimize")
            if self._grouping:
                self._conn.execute("RELEASE upstream_tx")
            if flush:
                # A group's state version is written once, by its last commit (or
                # flush): the row would be rewritten per transaction otherwise.
                set_state_version(self._conn, watermark)
                self._conn.execute("COMMIT")
                self._release_large_bindings()
        except BaseException as e:
            self._rollback()
            if isinstance(e, sqlite3.Error):
                raise ReplicaError(f"cannot commit {watermark}: {e}") from e
            raise
        self._tx = None
        self._state_version = watermark
        self._grouping = not flush
        if flush:
            self._durable_version = watermark
        commit_time = (commit_body or {}).get("commitTimeMs")
        return CommitResult(
            watermark=watermark,
            schema_updated=tx.schema_changed,
            change_log_updated=tx.change_log_entries > 0,
            completed_backfill=tx.completed_backfill,
            upstream_commit_time_ms=commit_time
            if isinstance(commit_time, int | float) and not isinstance(commit_time, bool)
            else None,
        )

    @property
    def durable_version(self) -> str:
        """The state version the file holds (behind ``state_version`` inside a group)."""
        return self._durable_version

    def flush(self) -> None:
        """Writes the group of transactions committed with ``flush=False``."""
        if self._tx is not None:
            raise ReplicaError(f"flush while transaction {self._tx.version} is open")
        if not self._grouping:
            return
        try:
            set_state_version(self._conn, self._state_version)
            self._conn.execute("COMMIT")
            self._release_large_bindings()
        except sqlite3.Error as e:
            self._discard_group()
            raise ReplicaError(f"cannot commit up to {self._state_version}: {e}") from e
        self._grouping = False
        self._durable_version = self._state_version

    def abort(self) -> None:
        """Discards the open transaction, if any (a group's earlier ones stay)."""
        if self._tx is not None:
            self._rollback()

    def _release_large_bindings(self) -> None:
        """Reopens the connection (outside any transaction) if a large value was bound."""
        if not self._large_bound:
            return
        self._large_bound = False
        self._conn.close()
        self._conn = open_replica(self._path, checkpoints=self._checkpoints)
        self._change_log = ChangeLog(self._conn)

    def close(self) -> None:
        self.abort()
        if self._grouping:
            self.flush()
        self._conn.close()

    def _rollback(self) -> None:
        self._tx = None
        self._tables = None  # schema changes of the transaction are gone too
        if self._grouping:
            try:
                self._conn.execute("ROLLBACK TO upstream_tx")
                self._conn.execute("RELEASE upstream_tx")
                return
            except sqlite3.Error:
                self._discard_group()
                return
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    def _discard_group(self) -> None:
        """The group could not be written: back to what the file holds."""
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")
        self._grouping = False
        self._tables = None
        self._state_version = self._durable_version

    # -- table lookups --------------------------------------------------------------

    def _table(self, name: str) -> TableInfo:
        if self._tables is None:
            self._tables = load_tables(self._conn)
        info = self._tables.get(name)
        if info is None:
            raise ReplicaError(f"unknown table {name!r}")
        return info

    def _key(
        self,
        row: Mapping[str, LiteValue],
        relation: Mapping[str, Any],
        info: TableInfo,
        row_key: tuple[list[str], str | None] | None = None,
    ) -> dict[str, LiteValue]:
        columns, kind = row_key or _row_key(relation)
        key_columns = columns if kind != "full" else info.primary_key
        if not key_columns:
            raise ReplicaError(
                f'Cannot replicate table "{relation["name"]}" without a PRIMARY KEY or UNIQUE INDEX'
            )
        try:
            return {col: row[col] for col in key_columns}
        except KeyError as e:
            raise ReplicaError(f"row of {info.name!r} lacks key column {e.args[0]!r}") from None

    # -- change log -----------------------------------------------------------------

    def _log_set(
        self, tx: _Transaction, table: str, key: Mapping[str, Any], backfilled: list[str] | None
    ) -> None:
        if self._mode == "serving" or backfilled is not None:
            self._change_log.log_set(tx.version, tx.pos, table, key, backfilled)
            tx.pos += 1
            tx.change_log_entries += 1

    def _log_delete(
        self, tx: _Transaction, table: str, key: Mapping[str, Any], info: TableInfo
    ) -> None:
        if self._mode == "serving" or info.backfilling:
            self._change_log.log_delete(tx.version, tx.pos, table, key)
            tx.pos += 1
            tx.change_log_entries += 1

    def _log_reset(self, tx: _Transaction, table: str) -> None:
        tx.schema_changed = True
        if self._mode == "serving":
            self._change_log.log_reset(tx.version, table)
            tx.change_log_entries += 1
        self._tables = None

    def _bump_versions(self, tx: _Transaction, schema: str, name: str) -> None:
        metadata.set_min_row_version(self._conn, schema, name, tx.version)
        self._log_reset(tx, lite_table_name(schema, name))

    # -- data changes -----------------------------------------------------------------

    def _statement(self, kind: str, table: str, *column_lists: tuple[str, ...]) -> str:
        """The SQL of a row operation, built once per table and column set.

        The text depends only on names, so a schema change needs no invalidation
        (sqlite3 re-prepares a statement whose table changed). Bounded: the cache
        starts over past ``STATEMENT_CACHE``, which only a stream of ever new column
        sets (partial updates of a wide table) reaches.
        """
        cache_key: tuple[str | tuple[str, ...], ...] = (kind, table, *column_lists)
        sql = self._statements.get(cache_key)
        if sql is None:
            if len(self._statements) >= STATEMENT_CACHE:
                self._statements.clear()
            sql = _row_sql(kind, table, *column_lists)
            self._statements[cache_key] = sql
        return sql

    def _upsert(self, table: str, row: Mapping[str, LiteValue], version: str) -> None:
        """Writes ``row`` with ``_0_version`` = ``version``, replacing any row of its key."""
        params = (*row.values(), version)
        self._conn.execute(self._statement("upsert", table, tuple(row)), params)
        if not self._large_bound:
            self._large_bound = _holds_large(params)

    def _insert(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        relation = change["relation"]
        table = _relation_table(relation)
        info = self._table(table)
        row = lite_row(_object(change, "new"), info.columns, tx.json_format, table)
        self._upsert(table, row, tx.version)
        row_key = _row_key(relation)
        if not row_key[0]:
            # Keyless rows are written but cannot take part in view maintenance.
            return
        key = self._key(row, relation, info, row_key)
        self._log_set(tx, table, key, _backfilled(row, info))

    def _update(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        relation = change["relation"]
        table = _relation_table(relation)
        info = self._table(table)
        new = lite_row(_object(change, "new"), info.columns, tx.json_format, table)
        old = change.get("key")
        row_key = _row_key(relation)
        old_key = (
            self._key(lite_row(old, info.columns, tx.json_format, table), relation, info, row_key)
            if old
            else None
        )
        new_key = self._key(new, relation, info, row_key)
        if old_key is not None:
            self._log_delete(tx, table, old_key, info)
        self._log_set(tx, table, new_key, _backfilled(new, info))

        where = old_key if old_key is not None else new_key
        params = (*new.values(), tx.version, *where.values())
        sql = self._statement("update", table, tuple(new), tuple(where))
        cursor = self._conn.execute(sql, params)
        if not self._large_bound:
            self._large_bound = _holds_large(params)
        if cursor.rowcount == 0:
            self._upsert(table, new, tx.version)

    def _delete(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        relation = change["relation"]
        table = _relation_table(relation)
        info = self._table(table)
        key = self._key(
            lite_row(_object(change, "key"), info.columns, tx.json_format, table), relation, info
        )
        self._conn.execute(self._statement("delete", table, tuple(key)), tuple(key.values()))
        self._log_delete(tx, table, key, info)

    def _truncate(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        relations = change["relations"]
        if not isinstance(relations, list):
            raise ReplicaError("truncate: 'relations' must be an array")
        for relation in relations:
            table = _relation_table(relation)
            self._table(table)
            self._conn.execute(f"DELETE FROM {quote_id(table)}")
            if self._mode == "serving":
                self._change_log.log_truncate(tx.version, table)
                tx.change_log_entries += 1

    # -- schema changes -----------------------------------------------------------

    def _create_table(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        spec = _object(change, "spec")
        schema, name = _str(spec, "schema"), _str(spec, "name")
        spec_columns = _object(spec, "columns")
        table = lite_table_name(schema, name)
        if change.get("metadata"):
            metadata.set_upstream_metadata(self._conn, schema, name, change["metadata"])
        self._conn.execute(create_table_statement(table, lite_table_columns(table, spec_columns)))
        backfill = change.get("backfill") or {}
        for column, column_spec in spec_columns.items():
            metadata.insert_column(self._conn, table, column, column_spec, backfill.get(column))
        if len(backfill) == len(spec_columns):
            # Fully backfilled tables appear (reset) when their backfill completes.
            self._tables = None
        else:
            self._log_reset(tx, table)

    def _rename_table(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        old_id, new_id = _identifier(change, "old"), _identifier(change, "new")
        old, new = lite_table_name(*old_id), lite_table_name(*new_id)
        self._table(old)
        metadata.rename_table_metadata(self._conn, old_id, new_id)
        self._conn.execute(f"ALTER TABLE {quote_id(old)} RENAME TO {quote_id(new)}")
        metadata.rename_table(self._conn, old, new)
        self._bump_versions(tx, *new_id)
        self._log_reset(tx, old)

    def _update_table_metadata(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        schema, name = _identifier(change, "table")
        metadata.set_upstream_metadata(self._conn, schema, name, _object(change, "new"))

    def _add_column(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        schema, name = _identifier(change, "table")
        table = lite_table_name(schema, name)
        self._table(table)
        if change.get("tableMetadata"):
            metadata.set_upstream_metadata(self._conn, schema, name, change["tableMetadata"])
        column = _object(change, "column")
        column_name, spec = _str(column, "name"), _object(column, "spec")
        lite = lite_column(table, column_name, spec, ignore_default=False)
        self._conn.execute(
            f"ALTER TABLE {quote_id(table)} ADD {quote_id(column_name)} {column_def(lite)}"
        )
        backfill = change.get("backfill")
        metadata.insert_column(self._conn, table, column_name, spec, backfill)
        if backfill:
            self._tables = None  # the column becomes visible when its backfill completes
        else:
            self._bump_versions(tx, schema, name)

    def _update_column(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        schema, name = _identifier(change, "table")
        table = lite_table_name(schema, name)
        self._table(table)
        old, new = _object(change, "old"), _object(change, "new")
        old_name, new_name = _str(old, "name"), _str(new, "name")
        new_spec = _object(new, "spec")
        # Defaults only matter for rows added later; the replica never applies them here.
        old_lite = lite_column(table, old_name, _object(old, "spec"), ignore_default=True)
        new_lite = lite_column(table, new_name, new_spec, ignore_default=True)
        if old_name == new_name and old_lite.data_type == new_lite.data_type:
            metadata.update_column(self._conn, table, old_name, new_name, new_spec)
            return
        current = old_name
        if old_lite.data_type != new_lite.data_type:
            self._rebuild_with_column_type(table, old_name, new_name, new_lite.data_type)
            current = new_name
        if current != new_name:
            self._conn.execute(
                f"ALTER TABLE {quote_id(table)} RENAME {quote_id(current)} TO {quote_id(new_name)}"
            )
        metadata.update_column(self._conn, table, old_name, new_name, new_spec)
        self._bump_versions(tx, schema, name)

    def _rebuild_with_column_type(
        self, table: str, old_name: str, new_name: str, data_type: str
    ) -> None:
        # SQLite cannot change a column's declared type: copy into a new table.
        columns = declared_columns(self._conn, table)
        if old_name not in columns:
            raise ReplicaError(f"unknown column {old_name!r} in table {table!r}")
        indexes = list_indexes(self._conn, table)
        rebuilt = {
            (new_name if col == old_name else col): (
                LiteColumn(pos=spec.pos, data_type=data_type, is_array="[]" in data_type)
                if col == old_name
                else spec
            )
            for col, spec in columns.items()
        }
        tmp = f"tmp.{table}"
        self._conn.execute(create_table_statement(tmp, rebuilt))
        self._conn.execute(
            f"INSERT INTO {quote_id(tmp)} ({','.join(quote_id(c) for c in rebuilt)}) "
            f"SELECT {','.join(quote_id(c) for c in columns)} FROM {quote_id(table)}"
        )
        self._conn.execute(f"DROP TABLE {quote_id(table)}")
        self._conn.execute(f"ALTER TABLE {quote_id(tmp)} RENAME TO {quote_id(table)}")
        for index in indexes:
            renamed = {
                (new_name if col == old_name else col): d for col, d in index.columns.items()
            }
            self._conn.execute(
                create_index_statement(index.name, table, renamed, unique=index.unique)
            )

    def _drop_column(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        schema, name = _identifier(change, "table")
        table = lite_table_name(schema, name)
        column = _str(change, "column")
        self._table(table)
        self._conn.execute(f"ALTER TABLE {quote_id(table)} DROP {quote_id(column)}")
        metadata.delete_column(self._conn, table, column)
        self._bump_versions(tx, schema, name)

    def _drop_table(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        schema, name = _identifier(change, "id")
        table = lite_table_name(schema, name)
        metadata.drop_table_metadata(self._conn, schema, name)
        self._conn.execute(f"DROP TABLE IF EXISTS {quote_id(table)}")
        metadata.delete_table(self._conn, table)
        self._log_reset(tx, table)

    def _create_index(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        spec = _object(change, "spec")
        schema = _str(spec, "schema")
        table = lite_table_name(schema, _str(spec, "tableName"))
        info = self._table(table)
        columns = _object(spec, "columns")
        if any(d not in ("ASC", "DESC") for d in columns.values()):
            raise ReplicaError(f"index directions must be ASC or DESC: {columns!r}")
        unique = spec.get("unique")
        if not isinstance(unique, bool):
            raise ReplicaError("create-index: 'unique' must be a boolean")
        index = lite_table_name(schema, _str(spec, "name"))
        self._conn.execute(create_index_statement(index, table, columns, unique=unique))
        if len(info.backfilling) == len(info.columns) - 1:  # all but _0_version
            # A table still being backfilled is not visible yet: nothing to reset.
            self._tables = None
        else:
            self._log_reset(tx, table)

    def _drop_index(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        index = lite_table_name(*_identifier(change, "id"))
        self._conn.execute(f"DROP INDEX IF EXISTS {quote_id(index)}")

    # -- backfill -----------------------------------------------------------------

    def _backfill(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        relation = change["relation"]
        table = _relation_table(relation)
        info = self._table(table)
        watermark = _str(change, "watermark")
        key_columns = _row_key(relation)[0]
        if not key_columns:
            raise ReplicaError(f"backfill of {table!r} without row key columns")
        columns = [*key_columns, *_str_list(change, "columns")]
        insert_cols = ",".join(quote_id(c) for c in [*columns, ZERO_VERSION_COLUMN])
        marks = ",".join("?" * (len(columns) + 1))
        conflict = ",".join(quote_id(c) for c in key_columns)
        rows = change["rowValues"]
        if not isinstance(rows, list):
            raise ReplicaError("backfill: 'rowValues' must be an array")
        for values in rows:
            if not isinstance(values, list) or len(values) != len(columns):
                raise ReplicaError(f"backfill row must have {len(columns)} values: {values!r}")
            row = lite_row(
                dict(zip(columns, values, strict=True)), info.columns, tx.json_format, table
            )
            key = self._key(row, relation, info)
            op = self._change_log.latest_row_op(table, key)
            if op is not None and op.op == DEL_OP and op.state_version > watermark:
                continue  # deleted after the backfill's snapshot
            updates = (
                [c for c in columns if op.backfilling_column_versions.get(c, "") <= watermark]
                if op is not None and op.op == SET_OP
                else columns
            )
            if not updates:
                continue  # replication already wrote newer values for every column
            sets = ",".join(f"{quote_id(c)}=excluded.{quote_id(c)}" for c in updates)
            self._conn.execute(
                f"INSERT INTO {quote_id(table)} ({insert_cols}) VALUES ({marks}) "
                f"ON CONFLICT ({conflict}) DO UPDATE SET {sets}",
                (*row.values(), watermark),
            )

    def _backfill_completed(self, tx: _Transaction, change: Mapping[str, Any]) -> None:
        relation = change["relation"]
        schema, name = _str(relation, "schema"), _str(relation, "name")
        table = lite_table_name(schema, name)
        columns = [*_row_key(relation)[0], *_str_list(change, "columns")]
        for column in columns:
            metadata.clear_backfilling(self._conn, table, column)
        self._bump_versions(tx, schema, name)
        status = change.get("status")
        if isinstance(status, Mapping):
            tx.completed_backfill = {"table": table, "columns": columns, **status}


# -- message fields ----------------------------------------------------------------------


def _describe(change: Any) -> str:
    if isinstance(change, Mapping):
        return repr(change.get("tag", "<no tag>"))
    return f"<{type(change).__name__}>"


def _object(obj: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = obj.get(key)
    if not isinstance(value, Mapping):
        raise ReplicaError(f"{key!r} must be an object, got {value!r}")
    return value


def _str(obj: Mapping[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise ReplicaError(f"{key!r} must be a string, got {value!r}")
    return value


def _str_list(obj: Mapping[str, Any], key: str) -> list[str]:
    value = obj.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ReplicaError(f"{key!r} must be an array of strings, got {value!r}")
    return value


def _identifier(obj: Mapping[str, Any], key: str) -> tuple[str, str]:
    ident = _object(obj, key)
    return _str(ident, "schema"), _str(ident, "name")


def _relation_table(relation: Any) -> str:
    if not isinstance(relation, Mapping):
        raise ReplicaError(f"relation must be an object, got {relation!r}")
    return lite_table_name(_str(relation, "schema"), _str(relation, "name"))


def _row_key(relation: Mapping[str, Any]) -> tuple[list[str], str | None]:
    """The relation's key columns and identity type (``rowKey``, or the pre-v5 fields)."""
    row_key = relation.get("rowKey")
    if isinstance(row_key, Mapping):
        columns, kind = row_key.get("columns"), row_key.get("type")
    else:
        columns, kind = relation.get("keyColumns"), relation.get("replicaIdentity")
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise ReplicaError(f"relation has no valid rowKey.columns: {relation!r}")
    return columns, kind if isinstance(kind, str) else None


def _backfilled(row: Mapping[str, Any], info: TableInfo) -> list[str] | None:
    """The backfilling columns this row sets; None when nothing is being backfilled."""
    if not info.backfilling:
        return None
    return [c for c in info.backfilling if c in row]


def _holds_large(params: tuple[LiteValue, ...]) -> bool:
    # A plain loop, a third of any()'s time over a generator: this runs per row written.
    for v in params:  # noqa: SIM110
        if (type(v) is str or type(v) is bytes) and len(v) >= LARGE_VALUE_CHARS:
            return True
    return False


def _row_sql(kind: str, table: str, *column_lists: tuple[str, ...]) -> str:
    """``upsert`` (columns; ``_0_version`` is bound last), ``update`` (the SET columns
    then the WHERE key columns; ``_0_version`` after the SET ones), ``delete`` (key)."""
    quoted = quote_id(table)
    if kind == "upsert":
        (columns,) = column_lists
        names = ",".join(quote_id(c) for c in (*columns, ZERO_VERSION_COLUMN))
        marks = ",".join("?" * (len(columns) + 1))
        return f"INSERT OR REPLACE INTO {quoted} ({names}) VALUES ({marks})"
    if kind == "update":
        columns, where = column_lists
        sets = ",".join(f"{quote_id(c)}=?" for c in (*columns, ZERO_VERSION_COLUMN))
        conds = " AND ".join(f"{quote_id(c)}=?" for c in where)
        return f"UPDATE {quoted} SET {sets} WHERE {conds}"
    if kind == "delete":
        (where,) = column_lists
        return f"DELETE FROM {quoted} WHERE " + " AND ".join(f"{quote_id(c)}=?" for c in where)
    raise ValueError(f"unknown row statement {kind!r}")
