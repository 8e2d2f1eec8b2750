"""``"_zero.changeLog2"``: the last operation per row, ordered by state version.

A view-syncer diffs two replica snapshots by reading this table from its old version
on: ``s`` (set: insert/update), ``d`` (delete) per row key, and two table-wide
operations, ``t`` (truncate) and ``r`` (reset: any schema change). A row key is its
key columns as a JSON object with sorted keys, normalized by SQLite's ``json()``;
``(table, rowKey)`` is unique, so a newer operation on a row replaces the older one.

Table-wide operations take ``pos = -1`` and the version itself as ``rowKey`` so that
they sort first in their transaction (a reset makes the reader start over, so it
should see it before any row change). A second table-wide operation in the same
transaction therefore replaces the first (same primary key): zero's behaviour, kept,
since one reset already makes readers rebuild everything.

``backfillingColumnVersions`` records, per row, the version at which replication last
wrote each column that is being backfilled, so that older backfill data never
overwrites it (:meth:`ChangeLog.latest_row_op`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from app.protocol.canonical_json import dumps, loads
from app.replica.errors import ReplicaError

__all__ = ["DEL_OP", "RESET_OP", "SET_OP", "TRUNCATE_OP", "ChangeLog", "RowOp", "row_key_json"]

SET_OP: Final = "s"
DEL_OP: Final = "d"
TRUNCATE_OP: Final = "t"
RESET_OP: Final = "r"


@dataclass(frozen=True, slots=True)
class RowOp:
    state_version: str
    op: str
    backfilling_column_versions: dict[str, str]


def row_key_json(key: Mapping[str, Any]) -> str:
    """The row key as JSON with its columns in sorted order (zero's normalized form)."""
    if not key:
        raise ReplicaError("empty row key")
    return dumps(dict(sorted(key.items())))


class ChangeLog:
    """Writes the change log through one connection, inside its open transaction."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def log_set(
        self,
        version: str,
        pos: int,
        table: str,
        key: Mapping[str, Any],
        backfilled: Sequence[str] | None,
    ) -> None:
        """``backfilled``: None when nothing is being backfilled (clears old versions);
        otherwise the backfilling columns this write set (possibly none: keeps them)."""
        self._log_row(version, pos, table, key, SET_OP, backfilled)

    def log_delete(self, version: str, pos: int, table: str, key: Mapping[str, Any]) -> None:
        # A delete covers the whole row, which a backfill understands: versions reset.
        self._log_row(version, pos, table, key, DEL_OP, None)

    def log_truncate(self, version: str, table: str) -> None:
        self._log_table_wide(version, table, TRUNCATE_OP)

    def log_reset(self, version: str, table: str) -> None:
        self._log_table_wide(version, table, RESET_OP)

    def latest_row_op(self, table: str, key: Mapping[str, Any]) -> RowOp | None:
        row = self._conn.execute(
            'SELECT stateVersion, op, backfillingColumnVersions FROM "_zero.changeLog2" '
            'WHERE "table" = ? AND "rowKey" = JSON(?)',
            (table, row_key_json(key)),
        ).fetchone()
        if row is None:
            return None
        versions = loads(row[2]) if row[2] else {}
        return RowOp(row[0], row[1], versions if isinstance(versions, dict) else {})

    def _log_row(
        self,
        version: str,
        pos: int,
        table: str,
        key: Mapping[str, Any],
        op: str,
        backfilled: Sequence[str] | None,
    ) -> None:
        row_key = row_key_json(key)
        if backfilled is None:
            self._conn.execute(
                'INSERT OR REPLACE INTO "_zero.changeLog2" '
                '(stateVersion, pos, "table", rowKey, op) VALUES (?, ?, ?, JSON(?), ?)',
                (version, pos, table, row_key, op),
            )
            return
        versions = dumps(dict.fromkeys(backfilled, version))
        self._conn.execute(
            'INSERT INTO "_zero.changeLog2" '
            '(stateVersion, pos, "table", rowKey, op, backfillingColumnVersions) '
            "VALUES (?, ?, ?, JSON(?), ?, JSON(?)) "
            'ON CONFLICT ("table", rowKey) DO UPDATE SET stateVersion = excluded.stateVersion, '
            "pos = excluded.pos, op = excluded.op, backfillingColumnVersions = "
            "json_patch(backfillingColumnVersions, excluded.backfillingColumnVersions)",
            (version, pos, table, row_key, op, versions),
        )

    def _log_table_wide(self, version: str, table: str, op: str) -> None:
        self._conn.execute(
            'INSERT OR REPLACE INTO "_zero.changeLog2" '
            '(stateVersion, pos, "table", rowKey, op) VALUES (?, -1, ?, ?, ?)',
            (version, table, version, op),
        )
