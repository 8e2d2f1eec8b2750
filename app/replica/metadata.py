"""Writes to the replica's per-column and per-table metadata, as zero keeps them.

``"_zero.column_metadata"``: one row per replicated column with the upstream type
unencoded (type name, NOT NULL, enum, array, character maximum length) and, while the
column is being backfilled, its BackfillID as JSON. Readers prefer it to the declared
type (:mod:`app.replica.catalog`).

``"_zero.tableMetadata"``: per upstream table (schema, name), the upstream
TableMetadata as JSON (``upstreamMetadata``; the old ``metadata`` column stays NULL)
and ``minRowVersion``, the version every row of the table counts as at least. A
schema change that alters every row (a new or changed column) bumps it to the
transaction's version instead of rewriting each row's ``_0_version``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any

from app.protocol.canonical_json import dumps
from app.replica.lite_types import is_array_column, is_enum_column

__all__ = [
    "clear_backfilling",
    "delete_column",
    "delete_table",
    "drop_table_metadata",
    "insert_column",
    "rename_table",
    "rename_table_metadata",
    "set_min_row_version",
    "set_upstream_metadata",
    "update_column",
]


def _spec_fields(spec: Mapping[str, Any]) -> tuple[str, int, int, int, Any]:
    return (
        spec["dataType"],
        1 if spec.get("notNull") else 0,
        1 if is_enum_column(spec) else 0,
        1 if is_array_column(spec) else 0,
        spec.get("characterMaximumLength"),
    )


def insert_column(
    conn: sqlite3.Connection,
    table: str,
    column: str,
    spec: Mapping[str, Any],
    backfill: Any = None,
) -> None:
    conn.execute(
        'INSERT INTO "_zero.column_metadata" (table_name, column_name, upstream_type, '
        "is_not_null, is_enum, is_array, character_max_length, backfill) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (table, column, *_spec_fields(spec), dumps(backfill) if backfill else None),
    )


def update_column(
    conn: sqlite3.Connection, table: str, old_name: str, new_name: str, spec: Mapping[str, Any]
) -> None:
    conn.execute(
        'UPDATE "_zero.column_metadata" SET column_name = ?, upstream_type = ?, '
        "is_not_null = ?, is_enum = ?, is_array = ?, character_max_length = ? "
        "WHERE table_name = ? AND column_name = ?",
        (new_name, *_spec_fields(spec), table, old_name),
    )


def clear_backfilling(conn: sqlite3.Connection, table: str, column: str) -> None:
    conn.execute(
        'UPDATE "_zero.column_metadata" SET backfill = NULL '
        "WHERE table_name = ? AND column_name = ?",
        (table, column),
    )


def delete_column(conn: sqlite3.Connection, table: str, column: str) -> None:
    conn.execute(
        'DELETE FROM "_zero.column_metadata" WHERE table_name = ? AND column_name = ?',
        (table, column),
    )


def delete_table(conn: sqlite3.Connection, table: str) -> None:
    conn.execute('DELETE FROM "_zero.column_metadata" WHERE table_name = ?', (table,))


def rename_table(conn: sqlite3.Connection, old: str, new: str) -> None:
    conn.execute(
        'UPDATE "_zero.column_metadata" SET table_name = ? WHERE table_name = ?', (new, old)
    )


def set_upstream_metadata(conn: sqlite3.Connection, schema: str, name: str, metadata: Any) -> None:
    conn.execute(
        'INSERT INTO "_zero.tableMetadata" ("schema", "table", "upstreamMetadata") '
        "VALUES (?, ?, ?) "
        'ON CONFLICT ("schema", "table") '
        'DO UPDATE SET "upstreamMetadata" = excluded."upstreamMetadata"',
        (schema, name, dumps(metadata)),
    )


def set_min_row_version(conn: sqlite3.Connection, schema: str, name: str, version: str) -> None:
    conn.execute(
        'INSERT INTO "_zero.tableMetadata" ("schema", "table", "minRowVersion") '
        "VALUES (?, ?, ?) "
        'ON CONFLICT ("schema", "table") DO UPDATE SET "minRowVersion" = excluded."minRowVersion"',
        (schema, name, version),
    )


def rename_table_metadata(
    conn: sqlite3.Connection, old: tuple[str, str], new: tuple[str, str]
) -> None:
    conn.execute(
        'UPDATE "_zero.tableMetadata" SET "schema" = ?, "table" = ? '
        'WHERE "schema" = ? AND "table" = ?',
        (*new, *old),
    )


def drop_table_metadata(conn: sqlite3.Connection, schema: str, name: str) -> None:
    conn.execute(
        'DELETE FROM "_zero.tableMetadata" WHERE "schema" = ? AND "table" = ?', (schema, name)
    )
