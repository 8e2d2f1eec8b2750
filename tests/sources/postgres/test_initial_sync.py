"""Initial sync against a real Postgres into a real SQLite file."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from app import progress
from app.replica.schema import read_replica_state
from app.sources.postgres import initial_sync as initial_sync_module
from app.sources.postgres.copy_load import copy_table
from app.sources.postgres.initial_sync import InitialSyncError, initial_sync
from app.sources.postgres.shard import ShardConfig
from app.sources.postgres.slots import check_replica, drop_slot

from ...waiting import eventually

DB = "cs_initsync"
APP = "csinit"


@pytest.fixture
async def upstream(pg_url: str) -> AsyncIterator[str]:
    admin = pg_url.rsplit("/", 1)[0] + "/postgres"
    url = pg_url.rsplit("/", 1)[0] + f"/{DB}"

    async def drop_all() -> None:
        async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as c:
            cur = await c.execute(
                "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE %s",
                (f"{APP}_%",),
            )
            for (slot,) in await cur.fetchall():
                await drop_slot(admin, slot)
            await c.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")

    await drop_all()
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as c:
        await c.execute(f"CREATE DATABASE {DB}")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
        await c.execute(
            "CREATE TABLE items (id int8 PRIMARY KEY, name text NOT NULL, price float8, "
            "tags text[], meta jsonb, flag bool, at timestamptz, day date)"
        )
        await c.execute(
            "INSERT INTO items SELECT i, 'item ' || i, i * 1.5, ARRAY['a', NULL], "
            "jsonb_build_object('i', i), i % 2 = 0, '2024-01-02 03:04:05.5+00', '1969-07-20' "
            "FROM generate_series(1, 2500) i"
        )
        await c.execute(
            "INSERT INTO items (id, name, price) VALUES (9007199254740993, 'big', 'NaN')"
        )
        await c.execute("CREATE TABLE notes (k text NOT NULL, body text)")
        await c.execute("CREATE UNIQUE INDEX notes_k ON notes (k)")
        await c.execute("INSERT INTO notes VALUES ('tab\there', 'line\nbreak'), ('q', NULL)")
    yield url
    await drop_all()


async def test_sync_copies_every_row_at_the_slot_snapshot(upstream: str, tmp_path: Path) -> None:
    replica = tmp_path / "replica.db"
    result = await initial_sync(upstream, ShardConfig(app_id=APP), replica)

    # items, notes, and the shard's metadata tables (permissions has its one row).
    assert result.rows == 2501 + 2 + 1
    state = read_replica_state(replica)
    assert state.replica_version == result.replica_version == state.state_version
    assert list(state.publications) == list(result.publications)
    async with await psycopg.AsyncConnection.connect(upstream, autocommit=True) as c:
        # The replicas row is marked synced and its slot is healthy: a restart can stream.
        row = await check_replica(c, ShardConfig(app_id=APP), result.replica_version)
        assert row.slot == result.slot
        assert row.initial_schema is not None
        tables = sorted((t["schema"], t["name"]) for t in row.initial_schema["tables"])
        assert tables == [
            (APP, "permissions"),
            (f"{APP}_0", "clients"),
            (f"{APP}_0", "mutations"),
            ("public", "items"),
            ("public", "notes"),
        ]
    conn = sqlite3.connect(replica)
    try:
        rows = conn.execute(
            "SELECT id, name, price, tags, meta, flag, at, day, _0_version FROM items "
            "WHERE id IN (2, 9007199254740993) ORDER BY id"
        ).fetchall()
        assert rows[0] == (
            2,
            "item 2",
            3,
            '["a",null]',
            '{"i": 2}',
            1,
            1704164645500,
            -14256000000,
            result.replica_version,
        )
        assert rows[1][:3] == (9007199254740993, "big", "NaN")
        assert conn.execute("SELECT count(*) FROM items").fetchone() == (2501,)
        assert conn.execute("SELECT k, body FROM notes ORDER BY k").fetchall() == [
            ("q", None),
            ("tab\there", "line\nbreak"),
        ]
        indexes = {r[1] for r in conn.execute("PRAGMA index_list('notes')")}
        assert "notes_k" in indexes
    finally:
        conn.close()
    assert not (tmp_path / "replica.db.syncing").exists()


async def test_a_failed_sync_drops_its_slot_and_leaves_no_replica(
    upstream: str, tmp_path: Path
) -> None:
    replica = tmp_path / "missing-dir" / "replica.db"  # SQLite cannot create it
    with pytest.raises(InitialSyncError, match="initial sync failed"):
        await initial_sync(upstream, ShardConfig(app_id=APP), replica)
    assert not replica.exists()
    async with await psycopg.AsyncConnection.connect(upstream) as c:
        cur = await c.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE %s", (f"{APP}_%",)
        )
        assert await cur.fetchone() == (0,)


async def test_a_long_table_copy_reports_its_progress(
    upstream: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Progress shows after 0 s and every 20 ms here, and the copy of items waits (in
    # its worker thread, before its first row) until the test has seen its progress
    # line: a "long" copy whatever the machine's speed.
    monkeypatch.setattr(progress, "AFTER_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.02)
    caplog.set_level(logging.INFO, logger="app.progress")
    seen = threading.Event()

    def held_copy_table(conn: Any, query: bytes, *args: Any, **kwargs: Any) -> None:
        if b'"items"' in query:
            assert seen.wait(30), "no progress line for items"
        copy_table(conn, query, *args, **kwargs)

    monkeypatch.setattr(initial_sync_module, "copy_table", held_copy_table)

    def items_line() -> logging.LogRecord | None:
        for r in caplog.records:
            if r.getMessage().startswith("initial sync of items: 0"):
                return r
        return None

    async with await psycopg.AsyncConnection.connect(upstream, autocommit=True) as c:
        await c.execute("ANALYZE items")
    sync = asyncio.create_task(initial_sync(upstream, ShardConfig(app_id=APP), tmp_path / "r.db"))
    record = await eventually(lambda: sync.done() or items_line(), "the progress line of items")
    seen.set()
    assert isinstance(record, logging.LogRecord), sync  # not the sync ending first
    result = await asyncio.wait_for(sync, 60)
    assert result.rows == 2501 + 2 + 1
    fields = record.__dict__["log_fields"]["progress"]  # app.logs puts extra fields there
    assert fields["job"] == "initial sync of items"
    assert fields["unit"] == "rows"
    assert fields["done"] == 0
    assert fields["total"] == 2501  # the planner's estimate: exact for an analyzed small table
