"""The replica file's metadata tables: their layout, their creation, and the state reads.

The layout is zero-cache 1.9.0's replica schema **v13** (its
``change-source/common/replica-schema.ts`` migrations), so a reference zero-cache
opening a replica made here finds it current and runs no migration:

* ``"_zero.versionHistory"`` — (dataVersion, schemaVersion, minSafeVersion) = (13, 13, 1),
  what zero's setup migration records for a fresh replica;
* ``"_zero.replicationConfig"`` — replicaVersion, publications (JSON array, sorted),
  initialSyncContext (JSON object), single row;
* ``"_zero.replicationState"`` — stateVersion (the last applied commit watermark),
  writeTimeMs, single row;
* ``"_zero.changeLog2"`` — per-row last operation, for view maintenance
  (:mod:`app.replica.changelog`);
* ``"_zero.runtimeEvents"`` — ``sync`` / ``upgrade`` / ``vacuum`` timestamps;
* ``"_zero.column_metadata"``, ``"_zero.tableMetadata"`` — :mod:`app.replica.metadata`.

Connections (:func:`open_replica`) are in autocommit mode (``isolation_level=None``):
every transaction is an explicit ``BEGIN IMMEDIATE`` … ``COMMIT``. The file is in WAL
mode with ``synchronous=NORMAL``, as zero's replica (better-sqlite3 builds SQLite with
``SQLITE_DEFAULT_WAL_SYNCHRONOUS=1``): a commit survives a crash of the process, and a
power loss can only take the last transactions, which the replica then resumes from
its ``stateVersion`` (the change log still has them). An fsync per replicated
transaction cost most of the replica follower's time. And a busy timeout, as a
replica shared with readers needs.

One difference from zero: ``writeTimeMs`` is computed in Python (whole milliseconds),
because ``unixepoch('subsec')`` needs SQLite 3.42 and the stdlib module may link an
older one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from app.private_files import create_private
from app.protocol.canonical_json import dumps, loads
from app.replica.errors import ReplicaError

__all__ = [
    "SCHEMA_VERSION",
    "ReplicaState",
    "check_schema_version",
    "init_replica",
    "now_ms",
    "open_replica",
    "read_replica_state",
    "record_event",
    "set_state_version",
]

SCHEMA_VERSION: Final = 13
MIN_SAFE_VERSION: Final = 1
BUSY_TIMEOUT_MS: Final = 10_000

RuntimeEvent = Literal["sync", "upgrade", "vacuum"]

_VERSION_HISTORY: Final = """
    CREATE TABLE IF NOT EXISTS "_zero.versionHistory" (
      dataVersion INTEGER NOT NULL,
      schemaVersion INTEGER NOT NULL,
      minSafeVersion INTEGER NOT NULL,

      lock INTEGER PRIMARY KEY DEFAULT 1 CHECK (lock=1)
    );
  """

# Each statement's text is zero's, so sqlite_master reads the same for both.
_METADATA_TABLES: Final = (
    """
  CREATE TABLE "_zero.replicationConfig" (
    replicaVersion TEXT NOT NULL,
    publications TEXT NOT NULL,
    initialSyncContext TEXT DEFAULT '{}',
    lock INTEGER PRIMARY KEY DEFAULT 1 CHECK (lock=1)
  );
  """,
    """
  CREATE TABLE "_zero.replicationState" (
    stateVersion TEXT NOT NULL,
    writeTimeMs INTEGER,
    lock INTEGER PRIMARY KEY DEFAULT 1 CHECK (lock=1)
  );
  """,
    """
  CREATE TABLE "_zero.changeLog2" (
    "stateVersion"              TEXT NOT NULL,
    "pos"                       INT  NOT NULL,
    "table"                     TEXT NOT NULL,
    "rowKey"                    TEXT NOT NULL,
    "op"                        TEXT NOT NULL,
    "backfillingColumnVersions" TEXT DEFAULT '{}',
    PRIMARY KEY("stateVersion", "pos"),
    UNIQUE("table", "rowKey")
  );
  """,
    """
  CREATE TABLE "_zero.runtimeEvents" (
    event TEXT PRIMARY KEY ON CONFLICT REPLACE,
    timestamp TEXT NOT NULL DEFAULT (current_timestamp)
  );
