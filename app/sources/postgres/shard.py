"""The shard's upstream objects: checks, and the idempotent setup (spec/source.md §5.1, §6.1).

A shard is what one app/shard pair owns in the upstream database:

* schema ``{app}`` with ``permissions`` (one row; a trigger keeps its md5 ``hash``);
* schema ``{app}_{shard}`` with ``clients``, ``mutations``, ``shardConfig``,
  ``replicas``, ``publishedSchema``, the DDL functions and a ``versionHistory`` row;
* publications: the user's, or ``_{app}_public_{shard}`` (all of schema ``public``),
  plus always ``_{app}_metadata_{shard}``;
* the DDL event triggers, or ``ddlDetection = false`` when the role may not create
  them (degraded mode).

Objects, names and the ``versionHistory`` row (schema v23) are the reference's, so a
shard set up here looks to zero-cache 1.9.0 like one it set up itself, and vice versa.
Setup runs once per shard (guarded by ``versionHistory`` under an advisory lock);
if the stored publications no longer match the requested ones, the shard is dropped
and set up again, because a replica is only valid for the publications it synced.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql as pgsql

from app.sources.postgres.ddl import event_functions_sql, event_triggers_sql
from app.sources.postgres.errors import ShardConfigError, ShardSetupError, UpstreamConfigError
from app.sources.postgres.published import (
    PublicationInfo,
    PublishedSchema,
    publication_info,
    quote_literal,
    validate_publications,
)

__all__ = [
    "SHARD_SCHEMA_VERSION",
    "InternalShardConfig",
    "ShardConfig",
    "check_app_id",
    "check_publication_name",
    "check_published_tables",
    "check_upstream",
    "check_upstream_settings",
    "default_publication_name",
    "drop_shard",
    "ensure_replica_identities",
    "metadata_publication_name",
    "read_shard_config",
    "replica_identities_to_set",
    "setup_shard",
]

log = logging.getLogger(__name__)

# The reference's shard schema version (zero-cache 1.9.0): recorded in versionHistory
# so the reference sees an up-to-date shard and runs no migrations on it.
SHARD_SCHEMA_VERSION: Final = 23
MIN_SERVER_VERSION_NUM: Final = 150000

_APP_ID: Final = re.compile(r"[a-z0-9_]+", re.ASCII)
_PUBLICATION_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)


@dataclass(frozen=True, slots=True)
class ShardConfig:
    """What the operator configures: app ID, shard number, publications (empty: default)."""

    app_id: str = "zero"
    shard_num: int = 0
    publications: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "publications", tuple(self.publications))
        check_app_id(self.app_id)
        if isinstance(self.shard_num, bool) or not isinstance(self.shard_num, int):
            raise ShardConfigError(f"shard number must be an integer, not {self.shard_num!r}")
        if self.shard_num < 0:
            raise ShardConfigError(f"shard number must not be negative: {self.shard_num}")

    @property
    def shard_schema(self) -> str:
        """``{app}_{shard}``: also the replication slot prefix and the trigger namespace."""
        return f"{self.app_id}_{self.shard_num}"


@dataclass(frozen=True, slots=True)
class InternalShardConfig:
    """The stored ``shardConfig`` row: every publication (sorted) and the DDL mode."""

    publications: list[str]
    ddl_detection: bool


# --- checks --------------------------------------------------------------------------


def check_app_id(app_id: str) -> None:
    if not isinstance(app_id, str) or not _APP_ID.fullmatch(app_id):
        raise ShardConfigError(
            "The App ID may only consist of lower-case letters, numbers, "
            "and the underscore character"
        )


def check_publication_name(name: str) -> None:
    """A user publication name: a plain identifier, at most 63 chars, not ``_``-prefixed."""
    if not _PUBLICATION_NAME.fullmatch(name):
        raise ShardConfigError(
            f'Invalid publication name "{name}". Publication names must start with a letter '
            "or underscore and contain only letters, digits, and underscores."
        )
    if len(name) > 63:
        raise ShardConfigError(
            f'Publication name "{name}" exceeds PostgreSQL\'s 63-character identifier limit.'
        )
    if name.startswith("_"):
        raise ShardConfigError(
            'Publication names starting with "_" are reserved for internal use.\n'
            f'Please use a different name for publication "{name}".'
        )


def check_upstream_settings(wal_level: str, server_version_num: int) -> None:
    """The server requirements, on plain values so they can be tested without a server."""
    if wal_level != "logical":
        raise UpstreamConfigError(
            f"Postgres must be configured with wal_level = logical (currently: {wal_level})"
        )
    if server_version_num < MIN_SERVER_VERSION_NUM:
        raise UpstreamConfigError(
            f"Must be running Postgres 15 or higher (currently: {server_version_num})"
        )


async def check_upstream(conn: psycopg.AsyncConnection[Any]) -> int:
    """Check ``wal_level`` and the server version; returns ``server_version_num``."""
    cur = await conn.execute(
        "SELECT current_setting('wal_level'), current_setting('server_version_num')::int"
    )
    row = await cur.fetchone()
    assert row is not None
    wal_level, version = str(row[0]), int(row[1])
    check_upstream_settings(wal_level, version)
    return version


# --- names ---------------------------------------------------------------------------


def default_publication_name(app_id: str, shard_num: int) -> str:
    return f"_{app_id}_public_{shard_num}"


def metadata_publication_name(app_id: str, shard_num: int) -> str:
    return f"_{app_id}_metadata_{shard_num}"


def _ident(*names: str) -> str:
    return pgsql.Identifier(*names).as_string()


async def _run(conn: psycopg.AsyncConnection[Any], text: str) -> None:
    # Our statements are built text (identifiers quoted, literals escaped), several
    # per string; bytes without parameters go as one simple query.
    await conn.execute(text.encode())


# --- setup ---------------------------------------------------------------------------


async def setup_shard(conn: psycopg.AsyncConnection[Any], cfg: ShardConfig) -> InternalShardConfig:
    """Check the upstream and make sure the shard exists for ``cfg``'s publications.

    Idempotent: a second run changes nothing. If the stored publications differ from
    the requested ones (or one of them is gone), the shard is dropped and set up again.
    Then the published tables are validated (:func:`check_published_tables`).
    ``conn`` must be in autocommit mode: the setup commits its own transactions.
    """
    if not conn.autocommit:
        raise ValueError("setup_shard needs an autocommit connection")
    for pub in cfg.publications:
        check_publication_name(pub)
    await check_upstream(conn)
    internal = await _ensure_shard_schema(conn, cfg)
    if not await _matches_request(conn, cfg, internal):
        log.warning(
            "requested publications %s differ from the shard's %s (or some are missing): "
            "dropping and re-creating shard %s",
            list(cfg.publications),
            internal.publications,
            cfg.shard_schema,
        )
        await drop_shard(conn, cfg.app_id, cfg.shard_num)
        internal = await _ensure_shard_schema(conn, cfg)
    await check_published_tables(conn, internal.publications)
    return internal


async def check_published_tables(
    conn: psycopg.AsyncConnection[Any], publications: Sequence[str]
) -> PublicationInfo:
    """Read and validate what ``publications`` publish (flags, names, replica identity)."""
    info = await publication_info(conn, publications)
    validate_publications(info)
    return info


async def read_shard_config(
    conn: psycopg.AsyncConnection[Any], cfg: ShardConfig
) -> InternalShardConfig:
    table = _ident(cfg.shard_schema, "shardConfig")
    cur = await conn.execute(f'SELECT "publications", "ddlDetection" FROM {table}'.encode())
    rows = await cur.fetchall()
    if len(rows) != 1:
        raise ShardSetupError(f"Expected exactly one shardConfig row, got {len(rows)}")
    return InternalShardConfig(list(rows[0][0]), bool(rows[0][1]))


async def drop_shard(conn: psycopg.AsyncConnection[Any], app_id: str, shard_num: int) -> None:
    """Drop the shard's publications and schema (and with it its functions and triggers)."""
    # DROP SCHEMA ... CASCADE leaves publications alone, hence the explicit drops.
    async with conn.transaction():
        await _run(
            conn,
            f"DROP PUBLICATION IF EXISTS {_ident(default_publication_name(app_id, shard_num))};\n"
            f"DROP PUBLICATION IF EXISTS {_ident(metadata_publication_name(app_id, shard_num))};\n"
            f"DROP SCHEMA IF EXISTS {_ident(f'{app_id}_{shard_num}')} CASCADE;",
        )


