"""The replica's metadata tables: zero's v13 layout, created once, read back."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest

from app.replica.errors import ReplicaError
from app.replica.schema import (
    SCHEMA_VERSION,
    ReplicaState,
    check_schema_version,
    init_replica,
    open_replica,
    read_replica_state,
)

from .conftest import new_replica, rows

# (name, declared type, notnull, default, pk) per column, as PRAGMA table_info lists them.
EXPECTED_COLUMNS = {
    "_zero.replicationConfig": [
        ("replicaVersion", "TEXT", 1, None, 0),
        ("publications", "TEXT", 1, None, 0),
        ("initialSyncContext", "TEXT", 0, "'{}'", 0),
        ("lock", "INTEGER", 0, "1", 1),
    ],
    "_zero.replicationState": [
        ("stateVersion", "TEXT", 1, None, 0),
        ("writeTimeMs", "INTEGER", 0, None, 0),
        ("lock", "INTEGER", 0, "1", 1),
    ],
    "_zero.changeLog2": [
        ("stateVersion", "TEXT", 1, None, 1),
        ("pos", "INT", 1, None, 2),
        ("table", "TEXT", 1, None, 0),
        ("rowKey", "TEXT", 1, None, 0),
        ("op", "TEXT", 1, None, 0),
        ("backfillingColumnVersions", "TEXT", 0, "'{}'", 0),
    ],
    "_zero.runtimeEvents": [
        ("event", "TEXT", 0, None, 1),
        ("timestamp", "TEXT", 1, "current_timestamp", 0),
    ],
    "_zero.column_metadata": [
        ("table_name", "TEXT", 1, None, 1),
        ("column_name", "TEXT", 1, None, 2),
        ("upstream_type", "TEXT", 1, None, 0),
        ("is_not_null", "INTEGER", 1, None, 0),
        ("is_enum", "INTEGER", 1, None, 0),
        ("is_array", "INTEGER", 1, None, 0),
        ("character_max_length", "INTEGER", 0, None, 0),
        ("backfill", "TEXT", 0, None, 0),
    ],
    "_zero.tableMetadata": [
        ("schema", "TEXT", 1, None, 1),
        ("table", "TEXT", 1, None, 2),
        ("minRowVersion", "TEXT", 1, '"00"', 0),
        ("upstreamMetadata", "TEXT", 0, None, 0),
        ("metadata", "TEXT", 0, None, 0),
    ],
    "_zero.versionHistory": [
        ("dataVersion", "INTEGER", 1, None, 0),
        ("schemaVersion", "INTEGER", 1, None, 0),
        ("minSafeVersion", "INTEGER", 1, None, 0),
        ("lock", "INTEGER", 0, "1", 1),
    ],
}


def test_a_new_replica_has_the_reference_metadata_tables(replica: Path) -> None:
    tables = {
        name
        for (name,) in rows(replica, "SELECT name FROM sqlite_master WHERE type = 'table'")
        if not name.startswith("sqlite_")
    }
    assert tables == set(EXPECTED_COLUMNS)
    for table, expected in EXPECTED_COLUMNS.items():
        info = rows(
            replica, 'SELECT name, type, "notnull", dflt_value, pk FROM pragma_table_info(?)', table
        )
        assert info == expected, table


def test_a_new_replica_is_at_schema_v13_with_its_config_and_state(replica: Path) -> None:
    assert rows(replica, 'SELECT * FROM "_zero.versionHistory"') == [(13, 13, 1, 1)]
    assert SCHEMA_VERSION == 13
    assert rows(replica, 'SELECT * FROM "_zero.replicationConfig"') == [
        ("01", '["zero_data"]', '{"test":true}', 1)
    ]
    [(state, write_ms, lock)] = rows(replica, 'SELECT * FROM "_zero.replicationState"')
    assert (state, lock) == ("01", 1)
    assert isinstance(write_ms, int)
    assert write_ms > 1_600_000_000_000
    assert [e for (e,) in rows(replica, 'SELECT event FROM "_zero.runtimeEvents"')] == ["sync"]
    assert rows(replica, "PRAGMA journal_mode") == [("wal",)]


def test_publications_are_stored_sorted(tmp_path: Path) -> None:
    conn = open_replica(tmp_path / "r.db", create=True)
    init_replica(conn, "0a", ["zz", "_pub", "aa"])
    conn.close()
    assert read_replica_state(tmp_path / "r.db") == ReplicaState(
        "0a", ("_pub", "aa", "zz"), "0a", {}
    )
    assert rows(tmp_path / "r.db", 'SELECT publications FROM "_zero.replicationConfig"') == [
        ('["_pub","aa","zz"]',)
    ]


def test_read_replica_state_from_a_path_or_a_connection(replica: Path) -> None:
    expected = ReplicaState("01", ("zero_data",), "01", {"test": True})
    assert read_replica_state(replica) == expected
    conn = open_replica(replica)
    try:
        assert read_replica_state(conn) == expected
    finally:
        conn.close()


def test_a_file_is_initialized_only_once(replica: Path) -> None:
    conn = open_replica(replica)
    try:
        with pytest.raises(ReplicaError, match="already holds a replica"):
            init_replica(conn, "02", [])
        assert not conn.in_transaction
    finally:
        conn.close()
    assert read_replica_state(replica).replica_version == "01"


def test_init_inside_the_callers_transaction_is_undone_by_its_rollback(tmp_path: Path) -> None:
    conn = open_replica(tmp_path / "r.db", create=True)
    conn.execute("BEGIN IMMEDIATE")
    init_replica(conn, "01", ["p"])
    assert conn.in_transaction  # the caller commits
    conn.execute("ROLLBACK")
    conn.close()
    with pytest.raises(ReplicaError, match="not a replica"):
        read_replica_state(tmp_path / "r.db")


def test_a_missing_or_foreign_file_is_not_a_replica(tmp_path: Path) -> None:
    with pytest.raises(ReplicaError, match="does not exist"):
        read_replica_state(tmp_path / "missing.db")
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(ReplicaError, match="not a replica"):
        read_replica_state(other)
    conn = open_replica(other)
    with pytest.raises(ReplicaError, match="version history"):
        check_schema_version(conn)
    conn.close()


def test_an_older_replica_schema_is_refused(tmp_path: Path) -> None:
    path = new_replica(tmp_path / "r.db")
    conn = open_replica(path)
    conn.execute('UPDATE "_zero.versionHistory" SET dataVersion = 12')
    with pytest.raises(ReplicaError, match="v12, older than v13"):
        check_schema_version(conn)
    conn.execute('UPDATE "_zero.versionHistory" SET dataVersion = 14, minSafeVersion = 14')
    with pytest.raises(ReplicaError, match="needs code at schema v14"):
        check_schema_version(conn)
    conn.execute('UPDATE "_zero.versionHistory" SET minSafeVersion = 1')
    check_schema_version(conn)  # a newer layout that still allows v13 code
    conn.close()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("usual_umask")
def test_a_new_replica_and_its_wal_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "replica.db"
    conn = open_replica(path, create=True)
    try:
        init_replica(conn, "01", ["zero_data"])
        wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
        assert (mode(path), mode(wal), mode(shm)) == (0o600, 0o600, 0o600)
    finally:
        conn.close()


@pytest.mark.usefixtures("usual_umask")
def test_a_replica_file_that_is_there_keeps_the_mode_its_operator_gave_it(tmp_path: Path) -> None:
    path = tmp_path / "replica.db"
    path.touch()
    path.chmod(0o640)
    new_replica(path)
    assert mode(path) == 0o640