""",
    """
  CREATE TABLE "_zero.column_metadata" (
    table_name TEXT NOT NULL,
    column_name TEXT NOT NULL,
    upstream_type TEXT NOT NULL,
    is_not_null INTEGER NOT NULL,
    is_enum INTEGER NOT NULL,
    is_array INTEGER NOT NULL,
    character_max_length INTEGER,
    backfill TEXT,
    PRIMARY KEY (table_name, column_name)
  );
""",
    """
  CREATE TABLE "_zero.tableMetadata" (
    "schema"           TEXT NOT NULL,
    "table"            TEXT NOT NULL,
    "minRowVersion"    TEXT NOT NULL DEFAULT "00",
    "upstreamMetadata" TEXT,
    "metadata"         TEXT,  -- deprecated
    PRIMARY KEY ("schema", "table")
  );
""",
)


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """Where a replica stands: the version it was synced at and the last commit applied."""

    replica_version: str
    publications: tuple[str, ...]
    state_version: str
    initial_sync_context: dict[str, Any]


def remove_replica_files(path: Path) -> None:
    """Deletes a replica file, its WAL/shared-memory companions and litestream's state.

    litestream keeps its position beside the database (``.<name>-litestream/``); left
    behind after a re-sync or restore, it would describe another database.
    """
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{path}{suffix}")
    shutil.rmtree(litestream_state_dir(path), ignore_errors=True)


def litestream_state_dir(path: Path) -> Path:
    """Where litestream keeps its local state for the database at ``path``."""
    return path.with_name(f".{path.name}-litestream")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def open_replica(
    path: str | Path, *, create: bool = False, checkpoints: bool = True
) -> sqlite3.Connection:
    """A connection to a replica file (see the module docstring for its settings).

    Without ``create`` a missing file is an error instead of a new empty database;
    with it, a new file is ``0600`` (``app.private_files``).
    ``checkpoints=False``: the connection never checkpoints the WAL (no
    ``wal_autocheckpoint``), because litestream backs the file up and owns its
    checkpoints (zero-cache sets the same on its backed-up replica). A checkpoint of
    ours that completes between two of litestream's syncs lets the next write restart
    the WAL over frames litestream has not read; litestream v0.5 then uploads a
    transaction without their pages, and a restore to it is a torn image ("row N
    missing from index").
    """
    target = Path(path)
    if create:
        create_private(target)  # it will hold every replicated row
    elif not target.exists():
        raise ReplicaError(f"replica file {str(target)!r} does not exist")
    try:
        conn = sqlite3.connect(target, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        if not checkpoints:
            conn.execute("PRAGMA wal_autocheckpoint = 0")
    except sqlite3.DatabaseError as e:
        raise ReplicaError(f"cannot open replica file {str(target)!r}: {e}") from e
    return conn


def create_stat4_table(conn: sqlite3.Connection) -> None:
    """Gives the file the ``sqlite_stat4`` table zero's query planner reads.

    zero's SQLite is built with STAT4, so ``ANALYZE`` there makes ``sqlite_stat4`` and
    the view-syncer's cost model queries it; Python's ``sqlite3`` is not, so a replica
    built here had none, and a real zero-cache view-syncer failed on it ("no such
    table: sqlite_stat4", found by ``interop/run-pg``). An empty table is valid (no
    samples); zero's next ``ANALYZE`` fills it. ``sqlite_*`` names are reserved, hence
    ``writable_schema`` for the one statement.
    """
    conn.execute("PRAGMA writable_schema = ON")
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS sqlite_stat4(tbl, idx, neq, nlt, ndlt, sample)")
    finally:
        conn.execute("PRAGMA writable_schema = OFF")


def init_replica(
    conn: sqlite3.Connection,
    replica_version: str,
    publications: Iterable[str],
    context: Mapping[str, Any] | None = None,
) -> None:
    """Creates the metadata tables of a fresh replica synced at ``replica_version``.

    Runs inside the caller's transaction if one is open (initial sync creates the
    metadata, copies the tables and commits once); otherwise in its own. Refuses a
    file that already holds a replica.
    """
    own_tx = not conn.in_transaction
    if own_tx:
        conn.execute("BEGIN IMMEDIATE")
    try:
        exists = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '_zero.replicationConfig'"
        ).fetchone()
        if exists:
            raise ReplicaError("the file already holds a replica")
        for ddl in _METADATA_TABLES:
            conn.execute(ddl)
        create_stat4_table(conn)
        conn.execute(
            'INSERT INTO "_zero.replicationConfig" '
            "(replicaVersion, publications, initialSyncContext) VALUES (?, ?, ?)",
            (replica_version, dumps(sorted(publications)), dumps(dict(context or {}))),
        )
        conn.execute(
            'INSERT INTO "_zero.replicationState" (stateVersion, writeTimeMs) VALUES (?, ?)',
            (replica_version, now_ms()),
        )
        record_event(conn, "sync")
        conn.execute(_VERSION_HISTORY)
        conn.execute(
            'INSERT INTO "_zero.versionHistory" '
            "(dataVersion, schemaVersion, minSafeVersion, lock) VALUES (?, ?, ?, 1)",
            (SCHEMA_VERSION, SCHEMA_VERSION, MIN_SAFE_VERSION),
        )
    except BaseException:
        if own_tx:
            conn.execute("ROLLBACK")
        raise
    if own_tx:
        conn.execute("COMMIT")
        # zero analyzes a freshly set-up replica; the query planner uses the stats.
        conn.execute("ANALYZE main")


def record_event(conn: sqlite3.Connection, event: RuntimeEvent) -> None:
    conn.execute('INSERT INTO "_zero.runtimeEvents" (event) VALUES (?)', (event,))


def set_state_version(conn: sqlite3.Connection, watermark: str) -> None:
    """Moves the replica to ``watermark`` (inside the applying transaction)."""
    conn.execute(
        'UPDATE "_zero.replicationState" SET stateVersion = ?, writeTimeMs = ?',
        (watermark, now_ms()),
    )


def read_replica_state(source: sqlite3.Connection | str | Path) -> ReplicaState:
    """The replica's versions and publications; :class:`ReplicaError` if it is not one."""
    if isinstance(source, sqlite3.Connection):
        return _read_state(source)
    conn = open_replica(source)
    try:
        return _read_state(conn)
    finally:
        conn.close()


