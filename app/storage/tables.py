"""The change DB's tables, defined once for both SQLite and Postgres.

Tables carry no schema here. On Postgres every statement runs with a
``schema_translate_map`` that points them at the shard's ``"<app>_<shard>/cdc"``
schema; on SQLite the shard owns the whole file. Names and columns match the
reference's schema version 6, so a reference view-syncer that discovers its
change-streamer through ``replicationState."ownerAddress"`` reads ours unchanged.

Alembic's ``env.py`` uses ``metadata`` as its target, and a test checks that the
migrations produce exactly these tables.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Dialect,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.types import TypeDecorator, TypeEngine, UserDefinedType

metadata = MetaData()


class _PgJsonText(UserDefinedType[str]):
    """Postgres ``JSON`` that is written and read as text, never re-encoded.

    The change log stores the exact bytes that subscribers receive. ``JSON`` (not
    ``JSONB``) keeps them verbatim, including ``\\u0000``; readers select
    ``change::text`` so psycopg never parses the value.
    """

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "JSON"


class JsonText(TypeDecorator[str]):
    """Pre-serialized JSON text: ``JSON`` on Postgres, ``TEXT`` on SQLite."""

    impl = Text
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(_PgJsonText())
        return dialect.type_descriptor(Text())


class JsonObject(TypeDecorator[Any]):
    """A JSON value held as Python data: ``JSONB`` on Postgres, ``TEXT`` on SQLite.

    Used for the opaque table metadata and backfill IDs, which the service only
    reads back as objects.
    """

    impl = Text
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.JSONB())
        return dialect.type_descriptor(Text())

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if dialect.name == "postgresql" or value is None:
            return value
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        if dialect.name == "postgresql" or value is None:
            return value
        return json.loads(value)


class StringList(TypeDecorator[list[str]]):
    """A list of strings: ``TEXT[]`` on Postgres, a JSON array in ``TEXT`` on SQLite."""

    impl = Text
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.ARRAY(Text()))
        return dialect.type_descriptor(Text())

    def process_bind_param(self, value: list[str] | None, dialect: Dialect) -> Any:
        if dialect.name == "postgresql" or value is None:
            return value
        return json.dumps(list(value))

    def process_result_value(self, value: Any, dialect: Dialect) -> list[str] | None:
        if value is None:
            return None
        if dialect.name == "postgresql":
            return list(value)
        decoded = json.loads(value)
        return [str(v) for v in decoded]


def watermark_type() -> TypeEngine[str]:
    """TEXT that compares byte-wise on both databases.

    LexiVersions are only ordered correctly under byte order, which is SQLite's
    default (BINARY) and Postgres' ``"C"`` collation.
    """
    return Text().with_variant(Text(collation="C"), "postgresql")


def _single_row_lock() -> Column[int]:
    return Column("lock", Integer, primary_key=True, default=1, server_default="1")


change_log = Table(
    "changeLog",
    metadata,
    Column("watermark", watermark_type(), primary_key=True),
    Column("pos", BigInteger, primary_key=True),
    Column("change", JsonText(), nullable=False),
    Column("precommit", watermark_type(), nullable=True),
    # Rows live in the primary-key b-tree itself: one b-tree write per append and
    # no rowid indirection on catch-up reads, which scan in key order.
    sqlite_with_rowid=False,
)

replication_state = Table(
    "replicationState",
    metadata,
    Column("lastWatermark", watermark_type(), nullable=False),
    Column("owner", Text, nullable=True),
    Column("ownerAddress", Text, nullable=True),
    _single_row_lock(),
    CheckConstraint('"lock" = 1', name="replicationState_single_row"),
)

replication_config = Table(
    "replicationConfig",
    metadata,
    Column("replicaVersion", watermark_type(), nullable=False),
    Column("publications", StringList(), nullable=False),
    Column("resetRequired", Boolean, nullable=True),
    _single_row_lock(),
    CheckConstraint('"lock" = 1', name="replicationConfig_single_row"),
)

table_metadata = Table(
    "tableMetadata",
    metadata,
    Column("schema", Text, primary_key=True),
    Column("table", Text, primary_key=True),
    Column("metadata", JsonObject(), nullable=False),
)

backfilling = Table(
    "backfilling",
    metadata,
    Column("schema", Text, primary_key=True),
    Column("table", Text, primary_key=True),
    Column("column", Text, primary_key=True),
    Column("backfill", JsonObject(), nullable=False),
)

# The reference's own migration bookkeeping. We migrate with Alembic, but keep
# this row at the reference's schema version so that a reference
# replication-manager pointed at the same change DB recognizes the schema
# instead of trying to create it again.
version_history = Table(
    "versionHistory",
    metadata,
    Column("dataVersion", Integer, nullable=False),
    Column("schemaVersion", Integer, nullable=False),
    Column("minSafeVersion", Integer, nullable=False),
    Column("lock", String(1), primary_key=True, default="v", server_default="v"),
    CheckConstraint("\"lock\" = 'v'", name="versionHistory_single_row"),
)

REFERENCE_SCHEMA_VERSION = 6
