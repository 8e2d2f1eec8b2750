"""The published schema: which tables, columns and indexes the shard's publications carry.

One SQL query (``published_schema_query``) computes it as JSON. Initial sync runs it
at the slot's snapshot, and the DDL trigger function ``schema_specs()`` embeds the
very same text, so the schema stored with a replica and the schemas in DDL events
always agree (spec/source.md §1.6, §5.5).

The JSON keeps the reference's shape and key order (Postgres builds it; we parse it
with the project's one codec, which keeps order). Python only adds what the
reference adds after parsing: each table's ``replicaIdentityColumns``.

Also here, because both setup and the DDL diff need them: the checks that a
published table can be replicated (``validate_table``) and that the publications
publish everything (``validate_publications``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NotRequired, TypedDict, cast

import psycopg
from psycopg import sql as pgsql

from app.protocol import canonical_json
from app.sources.postgres.errors import PublicationError, UnsupportedTableSchemaError

__all__ = [
    "ColumnSpec",
    "IndexSpec",
    "PublicationFlags",
    "PublicationInfo",
    "PublishedSchema",
    "TableSpec",
    "lite_table_name",
    "publication_info",
    "published_schema",
    "published_schema_query",
    "quote_literal",
    "validate_publications",
    "validate_table",
    "with_replica_identity_columns",
]

log = logging.getLogger(__name__)

ZERO_VERSION_COLUMN: Final = "_0_version"

# Names the replica can hold (spec §5.1). Dots are fine in columns: SQLite names
# need no schema delimiter there.
_TABLE_NAME: Final = re.compile(r"[A-Za-z_]+[A-Za-z0-9_-]*", re.ASCII)
_COLUMN_NAME: Final = re.compile(r"[A-Za-z_]+[.A-Za-z0-9_-]*", re.ASCII)


class ColumnSpec(TypedDict):
    """One published column. Key order is Postgres's jsonb order, kept as received."""

    pos: int
    dataType: str
    typeOID: int
    pgTypeClass: NotRequired[str | None]
    elemPgTypeClass: NotRequired[str | None]
    characterMaximumLength: NotRequired[int | None]
    notNull: NotRequired[bool | None]
    dflt: NotRequired[str | None]


class TableSpec(TypedDict):
    """One published table, as the reference's ``PublishedTableWithReplicaIdentity``."""

    oid: int
    schema: str
    schemaOID: NotRequired[int]
    name: str
    replicaIdentity: NotRequired[Literal["d", "n", "f", "i"]]
    columns: dict[str, ColumnSpec]
    primaryKey: NotRequired[list[str]]
    publications: dict[str, dict[str, str | None]]
    replicaIdentityColumns: list[str]


class IndexSpec(TypedDict):
    """One index of a published table (no expression or partial indexes)."""

    schema: str
    tableName: str
    name: str
    unique: bool
    isPrimaryKey: NotRequired[bool]
    isReplicaIdentity: NotRequired[bool]
    isImmediate: NotRequired[bool]
    columns: dict[str, Literal["ASC", "DESC"]]


class PublishedSchema(TypedDict):
    tables: list[TableSpec]
    indexes: list[IndexSpec]


@dataclass(frozen=True, slots=True)
class PublicationFlags:
    """Which operations a publication publishes (all four are required)."""

    pubname: str
    pubinsert: bool
    pubupdate: bool
    pubdelete: bool
    pubtruncate: bool


@dataclass(frozen=True, slots=True)
class PublicationInfo:
    publications: list[PublicationFlags]
    schema: PublishedSchema


def quote_literal(value: str) -> str:
    """A SQL string literal (for SQL text that cannot take parameters, e.g. function bodies)."""
    return pgsql.Literal(value).as_string()


def _literal_list(values: Iterable[str]) -> str:
    return ", ".join(quote_literal(v) for v in values)


def lite_table_name(schema: str, name: str) -> str:
    """The table's name on the replica: bare for ``public``, else ``schema.name``."""
    return name if schema == "public" else f"{schema}.{name}"