def check_schema_version(conn: sqlite3.Connection) -> None:
    """Refuses a replica whose metadata layout is not the one this code writes."""
    try:
        row = conn.execute(
            'SELECT dataVersion, minSafeVersion FROM "_zero.versionHistory"'
        ).fetchone()
    except sqlite3.DatabaseError as e:
        raise ReplicaError(f"not a replica (no version history): {e}") from e
    if row is None:
        raise ReplicaError("not a replica (empty version history)")
    data_version, min_safe = row
    if min_safe > SCHEMA_VERSION:
        raise ReplicaError(
            f"the replica needs code at schema v{min_safe} or later; this is v{SCHEMA_VERSION}"
        )
    if data_version < SCHEMA_VERSION:
        raise ReplicaError(
            f"the replica is at schema v{data_version}, older than v{SCHEMA_VERSION}; re-sync it"
        )


def _read_state(conn: sqlite3.Connection) -> ReplicaState:
    try:
        row = conn.execute(
            "SELECT c.replicaVersion, c.publications, c.initialSyncContext, s.stateVersion "
            'FROM "_zero.replicationConfig" AS c '
            'JOIN "_zero.replicationState" AS s ON c.lock = s.lock'
        ).fetchone()
    except sqlite3.DatabaseError as e:
        raise ReplicaError(f"not a replica: {e}") from e
    if row is None:
        raise ReplicaError("the replica has no replication state")
    replica_version, publications, context, state_version = row
    try:
        pubs = loads(publications)
        ctx = loads(context) if context is not None else {}
    except ValueError as e:
        raise ReplicaError(f"unreadable replication config: {e}") from e
    if not isinstance(pubs, list) or not all(isinstance(p, str) for p in pubs):
        raise ReplicaError(f"publications must be a JSON array of strings, got {publications!r}")
    if not isinstance(ctx, dict):
        raise ReplicaError(f"initialSyncContext must be a JSON object, got {context!r}")
    return ReplicaState(replica_version, tuple(pubs), state_version, ctx)
