"""Migrations: the schema they make, and every way start-up must refuse a database."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection

from app.storage import ChangeDb, ChangeDbSetupError, Shard, create_change_db, migrate
from app.storage.engine import parse_change_db_url
from app.storage.migrate import current_revision, head_revision
from app.storage.tables import metadata

REFERENCE_TABLES = {
    "changeLog",
    "replicationState",
    "replicationConfig",
    "tableMetadata",
    "backfilling",
    "versionHistory",
}


async def table_names(db: ChangeDb) -> set[str]:
    async with db.reader.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names(schema=db.schema)))


async def test_migration_creates_the_reference_tables_and_records_the_head(
    empty_db: ChangeDb,
) -> None:
    assert await current_revision(empty_db) is None
    revision = await migrate(empty_db)
    assert revision == head_revision(empty_db)
    assert await current_revision(empty_db) == revision
    assert await table_names(empty_db) == REFERENCE_TABLES | {"alembic_version"}


async def test_migrated_schema_matches_the_table_definitions(db: ChangeDb) -> None:
    def diff(conn: Connection) -> list[object]:
        if db.schema is not None:
            conn.exec_driver_sql(f'SET search_path TO "{db.schema}"')
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return [d for d in compare_metadata(ctx, metadata) if "alembic_version" not in str(d)]

    async with db.writer.connect() as conn:
        assert await conn.run_sync(diff) == []


async def test_migrating_twice_changes_nothing(db: ChangeDb) -> None:
    before = await table_names(db)
    assert await migrate(db) == head_revision(db)
    assert await table_names(db) == before


async def test_reference_version_history_row_says_schema_6(db: ChangeDb) -> None:
    async with db.reader.connect() as conn:
        row = (
            await conn.execute(
                text(
                    f'SELECT "dataVersion", "schemaVersion" FROM {db.table_name("versionHistory")}'
                )
            )
        ).one()
    assert tuple(row) == (6, 6)


async def test_watermarks_sort_bytewise_in_the_database(db: ChangeDb) -> None:
    # A locale collation would put "B" after "a" or ignore the ".", which breaks
    # LexiVersion order; the columns must compare like Python strings.
    watermarks = ["a", "B", "0", "0.01", "00", "z", "Z", "10", "1.", "_"]
    table = db.table_name("changeLog")
    async with db.writer.begin() as conn:
        for w in watermarks:
            await conn.execute(
                text(f"INSERT INTO {table} (watermark, pos, change) VALUES (:w, 0, '{{}}')"),
                {"w": w},
            )
        rows = await conn.execute(text(f"SELECT watermark FROM {table} ORDER BY watermark"))
        assert [r[0] for r in rows] == sorted(watermarks)


async def test_a_failed_migration_leaves_nothing_behind(
    empty_db: ChangeDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The initial revision's last step is a bulk insert, after every table exists.
    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated failure half way through the migration")

    monkeypatch.setattr(Operations, "bulk_insert", fail)
    with pytest.raises(RuntimeError, match="half way"):
        await migrate(empty_db)
    assert await table_names(empty_db) == set()
    assert await current_revision(empty_db) is None


async def test_a_newer_schema_revision_is_refused(db: ChangeDb) -> None:
    table = db.table_name("alembic_version")
    async with db.writer.begin() as conn:
        await conn.execute(text(f"UPDATE {table} SET version_num = '9999_from_the_future'"))
    with pytest.raises(ChangeDbSetupError) as e:
        await migrate(db)
    message = str(e.value)
    assert "9999_from_the_future" in message
    assert "newer version" in message
    assert "\n" not in message


async def test_a_foreign_database_is_refused(empty_db: ChangeDb) -> None:
    async with empty_db.writer.begin() as conn:
        if empty_db.schema is not None:
            await conn.execute(text(f'CREATE SCHEMA "{empty_db.schema}"'))
        await conn.execute(text(f"CREATE TABLE {empty_db.table_name('orders')} (id INT)"))
    with pytest.raises(ChangeDbSetupError, match=r"is not a changestreamer change DB.*orders"):
        await migrate(empty_db)
    assert await table_names(empty_db) == {"orders"}


async def test_a_corrupt_sqlite_file_is_refused_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.db"
    path.write_bytes(b"this is not a database file at all " * 200)
    db = create_change_db(parse_change_db_url(str(path)), Shard())
    try:
        with pytest.raises(ChangeDbSetupError) as e:
            await migrate(db)
    finally:
        await db.dispose()
    message = str(e.value)
    assert "is not a SQLite database" in message
    assert str(path) in message
    assert "\n" not in message


async def test_a_sqlite_file_of_another_program_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "replica.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE issues (id TEXT PRIMARY KEY, title TEXT)")
    db = create_change_db(parse_change_db_url(str(path)), Shard())
    try:
        with pytest.raises(ChangeDbSetupError, match="not a changestreamer change DB"):
            await migrate(db)
    finally:
        await db.dispose()


async def test_a_postgres_that_refuses_the_connection_ends_with_one_line() -> None:
    # Port 1 on loopback: nothing listens there, so the connection is refused.
    url = parse_change_db_url("postgresql://postgres:secret@127.0.0.1:1/nowhere")
    db = create_change_db(url, Shard())
    try:
        with pytest.raises(ChangeDbSetupError) as e:
            await migrate(db)
    finally:
        await db.dispose()
    message = str(e.value)
    assert message.startswith(
        "cannot connect to the change DB postgresql://postgres:***@127.0.0.1:1"
    )
    assert "secret" not in message
    assert "\n" not in message