def published_schema_query(publications: Sequence[str]) -> str:
    """The query returning one row, one column ``publishedSchema``: ``{tables, indexes}`` JSON.

    Notes on the parts that are not obvious:
    * PG15 lists generated columns in ``pg_publication_tables.attnames`` although their
      values are never replicated, hence ``attgenerated = ''`` below PG16.
    * Index columns are looked up on the *table* through ``pg_index.indkey`` (0-based in
      the array), because an index's own ``pg_attribute`` rows keep the old name after
      a column rename.
    * ``indoption`` bit 0 set means DESC.
    """
    pubs = _literal_list(publications)
    return f"""
WITH published_columns AS (SELECT
  pc.oid::int8 AS "oid",
  nspname AS "schema",
  pc.relnamespace::int8 AS "schemaOID",
  pc.relname AS "name",
  pc.relreplident AS "replicaIdentity",
  attnum AS "pos",
  attname AS "col",
  pt.typname AS "type",
  atttypid::int8 AS "typeOID",
  pt.typtype,
  elem_pt.typtype AS "elemTyptype",
  NULLIF(atttypmod, -1) AS "maxLen",
  attndims "arrayDims",
  attnotnull AS "notNull",
  pg_get_expr(pd.adbin, pd.adrelid) as "dflt",
  NULLIF(ARRAY_POSITION(conkey, attnum), -1) AS "keyPos",
  pb.rowfilter as "rowFilter",
  pb.pubname as "publication"
FROM pg_attribute
JOIN pg_class pc ON pc.oid = attrelid
JOIN pg_namespace pns ON pns.oid = relnamespace
JOIN pg_type pt ON atttypid = pt.oid
LEFT JOIN pg_type elem_pt ON elem_pt.oid = pt.typelem
JOIN pg_publication_tables as pb ON
  pb.schemaname = nspname AND
  pb.tablename = pc.relname AND
  attname = ANY(pb.attnames)
LEFT JOIN pg_constraint pk ON pk.contype = 'p' AND pk.connamespace = relnamespace
  AND pk.conrelid = attrelid
LEFT JOIN pg_attrdef pd ON pd.adrelid = attrelid AND pd.adnum = attnum
WHERE pb.pubname IN ({pubs}) AND
      (current_setting('server_version_num')::int >= 160000 OR attgenerated = '')
ORDER BY nspname, pc.relname),

tables AS (SELECT json_build_object(
  'oid', "oid",
  'schema', "schema",
  'schemaOID', "schemaOID",
  'name', "name",
  'replicaIdentity', "replicaIdentity",
  'columns', json_object_agg(
    DISTINCT
    col,
    jsonb_build_object(
      'pos', "pos",
      'dataType', CASE WHEN "arrayDims" = 0
                       THEN "type"
                       ELSE substring("type" from 2) || repeat('[]', "arrayDims") END,
      'pgTypeClass', "typtype",
      'elemPgTypeClass', "elemTyptype",
      'typeOID', "typeOID",
      'characterMaximumLength', CASE WHEN "typeOID" = 1043 OR "typeOID" = 1042
                                     THEN "maxLen" - 4
                                     ELSE "maxLen" END,
      'notNull', "notNull",
      'dflt', "dflt"
    )
  ),
  'primaryKey', ARRAY( SELECT json_object_keys(
    json_strip_nulls(
      json_object_agg(
        DISTINCT "col", "keyPos" ORDER BY "keyPos"
      )
    )
  )),
  'publications', json_object_agg(
    DISTINCT
    "publication",
    jsonb_build_object('rowFilter', "rowFilter")
  )
) AS "table" FROM published_columns
  GROUP BY "schema", "schemaOID", "name", "oid", "replicaIdentity"),

indexed_columns AS (SELECT
    pg_indexes.schemaname as "schema",
    pg_indexes.tablename as "tableName",
    pg_indexes.indexname as "name",
    index_column.name as "col",
    CASE WHEN pg_index.indoption[index_column.pos-1] & 1 = 1 THEN 'DESC' ELSE 'ASC' END as "dir",
    pg_index.indisunique as "unique",
    pg_index.indisprimary as "isPrimaryKey",
    pg_index.indisreplident as "isReplicaIdentity",
    pg_index.indimmediate as "isImmediate"
  FROM pg_indexes
  JOIN pg_namespace ON pg_indexes.schemaname = pg_namespace.nspname
  JOIN pg_class pc ON
    pc.relname = pg_indexes.indexname
    AND pc.relnamespace = pg_namespace.oid
  JOIN pg_publication_tables as pb ON
    pb.schemaname = pg_indexes.schemaname AND
    pb.tablename = pg_indexes.tablename
  JOIN pg_index ON pg_index.indexrelid = pc.oid
  JOIN LATERAL (
    SELECT array_agg(attname) as attnames, array_agg(attgenerated != '') as generated
      FROM pg_attribute
      WHERE attrelid = pg_index.indrelid
        AND attnum = ANY( (pg_index.indkey::smallint[] )[:pg_index.indnkeyatts - 1] )
  ) as indexed ON true
  JOIN LATERAL (
    SELECT pg_attribute.attname as name, col.index_pos as pos
      FROM UNNEST( (pg_index.indkey::smallint[])[:pg_index.indnkeyatts - 1] )
        WITH ORDINALITY as col(table_pos, index_pos)
      JOIN pg_attribute ON attrelid = pg_index.indrelid AND attnum = col.table_pos
  ) AS index_column ON true
  LEFT JOIN pg_constraint ON pg_constraint.conindid = pc.oid
  WHERE pb.pubname IN ({pubs})
    AND pg_index.indexprs IS NULL
    AND pg_index.indpred IS NULL
    AND (pg_constraint.contype IS NULL OR pg_constraint.contype IN ('p', 'u'))
    AND indexed.attnames <@ pb.attnames
    AND (current_setting('server_version_num')::int >= 160000
         OR false = ALL(indexed.generated))
  ORDER BY
    pg_indexes.schemaname,
    pg_indexes.tablename,
    pg_indexes.indexname,
    index_column.pos ASC),

indexes AS (SELECT json_build_object(
    'schema', "schema",
    'tableName', "tableName",
    'name', "name",
    'unique', "unique",
    'isPrimaryKey', "isPrimaryKey",
    'isReplicaIdentity', "isReplicaIdentity",
    'isImmediate', "isImmediate",
    'columns', json_object_agg("col", "dir")
  ) AS index FROM indexed_columns
    GROUP BY "schema", "tableName", "name", "unique",
       "isPrimaryKey", "isReplicaIdentity", "isImmediate")

SELECT json_build_object(
  'tables', COALESCE((SELECT json_agg("table") FROM tables), '[]'::json),
  'indexes', COALESCE((SELECT json_agg("index") FROM indexes), '[]'::json)
) as "publishedSchema"
"""


