"""The tables a custom source's initial sync must deliver (spec/source.md §4.2 item 3).

zero's sync logic reads these from the replica: the clients' last mutation IDs, the
mutations, and the permissions. A Postgres upstream gets them from the shard setup;
a custom source must send them in its initial transaction. A table counts only if
zero can sync it, i.e. it has a unique index over NOT NULL columns (the row key
:func:`~app.replica.catalog.load_tables` picks), and each required column must have
the ZQL type listed (columns being backfilled count too, as in zero).
"""

from __future__ import annotations

from collections.abc import Mapping

from app.replica.catalog import TableInfo
from app.replica.lite_types import zql_value_type

__all__ = ["missing_required_table", "required_tables"]


def required_tables(app_id: str, shard_num: int) -> dict[str, dict[str, str]]:
    """Replica table name → column → ZQL type."""
    return {
        f"{app_id}_{shard_num}.clients": {
            "clientGroupID": "string",
            "clientID": "string",
            "lastMutationID": "number",
            "userID": "string",
        },
        f"{app_id}_{shard_num}.mutations": {
            "clientGroupID": "string",
            "clientID": "string",
            "mutationID": "number",
            "mutation": "json",
        },
        f"{app_id}.permissions": {"permissions": "json", "hash": "string"},
    }


def missing_required_table(
    tables: Mapping[str, TableInfo], app_id: str, shard_num: int
) -> str | None:
    """What the replica lacks of the required tables (one line), or None."""
    syncable = {name: info for name, info in tables.items() if info.primary_key}
    for name, columns in required_tables(app_id, shard_num).items():
        info = syncable.get(name)
        if info is None:
            found = ", ".join(sorted(syncable)) or "none"
            return (
                f'the "{name}" table is missing (syncable tables found: {found}); every table '
                "needs a unique index over one or more NOT NULL columns"
            )
        for column, expected in columns.items():
            lite_type = info.columns.get(column)
            if lite_type is None:
                return f'the "{name}" table has no "{column}" column'
            actual = zql_value_type(lite_type)
            if actual != expected:
                shown = actual if actual is not None else f"{lite_type!r} (not syncable)"
                return f'column "{name}.{column}" is of type {shown}, it must be {expected}'
    return None