async def _matches_request(
    conn: psycopg.AsyncConnection[Any], cfg: ShardConfig, internal: InternalShardConfig
) -> bool:
    cur = await conn.execute(
        "SELECT count(*) FROM pg_publication WHERE pubname = ANY(%s)", [internal.publications]
    )
    row = await cur.fetchone()
    if row is None or row[0] != len(internal.publications):
        return False
    user_pubs = {p for p in internal.publications if not p.startswith("_")}
    return user_pubs == set(cfg.publications)


async def _ensure_shard_schema(
    conn: psycopg.AsyncConnection[Any], cfg: ShardConfig
) -> InternalShardConfig:
    """Set the shard up unless ``versionHistory`` says it is; one transaction, locked."""
    schema = cfg.shard_schema
    history = _ident(schema, "versionHistory")
    async with conn.transaction():
        # Same lock name as the reference's migrations: concurrent starters take turns.
        await conn.execute(
            "SELECT pg_advisory_xact_lock(hashtext(%s))", [f"migrate-schema:{schema}"]
        )
        await _run(
            conn,
            f"""
            CREATE SCHEMA IF NOT EXISTS {_ident(schema)};
            CREATE TABLE IF NOT EXISTS {history} (
              "dataVersion" int NOT NULL,
              "schemaVersion" int NOT NULL,
              "minSafeVersion" int NOT NULL,
              lock char(1) NOT NULL CONSTRAINT DF_schema_meta_lock DEFAULT 'v',
              CONSTRAINT PK_schema_meta_lock PRIMARY KEY (lock),
              CONSTRAINT CK_schema_meta_lock CHECK (lock='v')
            );""",
        )
        cur = await conn.execute(
            f'SELECT "dataVersion", "schemaVersion", "minSafeVersion" FROM {history}'.encode()
        )
        row = await cur.fetchone()
        data_version, schema_version, min_safe = row if row is not None else (0, 0, 0)
        if min_safe > SHARD_SCHEMA_VERSION:
            raise ShardSetupError(
                f"Cannot run at shard schema v{SHARD_SCHEMA_VERSION} because the rollback "
                f"limit of {schema} is v{min_safe}"
            )
        if data_version == 0:
            await _initial_setup(conn, cfg)
            await _write_version(conn, history, SHARD_SCHEMA_VERSION, SHARD_SCHEMA_VERSION, 1)
        elif data_version < SHARD_SCHEMA_VERSION:
            # The reference would migrate in place; we only set shards up from scratch.
            raise ShardSetupError(
                f"Shard {schema} is at schema v{data_version}, older than v"
                f"{SHARD_SCHEMA_VERSION}; upgrade it with zero-cache 1.9.0 or drop it "
                f"(it is re-created on the next start)"
            )
        elif data_version > SHARD_SCHEMA_VERSION:
            # A newer zero-cache ran here; like the reference, record the older data
            # version (schemaVersion never moves back).
            await _write_version(conn, history, SHARD_SCHEMA_VERSION, schema_version, min_safe)
        return await read_shard_config(conn, cfg)


