"""What a custom source's initial sync must deliver (spec/source.md §4.2 item 3)."""

from __future__ import annotations

from app.replica.catalog import TableInfo
from app.replica.required_tables import missing_required_table, required_tables


def complete() -> dict[str, TableInfo]:
    return {
        "app_2.clients": TableInfo(
            "app_2.clients",
            {
                "clientGroupID": "text|NOT_NULL",
                "clientID": "text|NOT_NULL",
                "lastMutationID": "int8",
                "userID": "varchar",
                "_0_version": "TEXT",
            },
            primary_key=["clientGroupID", "clientID"],
        ),
        "app_2.mutations": TableInfo(
            "app_2.mutations",
            {
                "clientGroupID": "text|NOT_NULL",
                "clientID": "text|NOT_NULL",
                "mutationID": "int8|NOT_NULL",
                "mutation": "json",
            },
            primary_key=["clientGroupID", "clientID", "mutationID"],
        ),
        "app.permissions": TableInfo(
            "app.permissions",
            {"lock": "bool|NOT_NULL", "permissions": "jsonb", "hash": "text"},
            primary_key=["lock"],
        ),
        "issues": TableInfo("issues", {"id": "int4|NOT_NULL"}, primary_key=["id"]),
    }


def test_the_names_follow_the_app_and_shard() -> None:
    assert list(required_tables("app", 2)) == [
        "app_2.clients",
        "app_2.mutations",
        "app.permissions",
    ]


def test_a_complete_replica_passes() -> None:
    assert missing_required_table(complete(), "app", 2) is None


def test_a_missing_table_is_named_with_what_was_found() -> None:
    tables = complete()
    del tables["app.permissions"]
    assert missing_required_table(tables, "app", 2) == (
        'the "app.permissions" table is missing (syncable tables found: app_2.clients, '
        "app_2.mutations, issues); every table needs a unique index over one or more "
        "NOT NULL columns"
    )


def test_a_table_without_a_row_key_does_not_count() -> None:
    tables = complete()
    tables["app_2.clients"].primary_key = []
    problem = missing_required_table(tables, "app", 2)
    assert problem is not None
    assert problem.startswith('the "app_2.clients" table is missing (syncable tables found: ')


def test_a_missing_column_is_named() -> None:
    tables = complete()
    del tables["app_2.mutations"].columns["mutation"]
    assert missing_required_table(tables, "app", 2) == (
        'the "app_2.mutations" table has no "mutation" column'
    )


def test_a_column_of_the_wrong_type_is_named() -> None:
    tables = complete()
    tables["app_2.clients"].columns["lastMutationID"] = "text"
    assert missing_required_table(tables, "app", 2) == (
        'column "app_2.clients.lastMutationID" is of type string, it must be number'
    )
    tables["app_2.clients"].columns["lastMutationID"] = "bytea"
    assert missing_required_table(tables, "app", 2) == (
        "column \"app_2.clients.lastMutationID\" is of type 'bytea' (not syncable), "
        "it must be number"
    )