async def published_schema(
    conn: psycopg.AsyncConnection[Any], publications: Sequence[str]
) -> PublishedSchema:
    """Run the published-schema query on ``conn`` (in its current transaction/snapshot)."""
    query = published_schema_query(publications)
    # Fetched as text so the project's codec parses it (key order, exact integers).
    cur = await conn.execute(f'SELECT "publishedSchema"::text FROM ({query}) AS q'.encode())
    row = await cur.fetchone()
    if row is None or row[0] is None:
        raise RuntimeError("published schema query returned no row")
    return with_replica_identity_columns(canonical_json.loads(row[0]))


def with_replica_identity_columns(raw: dict[str, Any]) -> PublishedSchema:
    """Add each table's ``replicaIdentityColumns``, as the reference does after parsing.

    ``d``: the primary key; ``i``: the columns of the replica-identity index; ``f``: the
    row key the replicator will pick (shortest unique index over NOT NULL columns of
    supported types); ``n``: none. An existing key keeps its position.
    """
    if not isinstance(raw, dict) or not isinstance(raw.get("tables"), list):
        raise ValueError(f"not a published schema: {raw!r:.200}")
    indexes: list[IndexSpec] = raw.get("indexes") or []
    tables: list[TableSpec] = []
    table: dict[str, Any]
    for table in raw["tables"]:
        ident = table.get("replicaIdentity")
        columns: list[str] = []
        if ident == "d":
            columns = list(table.get("primaryKey") or [])
        elif ident == "i":
            for index in indexes:
                if (
                    index["schema"] == table["schema"]
                    and index["tableName"] == table["name"]
                    and index.get("isReplicaIdentity")
                ):
                    columns = list(index["columns"])
                    break
        elif ident == "f":
            columns = _replicator_row_key(cast(TableSpec, table), indexes)
        tables.append(cast(TableSpec, {**table, "replicaIdentityColumns": columns}))
    return {"tables": tables, "indexes": indexes}


# --- the replicator's choice of row key (for REPLICA IDENTITY FULL) ------------------

# Upstream type names ZQL can sync (anything else is left out of the client view,
# so it cannot be part of a row key).
_ZQL_TYPES: Final = frozenset(
    {
        "smallint", "integer", "int", "int2", "int4", "int8", "bigint", "smallserial",
        "serial", "serial2", "serial4", "serial8", "bigserial", "decimal", "numeric",
        "real", "double precision", "float", "float4", "float8",
        "date", "time", "timetz", "time with time zone", "time without time zone",
        "timestamp", "timestamptz", "timestamp with time zone",
        "timestamp without time zone",
        "bpchar", "character", "character varying", "text", "varchar",
        "cidr", "ean13", "inet", "isbn", "isbn13", "ismn", "ismn13", "issn", "issn13",
        "macaddr", "macaddr8", "pg_lsn", "upc", "uuid",
        "bool", "boolean", "json", "jsonb",
    }
)  # fmt: skip


