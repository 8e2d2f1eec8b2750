"""Backfill / table-metadata bookkeeping (core.md §2.5) on both databases."""

from __future__ import annotations

from typing import Any

import pytest

from app.storage import ChangeDb, ChangeLog, Replication, SubscriptionState
from app.storage.backfill import (
    CompleteBackfill,
    DropColumn,
    DropTable,
    RenameColumn,
    RenameTable,
    UpsertBackfill,
    UpsertTableMetadata,
    bookkeeping_for,
)

T = {"schema": "public", "name": "issues"}
META = {"schemaOID": 2200, "relationOID": 16384, "rowKey": {"id": {"attNum": 1}}}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"tag": "update-table-metadata", "table": T, "old": {}, "new": META},
            [UpsertTableMetadata("public", "issues", META)],
        ),
        (
            {
                "tag": "create-table",
                "spec": {"schema": "public", "name": "issues", "columns": {}},
                "metadata": META,
                "backfill": {"id": {"attNum": 1}, "title": {"attNum": 2}},
            },
            [
                UpsertTableMetadata("public", "issues", META),
                UpsertBackfill("public", "issues", "id", {"attNum": 1}),
                UpsertBackfill("public", "issues", "title", {"attNum": 2}),
            ],
        ),
        (
            {"tag": "create-table", "spec": {"schema": "public", "name": "issues", "columns": {}}},
            [],
        ),
        (
            {
                "tag": "add-column",
                "table": T,
                "column": {"name": "due", "spec": {"pos": 3, "dataType": "date"}},
                "tableMetadata": META,
                "backfill": {"attNum": 3},
            },
            [
                UpsertTableMetadata("public", "issues", META),
                UpsertBackfill("public", "issues", "due", {"attNum": 3}),
            ],
        ),
        (
            {"tag": "rename-table", "old": T, "new": {"schema": "archive", "name": "old_issues"}},
            [RenameTable("public", "issues", "archive", "old_issues")],
        ),
        (
            {
                "tag": "update-column",
                "table": T,
                "old": {"name": "a", "spec": {}},
                "new": {"name": "b", "spec": {}},
            },
            [RenameColumn("public", "issues", "a", "b")],
        ),
        (
            {
                "tag": "update-column",
                "table": T,
                "old": {"name": "a", "spec": {}},
                "new": {"name": "a", "spec": {"notNull": True}},
            },
            [],
        ),
        (
            {"tag": "drop-column", "table": T, "column": "due"},
            [DropColumn("public", "issues", "due")],
        ),
        ({"tag": "drop-table", "id": T}, [DropTable("public", "issues")]),
        (
            {
                "tag": "backfill-completed",
                "relation": {**T, "rowKey": {"columns": ["id"]}},
                "columns": ["title", "id"],
                "watermark": "0a",
            },
            [CompleteBackfill("public", "issues", ("id", "title"))],
        ),
        (
            {
                "tag": "backfill-completed",
                "relation": {**T, "rowKey": {"columns": []}},
                "columns": [],
                "watermark": "0a",
            },
            [],
        ),
        ({"tag": "create-index", "spec": {}}, []),
        ({"tag": "drop-index", "id": T}, []),
        ({"tag": "insert", "relation": T, "new": {}}, []),
    ],
    ids=lambda v: v.get("tag", "") if isinstance(v, dict) else "",
)
def test_each_schema_change_implies_its_bookkeeping(
    change: dict[str, Any], expected: list[object]
) -> None:
    assert bookkeeping_for(change) == expected


async def apply_changes(db: ChangeDb, *changes: dict[str, Any]) -> list[dict[str, Any]]:
    replication = Replication(db)
    async with ChangeLog(db).write("owner") as w:
        for change in changes:
            for op in bookkeeping_for(change):
                await w.apply(op)
    return (await replication.start_parameters()).backfill_requests


@pytest.fixture
async def owned_db(db: ChangeDb) -> ChangeDb:
    replication = Replication(db)
    await replication.ensure_config(SubscriptionState("01", (), "01"), auto_reset=False)
    await replication.assume_ownership("owner", None)
    return db


async def test_backfills_follow_renames_and_drops_until_completed(owned_db: ChangeDb) -> None:
    create = {
        "tag": "create-table",
        "spec": {"schema": "public", "name": "issues", "columns": {}},
        "metadata": META,
        "backfill": {"id": {"attNum": 1}, "title": {"attNum": 2}, "body": {"attNum": 3}},
    }
    requests = await apply_changes(owned_db, create)
    assert requests == [
        {
            "table": {"schema": "public", "name": "issues", "metadata": META},
            "columns": {"body": {"attNum": 3}, "id": {"attNum": 1}, "title": {"attNum": 2}},
        }
    ]

    requests = await apply_changes(
        owned_db,
        {
            "tag": "update-column",
            "table": T,
            "old": {"name": "title", "spec": {}},
            "new": {"name": "subject", "spec": {}},
        },
        {"tag": "drop-column", "table": T, "column": "body"},
        {"tag": "rename-table", "old": T, "new": {"schema": "archive", "name": "issues"}},
    )
    assert requests == [
        {
            "table": {"schema": "archive", "name": "issues", "metadata": META},
            "columns": {"id": {"attNum": 1}, "subject": {"attNum": 2}},
        }
    ]

    new_meta = {**META, "relationOID": 99}
    requests = await apply_changes(
        owned_db,
        {
            "tag": "update-table-metadata",
            "table": {"schema": "archive", "name": "issues"},
            "old": META,
            "new": new_meta,
        },
        {
            "tag": "backfill-completed",
            "relation": {"schema": "archive", "name": "issues", "rowKey": {"columns": ["id"]}},
            "columns": ["subject"],
            "watermark": "0b",
        },
    )
    assert requests == []


async def test_a_backfill_without_table_metadata_has_null_metadata(owned_db: ChangeDb) -> None:
    requests = await apply_changes(
        owned_db,
        {
            "tag": "add-column",
            "table": T,
            "column": {"name": "due", "spec": {"pos": 3, "dataType": "date"}},
            "backfill": {"attNum": 3},
        },
    )
    assert requests == [
        {
            "table": {"schema": "public", "name": "issues", "metadata": None},
            "columns": {"due": {"attNum": 3}},
        }
    ]


async def test_dropping_a_table_forgets_its_metadata_and_backfills(owned_db: ChangeDb) -> None:
    await apply_changes(
        owned_db,
        {
            "tag": "create-table",
            "spec": {"schema": "public", "name": "issues", "columns": {}},
            "metadata": META,
            "backfill": {"id": {"attNum": 1}},
        },
        {
            "tag": "add-column",
            "table": {"schema": "public", "name": "other"},
            "column": {"name": "x", "spec": {}},
            "backfill": {"attNum": 7},
        },
    )
    requests = await apply_changes(owned_db, {"tag": "drop-table", "id": T})
    assert [r["table"]["name"] for r in requests] == ["other"]


async def test_metadata_upsert_replaces_the_previous_value(owned_db: ChangeDb) -> None:
    newer = {**META, "relationOID": 1}
    await apply_changes(
        owned_db,
        {"tag": "update-table-metadata", "table": T, "old": {}, "new": META},
        {"tag": "update-table-metadata", "table": T, "old": META, "new": newer},
        {
            "tag": "add-column",
            "table": T,
            "column": {"name": "x", "spec": {}},
            "backfill": {"attNum": 7},
        },
    )
    requests = (await Replication(owned_db).start_parameters()).backfill_requests
    assert requests[0]["table"]["metadata"] == newer