async def _write_version(
    conn: psycopg.AsyncConnection[Any],
    history: str,
    data_version: int,
    schema_version: int,
    min_safe: int,
) -> None:
    await conn.execute(
        f"""INSERT INTO {history} ("dataVersion", "schemaVersion", "minSafeVersion")
            VALUES (%s, %s, %s)
            ON CONFLICT (lock) DO UPDATE SET "dataVersion" = excluded."dataVersion",
              "schemaVersion" = excluded."schemaVersion",
              "minSafeVersion" = excluded."minSafeVersion" """.encode(),
        [data_version, schema_version, min_safe],
    )


async def _initial_setup(conn: psycopg.AsyncConnection[Any], cfg: ShardConfig) -> None:
    publications = list(cfg.publications)
    if publications:
        cur = await conn.execute(
            "SELECT pubname FROM pg_publication WHERE pubname = ANY(%s)", [publications]
        )
        found = [r[0] for r in await cur.fetchall()]
        if len(found) != len(publications):
            raise ShardConfigError(
                f"Unknown or invalid publications. Specified: [{','.join(publications)}]. "
                f"Found: [{','.join(found)}]"
            )
    else:
        default = _ident(default_publication_name(cfg.app_id, cfg.shard_num))
        await _run(
            conn,
            f"DROP PUBLICATION IF EXISTS {default};\n"
            f"CREATE PUBLICATION {default} FOR TABLES IN SCHEMA public "
            "WITH (publish_via_partition_root = true);",
        )
        publications = [default_publication_name(cfg.app_id, cfg.shard_num)]
    metadata = metadata_publication_name(cfg.app_id, cfg.shard_num)
    publications.append(metadata)

    await _run(conn, _global_setup_sql(cfg.app_id) + _shard_setup_sql(cfg, publications))
    info = await publication_info(conn, publications)
    await _apply_replica_identities(conn, replica_identities_to_set(info.schema))
    await _setup_triggers(conn, cfg, publications)


