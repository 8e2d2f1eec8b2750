"""Replica files and litestream options for the backup tests (real litestream, real files)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from app.backup.config import LitestreamOptions, find_executable
from app.replica.schema import init_replica, open_replica, set_state_version

REPLICA_VERSION = "0a"


def new_replica(path: Path, version: str = REPLICA_VERSION, rows: int = 100) -> Path:
    conn = open_replica(path, create=True)
    try:
        init_replica(conn, version, ["zero_data"], {"test": True})
        conn.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, title TEXT)")
        conn.executemany("INSERT INTO items VALUES (?, ?)", [(i, f"item {i}") for i in range(rows)])
    finally:
        conn.close()
    return path


def advance(path: Path, watermark: str, rows: int = 10) -> None:
    """One replica transaction: some rows and a new stateVersion."""
    conn = open_replica(path)
    try:
        conn.execute("BEGIN")
        start = conn.execute("SELECT coalesce(max(id), -1) + 1 FROM items").fetchone()[0]
        conn.executemany(
            "INSERT INTO items VALUES (?, ?)",
            [(start + i, f"row {start + i}") for i in range(rows)],
        )
        set_state_version(conn, watermark)
        conn.execute("COMMIT")
    finally:
        conn.close()


def item_count(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("SELECT count(*) FROM items").fetchone()[0])
    finally:
        conn.close()


@pytest.fixture
def litestream_options(tmp_path: Path, unused_tcp_port: int) -> LitestreamOptions:
    replica = new_replica(tmp_path / "replica.db")
    return LitestreamOptions(
        executable=find_executable(None),
        replica_file=replica,
        backup_url=f"file://{tmp_path / 'backup'}",
        port=unused_tcp_port,
        incremental_backup_interval_minutes=0.005,  # 0.3 s: the tests wait on uploads
        log_level="info",
    )
