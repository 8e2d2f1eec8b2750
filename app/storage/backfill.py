"""Backfill and table-metadata bookkeeping (core.md §2.5).

Schema changes can leave columns waiting for a backfill. Their IDs and the
latest table metadata are kept beside the change log, written in the same
transaction as the schema change, so that after a restart the source can be
asked to resume them (``backfill_requests``).

``bookkeeping_for`` turns a schema-change object into the operations it implies;
``apply_bookkeeping`` runs one of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, delete, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from app.storage.tables import backfilling, table_metadata


@dataclass(frozen=True, slots=True)
class UpsertTableMetadata:
    schema: str
    table: str
    metadata: Any


@dataclass(frozen=True, slots=True)
class UpsertBackfill:
    schema: str
    table: str
    column: str
    backfill: Any


@dataclass(frozen=True, slots=True)
class RenameTable:
    old_schema: str
    old_table: str
    new_schema: str
    new_table: str


@dataclass(frozen=True, slots=True)
class RenameColumn:
    schema: str
    table: str
    old: str
    new: str


@dataclass(frozen=True, slots=True)
class DropColumn:
    schema: str
    table: str
    column: str


@dataclass(frozen=True, slots=True)
class DropTable:
    schema: str
    table: str


@dataclass(frozen=True, slots=True)
class CompleteBackfill:
    schema: str
    table: str
    columns: tuple[str, ...]


BookkeepingOp = (
    UpsertTableMetadata
    | UpsertBackfill
    | RenameTable
    | RenameColumn
    | DropColumn
    | DropTable
    | CompleteBackfill
)


def bookkeeping_for(change: Mapping[str, Any]) -> list[BookkeepingOp]:
    """The bookkeeping a schema-change object implies; [] for any other change."""
    tag = change.get("tag")
    if tag == "update-table-metadata":
        t = change["table"]
        return [UpsertTableMetadata(t["schema"], t["name"], change["new"])]
    if tag == "create-table":
        spec = change["spec"]
        schema, name = spec["schema"], spec["name"]
        ops: list[BookkeepingOp] = []
        if change.get("metadata") is not None:
            ops.append(UpsertTableMetadata(schema, name, change["metadata"]))
        for column, backfill_id in (change.get("backfill") or {}).items():
            ops.append(UpsertBackfill(schema, name, column, backfill_id))
        return ops
    if tag == "add-column":
        t = change["table"]
        ops = []
        if change.get("tableMetadata") is not None:
            ops.append(UpsertTableMetadata(t["schema"], t["name"], change["tableMetadata"]))
        if change.get("backfill") is not None:
            ops.append(
                UpsertBackfill(t["schema"], t["name"], change["column"]["name"], change["backfill"])
            )
        return ops
    if tag == "rename-table":
        old, new = change["old"], change["new"]
        return [RenameTable(old["schema"], old["name"], new["schema"], new["name"])]
    if tag == "update-column":
        t = change["table"]
        old_name, new_name = change["old"]["name"], change["new"]["name"]
        if old_name == new_name:
            return []
        return [RenameColumn(t["schema"], t["name"], old_name, new_name)]
    if tag == "drop-column":
        t = change["table"]
        return [DropColumn(t["schema"], t["name"], change["column"])]
    if tag == "drop-table":
        t = change["id"]
        return [DropTable(t["schema"], t["name"])]
    if tag == "backfill-completed":
        rel = change["relation"]
        key_columns = list(rel.get("rowKey", {}).get("columns", []))
        columns = tuple(dict.fromkeys([*key_columns, *change.get("columns", [])]))
        if not columns:
            return []
        return [CompleteBackfill(rel["schema"], rel["name"], columns)]
    return []


async def apply_bookkeeping(conn: AsyncConnection, op: BookkeepingOp) -> None:
    match op:
        case UpsertTableMetadata(schema, table, meta):
            await _upsert(
                conn,
                table_metadata,
                {"schema": schema, "table": table, "metadata": meta},
                keys=("schema", "table"),
            )
        case UpsertBackfill(schema, table, column, backfill_id):
            await _upsert(
                conn,
                backfilling,
                {"schema": schema, "table": table, "column": column, "backfill": backfill_id},
                keys=("schema", "table", "column"),
            )
        case RenameTable(old_schema, old_table, new_schema, new_table):
            for t in (table_metadata, backfilling):
                await conn.execute(
                    update(t)
                    .where(t.c.schema == old_schema, t.c.table == old_table)
                    .values(schema=new_schema, table=new_table)
                )
        case RenameColumn(schema, table, old, new):
            await conn.execute(
                update(backfilling)
                .where(_is_table(schema, table), backfilling.c.column == old)
                .values(column=new)
            )
        case DropColumn(schema, table, column):
            await conn.execute(
                delete(backfilling).where(_is_table(schema, table), backfilling.c.column == column)
            )
        case DropTable(schema, table):
            for t in (table_metadata, backfilling):
                await conn.execute(delete(t).where(t.c.schema == schema, t.c.table == table))
        case CompleteBackfill(schema, table, columns):
            await conn.execute(
                delete(backfilling).where(
                    _is_table(schema, table), backfilling.c.column.in_(columns)
                )
            )


def _is_table(schema: str, table: str) -> Any:
    return and_(backfilling.c.schema == schema, backfilling.c.table == table)


async def _upsert(
    conn: AsyncConnection, table: Any, values: dict[str, Any], *, keys: tuple[str, ...]
) -> None:
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    stmt = insert(table).values(**values)
    updates = {k: stmt.excluded[k] for k in values if k not in keys}
    await conn.execute(stmt.on_conflict_do_update(index_elements=list(keys), set_=updates))


async def backfill_requests(conn: AsyncConnection) -> list[dict[str, Any]]:
    """Pending backfills, one request per table, as ``startStream`` takes them.

    ``[{"table": {"schema", "name", "metadata"}, "columns": {column: backfill_id}}]``
    with ``metadata`` None when the table has none recorded.
    """
    stmt = (
        select(
            backfilling.c.schema,
            backfilling.c.table,
            backfilling.c.column,
            backfilling.c.backfill,
            table_metadata.c.metadata,
        )
        .select_from(
            backfilling.outerjoin(
                table_metadata,
                and_(
                    table_metadata.c.schema == backfilling.c.schema,
                    table_metadata.c.table == backfilling.c.table,
                ),
            )
        )
        .order_by(backfilling.c.schema, backfilling.c.table, backfilling.c.column)
    )
    requests: dict[tuple[str, str], dict[str, Any]] = {}
    for schema, table, column, backfill_id, meta in await conn.execute(stmt):
        request = requests.setdefault(
            (schema, table),
            {"table": {"schema": schema, "name": table, "metadata": meta}, "columns": {}},
        )
        request["columns"][column] = backfill_id
    return list(requests.values())
