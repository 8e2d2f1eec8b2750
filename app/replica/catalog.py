"""What the replica's data tables look like, read back from the SQLite file.

The writer needs, per table: each column's lite type (to convert values), which
columns are being backfilled, and a row key for tables replicated with identity FULL.
zero derives that key from the unique indexes, as here: among the unique indexes whose
columns are all syncable and NOT NULL upstream, the one with the fewest columns, ties
broken by column names. Column types come from ``"_zero.column_metadata"`` when it
has the column, else from the declared type.

Tables named ``sqlite_*``, ``_zero.*`` and ``_litestream_*`` are not data tables.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field

from app.replica.ddl import LiteColumn
from app.replica.lite_types import (
    is_array,
    is_nullable,
    lite_type_string,
    zql_value_type,
)

__all__ = ["IndexInfo", "TableInfo", "declared_columns", "list_indexes", "load_tables"]


@dataclass(slots=True)
class TableInfo:
    name: str
    columns: dict[str, str]  # column → lite type string
    backfilling: list[str] = field(default_factory=list)
    primary_key: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class IndexInfo:
    name: str
    table: str
    unique: bool
    columns: dict[str, str]  # column → ASC | DESC, in index order


_DATA_TABLES = """
SELECT m.name, p.name, p.type, p."notnull", p.dflt_value
  FROM sqlite_master AS m
  JOIN pragma_table_info(m.name) AS p
 WHERE m.type = 'table'
   AND m.name NOT LIKE 'sqlite_%'
   AND m.name NOT LIKE '_zero.%'
   AND m.name NOT LIKE '_litestream_%'
 ORDER BY m.name, p.cid
"""


def load_tables(conn: sqlite3.Connection) -> dict[str, TableInfo]:
    """Every data table, with its row key picked from the unique indexes."""
    metadata: dict[tuple[str, str], tuple[str, bool]] = {}
    for table, column, upstream, not_null, enum, array, backfill in conn.execute(
        "SELECT table_name, column_name, upstream_type, is_not_null, is_enum, is_array, backfill "
        'FROM "_zero.column_metadata"'
    ):
        metadata[(table, column)] = (
            lite_type_string(upstream, bool(not_null), bool(enum), bool(array)),
            backfill is not None,
        )

    tables: dict[str, TableInfo] = {}
    for table, column, declared, _not_null, _dflt in conn.execute(_DATA_TABLES):
        info = tables.setdefault(table, TableInfo(table, {}))
        meta = metadata.get((table, column))
        if meta is None:
            info.columns[column] = declared
        else:
            info.columns[column] = meta[0]
            if meta[1]:
                info.backfilling.append(column)

    unique_keys: dict[str, list[list[str]]] = {}
    for index in list_indexes(conn):
        if index.unique:
            unique_keys.setdefault(index.table, []).append(list(index.columns))
    for info in tables.values():
        not_null = {
            col
            for col, lite_type in info.columns.items()
            if zql_value_type(lite_type) is not None and not is_nullable(lite_type)
        }
        keys = [key for key in unique_keys.get(info.name, []) if set(key) <= not_null]
        if keys:
            info.primary_key = min(keys, key=lambda k: (len(k), k))
    return tables


def list_indexes(conn: sqlite3.Connection, table: str | None = None) -> list[IndexInfo]:
    """The indexes on data tables (all, or ``table``'s), columns in index order."""
    rows = conn.execute(
        """
        SELECT idx.name, idx.tbl_name, info."unique", col.name,
               CASE WHEN col.desc = 0 THEN 'ASC' ELSE 'DESC' END
          FROM sqlite_master AS idx
          JOIN pragma_index_list(idx.tbl_name) AS info ON info.name = idx.name
          JOIN pragma_index_xinfo(idx.name) AS col
         WHERE idx.type = 'index' AND col.key = 1 AND idx.tbl_name NOT LIKE '_zero.%'
         ORDER BY idx.name, col.seqno ASC
        """
    ).fetchall()
    out: dict[str, IndexInfo] = {}
    for name, tbl, unique, column, direction in rows:
        if table is not None and tbl != table:
            continue
        index = out.setdefault(name, IndexInfo(name, tbl, unique != 0, {}))
        index.columns[column] = direction
    return list(out.values())


def declared_columns(conn: sqlite3.Connection, table: str) -> dict[str, LiteColumn]:
    """``table``'s columns as declared in SQLite (to rebuild the table)."""
    columns: dict[str, LiteColumn] = {}
    for _cid, name, declared, not_null, dflt, _pk in conn.execute(
        "SELECT * FROM pragma_table_info(?)", (table,)
    ):
        columns[name] = LiteColumn(
            pos=len(columns) + 1,
            data_type=declared,
            not_null=not_null != 0,
            dflt=dflt,
            is_array=is_array(declared),
        )
    return columns