def _zql_supported(spec: ColumnSpec) -> bool:
    if spec.get("elemPgTypeClass") is not None or "[]" in spec["dataType"]:
        return True  # arrays are synced as JSON
    if (spec.get("elemPgTypeClass") or spec.get("pgTypeClass")) == "e":
        return True  # enums are strings
    data_type = spec["dataType"].lower()
    return data_type.split("(", 1)[0] in _ZQL_TYPES


def _replicator_row_key(table: TableSpec, indexes: list[IndexSpec]) -> list[str]:
    name = lite_table_name(table["schema"], table["name"])
    usable = {
        col
        for col, spec in table["columns"].items()
        if _zql_supported(spec) and spec.get("notNull")
    }
    keys = [
        list(index["columns"])
        for index in indexes
        if index["unique"] and lite_table_name(index["schema"], index["tableName"]) == name
    ]
    keys = [key for key in keys if set(key) <= usable]
    # Fewest columns first, then by column names: the reference's deterministic pick.
    keys.sort(key=lambda key: (len(key), key))
    return keys[0] if keys else []


# --- publication info and validation -------------------------------------------------


async def publication_info(
    conn: psycopg.AsyncConnection[Any], publications: Sequence[str]
) -> PublicationInfo:
    """The publications' flags plus the published schema; refuses a table published twice
    with different column lists."""
    cur = await conn.execute(
        """
        SELECT schemaname, tablename, json_object_agg(pubname, attnames)::text
          FROM pg_publication_tables
          WHERE pubname = ANY(%s)
          GROUP BY schemaname, tablename
        """,
        [list(publications)],
    )
    for _schema, table, by_pub_text in await cur.fetchall():
        column_sets = [set(cols) for cols in canonical_json.loads(by_pub_text).values()]
        for cols in column_sets[1:]:
            if cols != column_sets[0]:
                raise PublicationError(
                    f"Table {table} is exported with different columns: "
                    f"[{','.join(sorted(column_sets[0]))}] vs [{','.join(sorted(cols))}]"
                )
    cur = await conn.execute(
        """
        SELECT pubname, pubinsert, pubupdate, pubdelete, pubtruncate
          FROM pg_publication WHERE pubname = ANY(%s) ORDER BY pubname
        """,
        [list(publications)],
    )
    flags = [PublicationFlags(*row) for row in await cur.fetchall()]
    return PublicationInfo(flags, await published_schema(conn, publications))


def validate_publications(info: PublicationInfo) -> None:
    """Every publication must publish all four operations; every table must be replicable."""
    for pub in info.publications:
        if not (pub.pubinsert and pub.pubupdate and pub.pubdelete and pub.pubtruncate):
            raise PublicationError(
                f"PUBLICATION {pub.pubname} must publish insert, update, delete, and truncate"
            )
    for table in info.schema["tables"]:
        validate_table(table)


def validate_table(table: TableSpec) -> None:
    """Raise :class:`UnsupportedTableSchemaError` if the replica cannot hold ``table``."""
    name = table["name"]
    if ZERO_VERSION_COLUMN in table["columns"]:
        raise UnsupportedTableSchemaError(
            f'Table "{name}" uses reserved column name "{ZERO_VERSION_COLUMN}"'
        )
    ident = table.get("replicaIdentity")
    if not table.get("primaryKey") and ident == "d":
        # Not fatal: the table replicates but is not synced to clients.
        log.warning(
            'Table "%s" needs a primary key in order to be synced to clients. '
            "Add one with 'ALTER TABLE \"%s\" ADD PRIMARY KEY (...)'.",
            name,
            name,
        )
    if ident == "n":
        raise UnsupportedTableSchemaError(
            f'Table "{name}" with REPLICA IDENTITY NOTHING cannot be replicated'
        )
    if ident == "i" and not table.get("replicaIdentityColumns"):
        raise UnsupportedTableSchemaError(f'Table "{name}" is missing its REPLICA IDENTITY INDEX')
    if not _TABLE_NAME.fullmatch(name):
        raise UnsupportedTableSchemaError(f'Table "{name}" has invalid characters.')
    for column in table["columns"]:
        if not _COLUMN_NAME.fullmatch(column):
            raise UnsupportedTableSchemaError(
                f'Column "{column}" in table "{name}" has invalid characters.'
            )
