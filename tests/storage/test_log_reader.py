"""The change log read without the engines (``log_reader``): the replica follower's
child reads exactly what the service's own reads give, on both databases."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from app.storage import ChangeDb, ChangeLog, ChangeRow, parse_change_db_url
from app.storage.engine import reader_target
from app.storage.log_reader import open_log_reader
from tests.change_dbs import migrated

from .conftest import drop_schema, make_db

OWNER = "task-a"


@pytest.fixture(params=["sqlite", "postgres"])
async def owned_db(
    request: pytest.FixtureRequest, tmp_path: Path, pg_url: str
) -> AsyncIterator[ChangeDb]:
    db = make_db(request.param, tmp_path, pg_url)
    try:
        yield await migrated(db, replica_version="01", owner=OWNER)
    finally:
        await drop_schema(db)
        await db.dispose()


def _tx(watermark: str, size: int) -> list[ChangeRow]:
    out = [ChangeRow(watermark, 0, '{"tag":"begin"}')]
    out += [ChangeRow(watermark, i, f'{{"tag":"insert","n":{i}}}') for i in range(1, size + 1)]
    out.append(ChangeRow(watermark, size + 1, '{"tag":"commit"}', watermark))
    return out


async def test_reads_give_what_the_service_reads(owned_db: ChangeDb) -> None:
    log = ChangeLog(owned_db)
    for n, watermark in enumerate(("02", "03", "04", "05")):
        await log.commit_rows(OWNER, _tx(watermark, n * 3), watermark)
    with open_log_reader(reader_target(owned_db.url), owned_db.shard) as reader:
        assert reader.replica_version() == "01"
        assert reader.last_watermark() == "05"
        for start, up_to in (("02", "05"), ("03", "04"), ("04", "04"), ("06", "09")):
            expected = [r async for batch in log.read(start, up_to) for r in batch]
            # Batches smaller than a transaction join up with nothing lost or repeated.
            batches = list(reader.read(start, up_to, 4))
            assert [r for batch in batches for r in batch] == expected
            assert all(0 < len(b) <= 4 for b in batches)
        with pytest.raises(ValueError, match="batch_size must be at least 1"):
            list(reader.read("02", "05", 0))


def test_a_missing_sqlite_file_is_an_error_not_a_new_database(tmp_path: Path) -> None:
    path = tmp_path / "absent-cdc.db"
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        open_log_reader(str(path), make_db("sqlite", tmp_path, "").shard)
    assert not path.exists()


async def test_a_reader_holds_nothing_and_writes_nothing(owned_db: ChangeDb) -> None:
    with open_log_reader(reader_target(owned_db.url), owned_db.shard) as reader:
        conn = reader._conn  # its one connection
        assert reader.last_watermark() == "01"
        if isinstance(conn, sqlite3.Connection):
            assert not conn.in_transaction  # no snapshot held between reads
            with pytest.raises(sqlite3.OperationalError, match="readonly"):
                conn.execute('DELETE FROM "changeLog"')
        else:
            # Autocommit: no transaction (and no lock a reset waits on) outlives a read.
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            name = conn.execute("SHOW application_name").fetchone()
            assert name == ("zero-change-streamer",)


def test_the_target_keeps_what_libpq_needs() -> None:
    url = parse_change_db_url("postgres://us%3Ar:p%40ss%2F1@127.0.0.1:5433/cdc?sslmode=verify-full")
    assert conninfo_to_dict(reader_target(url)) == {
        "user": "us:r",
        "password": "p@ss/1",
        "host": "127.0.0.1",
        "port": "5433",
        "dbname": "cdc",
        "sslmode": "verify-full",
    }


def test_a_relative_sqlite_path_becomes_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert reader_target(parse_change_db_url("data/zero_0-cdc.db")) == str(
        tmp_path / "data" / "zero_0-cdc.db"
    )
    assert reader_target(parse_change_db_url("sqlite:///data/x.db")) == str(
        tmp_path / "data" / "x.db"
    )


def test_the_follower_child_loads_no_engine() -> None:
    """What the follower imports: no SQLAlchemy, aiosqlite or Alembic (their memory is
    most of what the child cost)."""
    code = (
        "import sys, app.runtime.log_follower\n"
        "print(sorted({m.split('.')[0] for m in sys.modules}"
        " & {'sqlalchemy', 'aiosqlite', 'alembic', 'psycopg'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_the_package_names_load_lazily_and_all_of_them_resolve() -> None:
    """``app.storage``'s names are spelled in ``__all__`` and in the table that loads
    them (``_MODULES``): the two agree, and each name comes from its module."""
    import importlib

    import app.storage as storage

    assert sorted(storage.__all__) == sorted(storage._MODULES)
    for name, module in storage._MODULES.items():
        assert getattr(storage, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        storage.Nope  # type: ignore[attr-defined]  # noqa: B018