def _global_setup_sql(app_id: str) -> str:
    """The app-wide objects; safe to run again for every shard of the app."""
    app = _ident(app_id)
    return f"""
CREATE SCHEMA IF NOT EXISTS {app};

CREATE TABLE IF NOT EXISTS {app}.permissions (
  "permissions" JSONB,
  "hash"        TEXT,
  -- a single row: every writer updates it, nobody inserts
  "lock" BOOL PRIMARY KEY DEFAULT true CHECK (lock)
);

CREATE OR REPLACE FUNCTION {app}.set_permissions_hash()
RETURNS TRIGGER AS $$
BEGIN
    NEW.hash = md5(NEW.permissions::text);
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE TRIGGER on_set_permissions
  BEFORE INSERT OR UPDATE ON {app}.permissions
  FOR EACH ROW
  EXECUTE FUNCTION {app}.set_permissions_hash();

INSERT INTO {app}.permissions (permissions) VALUES (NULL) ON CONFLICT DO NOTHING;
"""


def _shard_setup_sql(cfg: ShardConfig, publications: list[str]) -> str:
    app = _ident(cfg.app_id)
    shard = _ident(cfg.shard_schema)
    metadata = _ident(metadata_publication_name(cfg.app_id, cfg.shard_num))
    stored = ", ".join(quote_literal(p) for p in sorted(publications))
    return f"""
CREATE SCHEMA IF NOT EXISTS {shard};

CREATE TABLE {shard}."clients" (
  "clientGroupID"  TEXT NOT NULL,
  "clientID"       TEXT NOT NULL,
  "lastMutationID" BIGINT NOT NULL,
  "userID"         TEXT,
  PRIMARY KEY("clientGroupID", "clientID")
);

CREATE TABLE {shard}."mutations" (
  "clientGroupID"  TEXT NOT NULL,
  "clientID"       TEXT NOT NULL,
  "mutationID"     BIGINT NOT NULL,
  "result"         JSON NOT NULL,
  PRIMARY KEY("clientGroupID", "clientID", "mutationID")
);

DROP PUBLICATION IF EXISTS {metadata};
CREATE PUBLICATION {metadata}
  FOR TABLE {app}."permissions", TABLE {shard}."clients", {shard}."mutations";

CREATE TABLE {shard}."shardConfig" (
  "publications"  TEXT[] NOT NULL,
  "ddlDetection"  BOOL NOT NULL,
  "lock" BOOL PRIMARY KEY DEFAULT true CHECK (lock)
);

-- ddlDetection becomes true once the event triggers exist (see _setup_triggers).
INSERT INTO {shard}."shardConfig" ("publications", "ddlDetection")
  VALUES (ARRAY[{stored}]::text[], false);

CREATE TABLE {shard}.replicas (
  "id"                 TEXT PRIMARY KEY DEFAULT replace(gen_random_uuid()::text, '-', ''),
  "rank"               BIGSERIAL,
  "slot"               TEXT NOT NULL,
  "version"            TEXT NOT NULL,
  "initialSchema"      JSON,
  "initialSyncContext" JSON,
  "subscriberContext"  JSON
);
"""


