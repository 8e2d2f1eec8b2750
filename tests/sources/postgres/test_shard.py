"""Shard setup against a real Postgres (spec/source.md §5.1, §6.1): checks, idempotence,
publications, replica identity, validation, degraded mode.

Each test gets its own scratch database (conftest), dropped afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from app.sources.postgres.errors import (
    PublicationError,
    ShardConfigError,
    UnsupportedTableSchemaError,
    UpstreamConfigError,
)
from app.sources.postgres.shard import (
    SHARD_SCHEMA_VERSION,
    ShardConfig,
    check_publication_name,
    check_upstream,
    check_upstream_settings,
    read_shard_config,
    setup_shard,
)

CFG = ShardConfig("hpb", 0)


@pytest.fixture
async def conn(db_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        yield c


async def scalar(conn: psycopg.AsyncConnection[Any], query: str, *params: Any) -> Any:
    cur = await conn.execute(query.encode(), list(params) or None)
    row = await cur.fetchone()
    return None if row is None else row[0]


# --- checks on plain values ----------------------------------------------------------


def test_wal_level_other_than_logical_is_refused() -> None:
    with pytest.raises(
        UpstreamConfigError, match="Postgres must be configured with wal_level = logical"
    ):
        check_upstream_settings("replica", 150000)


def test_server_older_than_15_is_refused() -> None:
    with pytest.raises(UpstreamConfigError, match="Postgres 15 or higher"):
        check_upstream_settings("logical", 140010)
    check_upstream_settings("logical", 150000)  # the boundary is allowed


@pytest.mark.parametrize("app_id", ["Zero", "my-app", "", "zero app"])
def test_app_id_must_be_lower_case_letters_digits_underscore(app_id: str) -> None:
    with pytest.raises(ShardConfigError, match="App ID"):
        ShardConfig(app_id, 0)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("1pub", "Invalid publication name"),
        ("pub-lic", "Invalid publication name"),
        ("p" * 64, "63-character"),
        ("_mine", "reserved for internal use"),
    ],
)
def test_publication_names_are_checked(name: str, message: str) -> None:
    with pytest.raises(ShardConfigError, match=message):
        check_publication_name(name)
    check_publication_name("p" * 63)


# --- against the server --------------------------------------------------------------


async def test_this_server_passes_the_upstream_checks(conn: psycopg.AsyncConnection[Any]) -> None:
    assert await check_upstream(conn) >= 150000


async def test_setup_needs_an_autocommit_connection(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url) as conn:
        with pytest.raises(ValueError, match="autocommit"):
            await setup_shard(conn, CFG)


async def test_setup_creates_the_shard_objects(conn: psycopg.AsyncConnection[Any]) -> None:
    internal = await setup_shard(conn, CFG)

    assert internal.publications == ["_hpb_metadata_0", "_hpb_public_0"]
    assert internal.ddl_detection is True
    tables = await scalar(
        conn,
        "SELECT array_agg(table_schema || '.' || table_name ORDER BY 1) FROM "
        "information_schema.tables WHERE table_schema IN ('hpb', 'hpb_0')",
    )
    assert sorted(tables) == [
        "hpb.permissions",
        "hpb_0.clients",
        "hpb_0.mutations",
        "hpb_0.publishedSchema",
        "hpb_0.replicas",
        "hpb_0.shardConfig",
        "hpb_0.versionHistory",
    ]
    assert await scalar(
        conn,
        'SELECT array["dataVersion", "schemaVersion", "minSafeVersion"] '
        'FROM hpb_0."versionHistory"',
    ) == [SHARD_SCHEMA_VERSION, SHARD_SCHEMA_VERSION, 1]
    triggers = await scalar(
        conn, "SELECT array_agg(evtname ORDER BY evtname) FROM pg_event_trigger"
    )
    assert triggers == ["hpb_ddl_end_0", "hpb_ddl_start_0"]
    # The default publication covers schema public via the partition root.
    assert (
        await scalar(
            conn,
            "SELECT pubviaroot FROM pg_publication p JOIN pg_publication_namespace n "
            "ON n.pnpubid = p.oid "
            "WHERE pubname = '_hpb_public_0' AND pnnspid = 'public'::regnamespace",
        )
        is True
    )
    metadata_tables = await scalar(
        conn,
        "SELECT array_agg(schemaname || '.' || tablename ORDER BY 1) FROM pg_publication_tables "
        "WHERE pubname = '_hpb_metadata_0'",
    )
    assert sorted(metadata_tables) == ["hpb.permissions", "hpb_0.clients", "hpb_0.mutations"]
    assert await scalar(conn, 'SELECT current IS NOT NULL FROM hpb_0."publishedSchema"') is True


async def test_permissions_row_gets_its_hash_from_the_trigger(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await setup_shard(conn, CFG)
    await conn.execute("""UPDATE hpb.permissions SET permissions = '{"a": 1}'""")
    assert await scalar(conn, "SELECT hash = md5(permissions::text) FROM hpb.permissions") is True
    assert await scalar(conn, "SELECT count(*) FROM hpb.permissions") == 1


async def test_setup_twice_changes_nothing(conn: psycopg.AsyncConnection[Any]) -> None:
    first = await setup_shard(conn, CFG)
    await conn.execute(
        "INSERT INTO hpb_0.clients VALUES ('g', 'c', 1, 'u');"
        "INSERT INTO hpb_0.replicas (id, slot, version) VALUES ('r1', 'hpb_0_a', '00')"
    )
    pub_oid = await scalar(conn, "SELECT oid FROM pg_publication WHERE pubname = '_hpb_public_0'")

    second = await setup_shard(conn, CFG)

    assert second == first
    assert await scalar(conn, "SELECT count(*) FROM hpb_0.clients") == 1
    assert await scalar(conn, "SELECT count(*) FROM hpb_0.replicas") == 1
    assert (
        await scalar(conn, "SELECT oid FROM pg_publication WHERE pubname = '_hpb_public_0'")
        == pub_oid
    )


async def test_user_publications_replace_the_default(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(
        "CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION hpb_pub FOR TABLE t"
    )

    internal = await setup_shard(conn, ShardConfig("hpb", 0, ("hpb_pub",)))

    assert internal.publications == ["_hpb_metadata_0", "hpb_pub"]
    assert (
        await scalar(conn, "SELECT count(*) FROM pg_publication WHERE pubname = '_hpb_public_0'")
        == 0
    )


async def test_unknown_publication_is_refused(conn: psycopg.AsyncConnection[Any]) -> None:
    with pytest.raises(ShardConfigError, match=r"Unknown or invalid publications.*nope"):
        await setup_shard(conn, ShardConfig("hpb", 0, ("nope",)))
    # Nothing half-done is left behind: setup is one transaction.
    assert await scalar(conn, "SELECT count(*) FROM pg_namespace WHERE nspname = 'hpb_0'") == 0


async def test_changed_publications_drop_and_recreate_the_shard(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await setup_shard(conn, CFG)
    await conn.execute("INSERT INTO hpb_0.clients VALUES ('g', 'c', 1, 'u')")
    await conn.execute(
        "CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION hpb_pub FOR TABLE t"
    )

    internal = await setup_shard(conn, ShardConfig("hpb", 0, ("hpb_pub",)))

    assert internal.publications == ["_hpb_metadata_0", "hpb_pub"]
    assert (await read_shard_config(conn, CFG)).publications == internal.publications
    assert await scalar(conn, "SELECT count(*) FROM hpb_0.clients") == 0  # a new shard
    assert (
        await scalar(conn, "SELECT count(*) FROM pg_publication WHERE pubname = '_hpb_public_0'")
        == 0
    )
    # The event triggers went with the old schema and came back with the new one.
    assert await scalar(conn, "SELECT count(*) FROM pg_event_trigger") == 2


async def test_missing_publication_recreates_the_shard(conn: psycopg.AsyncConnection[Any]) -> None:
    await setup_shard(conn, CFG)
    await conn.execute("DROP PUBLICATION _hpb_public_0")

    internal = await setup_shard(conn, CFG)

    assert internal.publications == ["_hpb_metadata_0", "_hpb_public_0"]
    assert (
        await scalar(conn, "SELECT count(*) FROM pg_publication WHERE pubname = '_hpb_public_0'")
        == 1
    )


async def test_table_without_primary_key_gets_its_unique_index_as_replica_identity(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(
        "CREATE TABLE nopk (a int NOT NULL, b text, c int);"
        "CREATE UNIQUE INDEX nopk_nullable ON nopk (c);"  # nullable: unsuitable
        "CREATE UNIQUE INDEX nopk_a ON nopk (a);"
        "CREATE TABLE nokey (a int)"
    )

    await setup_shard(conn, CFG)

    assert await scalar(conn, "SELECT relreplident FROM pg_class WHERE relname = 'nopk'") == "i"
    assert (
        await scalar(
            conn,
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indisreplident AND i.indrelid = 'nopk'::regclass",
        )
        == "nopk_a"
    )
    assert await scalar(conn, "SELECT relreplident FROM pg_class WHERE relname = 'nokey'") == "d"


async def test_reserved_version_column_is_refused(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute('CREATE TABLE bad (id int PRIMARY KEY, "_0_version" text)')
    with pytest.raises(UnsupportedTableSchemaError, match='reserved column name "_0_version"'):
        await setup_shard(conn, CFG)


async def test_replica_identity_nothing_is_refused(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(
        "CREATE TABLE bad (id int PRIMARY KEY); ALTER TABLE bad REPLICA IDENTITY NOTHING"
    )
    with pytest.raises(UnsupportedTableSchemaError, match="REPLICA IDENTITY NOTHING"):
        await setup_shard(conn, CFG)


async def test_invalid_table_name_is_refused(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute('CREATE TABLE "bad name" (id int PRIMARY KEY)')
    with pytest.raises(UnsupportedTableSchemaError, match="invalid characters"):
        await setup_shard(conn, CFG)


async def test_publication_must_publish_every_operation(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(
        "CREATE TABLE t (id int PRIMARY KEY);"
        "CREATE PUBLICATION hpb_pub FOR TABLE t WITH (publish = 'insert, update, delete')"
    )
    with pytest.raises(PublicationError, match="must publish insert, update, delete, and truncate"):
        await setup_shard(conn, ShardConfig("hpb", 0, ("hpb_pub",)))


async def test_role_without_event_trigger_rights_runs_degraded(db_url: str, pg_url: str) -> None:
    role = f"hpb_role_{uuid.uuid4().hex[:8]}"
    dbname = psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as su:
        await su.execute(
            f'CREATE ROLE {role} LOGIN; GRANT CREATE ON DATABASE "{dbname}" TO {role};'
            f"GRANT CREATE ON SCHEMA public TO {role}".encode()
        )
    try:
        as_role = make_conninfo(db_url, user=role)
        async with await psycopg.AsyncConnection.connect(as_role, autocommit=True) as conn:
            # A non-superuser cannot publish a whole schema, but may publish its own table.
            await conn.execute(
                "CREATE TABLE mine (id int PRIMARY KEY); CREATE PUBLICATION hpb_pub FOR TABLE mine"
            )

            internal = await setup_shard(conn, ShardConfig("hpb", 0, ("hpb_pub",)))

            assert internal.ddl_detection is False
            assert await scalar(conn, "SELECT count(*) FROM pg_event_trigger") == 0
            # The manual hook is installed all the same.
            assert (
                await scalar(conn, "SELECT count(*) FROM pg_proc WHERE proname = 'update_schemas'")
                == 2
            )
    finally:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as su:
            await su.execute(f"DROP OWNED BY {role} CASCADE".encode())
        async with await psycopg.AsyncConnection.connect(
            make_conninfo(pg_url, dbname="postgres"), autocommit=True
        ) as su:
            await su.execute(f'REVOKE ALL ON DATABASE "{dbname}" FROM {role}'.encode())
            await su.execute(f"DROP ROLE IF EXISTS {role}".encode())
