"""Change DB URLs, shard names and connection settings."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Literal

import pytest
from sqlalchemy import text

from app.storage import (
    ChangeDb,
    ChangeDbConfigError,
    ChangeDbOptions,
    Shard,
    create_change_db,
    migrate,
    parse_change_db_url,
)
from app.storage.engine import APPLICATION_NAME, describe_url


@pytest.mark.parametrize(
    ("value", "driver", "database"),
    [
        ("postgres://u:p@127.0.0.1:5432/db", "postgresql+psycopg", "db"),
        ("postgresql://u@localhost/db?sslmode=disable", "postgresql+psycopg", "db"),
        ("sqlite:///data/zero_0-cdc.db", "sqlite+aiosqlite", "data/zero_0-cdc.db"),
        ("data/zero_0-cdc.db", "sqlite+aiosqlite", "data/zero_0-cdc.db"),
        ("/abs/cdc.db", "sqlite+aiosqlite", "/abs/cdc.db"),
    ],
)
def test_change_db_urls_map_to_async_drivers(value: str, driver: str, database: str) -> None:
    url = parse_change_db_url(value)
    assert (url.drivername, url.database) == (driver, database)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "change DB URL is empty"),
        ("   ", "change DB URL is empty"),
        ("mysql://u:hunter2@h/db", "unsupported scheme 'mysql'"),
        ("sqlite://", "needs a file path"),
        ("sqlite:///:memory:", "needs a file path"),
    ],
)
def test_bad_change_db_urls_are_refused_clearly(value: str, message: str) -> None:
    with pytest.raises(ChangeDbConfigError, match=message) as e:
        parse_change_db_url(value)
    assert "hunter2" not in str(e.value)


def test_descriptions_hide_passwords() -> None:
    url = parse_change_db_url("postgres://admin:hunter2@db.internal:5433/cdc")
    assert describe_url(url) == "postgresql://admin:***@db.internal:5433/cdc"
    assert describe_url(parse_change_db_url("x/y.db")) == "SQLite file x/y.db"


def test_shards_name_the_reference_cdc_schema() -> None:
    assert Shard("zoro", 3).cdc_schema == "zoro_3/cdc"
    with pytest.raises(ChangeDbConfigError, match="app ID 'Bad-App' is invalid"):
        Shard("Bad-App", 0)
    with pytest.raises(ChangeDbConfigError, match="negative"):
        Shard("zero", -1)


async def test_sqlite_runs_in_wal_mode_with_full_sync(sqlite_db: ChangeDb) -> None:
    db = sqlite_db
    for engine in (db.writer, db.reader):
        async with engine.connect() as conn:
            assert await conn.scalar(text("PRAGMA journal_mode")) == "wal"
            assert await conn.scalar(text("PRAGMA synchronous")) == 2  # FULL
            assert await conn.scalar(text("PRAGMA busy_timeout")) == 10_000
    assert Path(str(db.url.database) + "-wal").exists()


async def test_sqlite_has_exactly_one_writer_connection(sqlite_db: ChangeDb) -> None:
    db = sqlite_db
    assert db.writer.pool.size() == 1  # type: ignore[attr-defined]
    assert db.reader is not db.writer


async def test_postgres_sessions_carry_the_reference_application_name(pg_db: ChangeDb) -> None:
    db = pg_db
    async with db.reader.connect() as conn:
        assert (
            await conn.scalar(text("SELECT current_setting('application_name')"))
            == APPLICATION_NAME
        )
        timeout = await conn.scalar(text("SHOW idle_in_transaction_session_timeout"))
        assert timeout == "1min"


async def test_sqlite_readers_come_back_to_the_pool_outside_any_transaction(
    sqlite_db: ChangeDb,
) -> None:
    # The reader pool does not roll back on return (a thread hop per catch-up
    # batch): what SQLAlchemy began it rolls back itself, and the catch-up reads are
    # autocommit SELECTs on the driver. No pooled reader may keep a snapshot.
    db = sqlite_db
    async with db.writer.begin() as w:
        await w.execute(text("CREATE TABLE t (x int)"))
    async with db.reader.connect() as r:  # SQLAlchemy's own transaction (BEGIN)
        assert await r.scalar(text("SELECT count(*) FROM t")) == 0
    async with db.reader.connect() as r:  # a driver-level read, as storage.fastpath
        driver = (await r.get_raw_connection()).driver_connection
        assert driver is not None
        assert await driver.execute_fetchall("SELECT count(*) FROM t", ()) == [(0,)]
    async with db.writer.begin() as w:
        await w.execute(text("INSERT INTO t VALUES (1)"))
    size = db.reader.pool.size()  # type: ignore[attr-defined]
    conns = [await db.reader.connect() for _ in range(size)]
    try:
        for r in conns:
            driver = (await r.get_raw_connection()).driver_connection
            assert driver is not None
            assert not driver._conn.in_transaction
            assert await driver.execute_fetchall("SELECT count(*) FROM t", ()) == [(1,)]
    finally:
        for r in conns:
            await r.close()


@pytest.mark.usefixtures("usual_umask")
@pytest.mark.parametrize("writer", ["process", "thread"])
async def test_a_new_sqlite_change_db_and_its_wal_are_readable_by_their_owner_only(
    tmp_path: Path, writer: Literal["process", "thread"]
) -> None:
    path = tmp_path / "cdc.db"
    db = create_change_db(
        parse_change_db_url(str(path)), Shard(), ChangeDbOptions(sqlite_writer=writer)
    )
    try:
        await migrate(db)
        async with db.reader.connect() as conn:
            assert await conn.scalar(text("SELECT count(*) FROM changeLog")) == 0
            files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
            assert [stat.S_IMODE(f.stat().st_mode) for f in files] == [0o600] * 3
    finally:
        await db.dispose()


@pytest.mark.usefixtures("usual_umask")
async def test_the_writer_process_makes_a_missing_change_db_file_0600_too(tmp_path: Path) -> None:
    path = tmp_path / "cdc.db"
    db = create_change_db(parse_change_db_url(str(path)), Shard())
    try:
        assert db.sqlite_writer is not None
        await db.sqlite_writer.start()  # before any engine connected
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        await db.dispose()