async def _setup_triggers(
    conn: psycopg.AsyncConnection[Any], cfg: ShardConfig, publications: list[str]
) -> None:
    """Install the DDL functions, then try the event triggers in a savepoint.

    Creating event triggers needs superuser-like rights. Without them (42501) the shard
    runs degraded: ``ddlDetection`` stays false and any schema change makes the stream
    ask for a resync.
    """
    shard = _ident(cfg.shard_schema)
    cur = await conn.execute(f'SELECT "ddlDetection" FROM {shard}."shardConfig"'.encode())
    row = await cur.fetchone()
    already_enabled = bool(row and row[0])
    await _run(conn, event_functions_sql(cfg.app_id, cfg.shard_num, publications))
    try:
        async with conn.transaction():
            await _run(
                conn,
                event_triggers_sql(cfg.app_id, cfg.shard_num)
                + f'UPDATE {shard}."shardConfig" SET "ddlDetection" = true;',
            )
    except pgerrors.InsufficientPrivilege as e:
        if already_enabled:
            raise  # it worked before: a failure now is not a missing privilege to live with
        log.warning(
            "Unable to create event triggers for schema change detection: %s. "
            "Proceeding in degraded mode: schema changes will halt replication, "
            "requiring the replica to be reset (manually or with --auto-reset).",
            e.diag.message_hint or e.diag.message_primary or e,
        )


# --- replica identity ----------------------------------------------------------------


def replica_identities_to_set(schema: PublishedSchema) -> list[tuple[str, str, str]]:
    """``(schema, table, index)`` for tables without a primary key (identity DEFAULT)
    that have a suitable unique index: unique, immediate (not deferrable), all NOT NULL.
    Partial and expression indexes are never in the published schema."""
    found: list[tuple[str, str, str]] = []
    for table in schema["tables"]:
        if table.get("primaryKey") or table.get("replicaIdentity") != "d":
            continue
        for index in schema["indexes"]:
            if (
                index["schema"] != table["schema"]
                or index["tableName"] != table["name"]
                or not index["unique"]
                or not index.get("isImmediate")
            ):
                continue
            if all(table["columns"][col].get("notNull") for col in index["columns"]):
                found.append((table["schema"], table["name"], index["name"]))
                break
    return found


async def ensure_replica_identities(
    conn: psycopg.AsyncConnection[Any], publications: Sequence[str]
) -> list[tuple[str, str, str]]:
    """Set ``REPLICA IDENTITY USING INDEX`` where :func:`replica_identities_to_set` says.

    The change source calls this again shortly after each schema change."""
    info = await publication_info(conn, publications)
    todo = replica_identities_to_set(info.schema)
    async with conn.transaction():
        await _apply_replica_identities(conn, todo)
    return todo


async def _apply_replica_identities(
    conn: psycopg.AsyncConnection[Any], todo: list[tuple[str, str, str]]
) -> None:
    for schema, table, index in todo:
        log.info('setting "%s" as the REPLICA IDENTITY for "%s"', index, table)
        await _run(
            conn,
            f"ALTER TABLE {_ident(schema, table)} REPLICA IDENTITY USING INDEX {_ident(index)}",
        )
