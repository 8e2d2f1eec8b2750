"""ReplicaWriter: every change kind applied to a real replica file, row by row."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from app.replica.errors import ReplicaError, UnsupportedColumnDefaultError
from app.replica.schema import read_replica_state
from app.replica.writer import ReplicaWriter
from tests import sqlite_memory

from .conftest import (
    apply_tx,
    column,
    create_index,
    create_table,
    delete,
    insert,
    relation,
    rows,
    snapshot,
    update,
)

CHANGE_LOG = 'SELECT stateVersion, pos, "table", rowKey, op FROM "_zero.changeLog2" ORDER BY 1, 2'


def table_info(path: Path, table: str) -> list[tuple[Any, ...]]:
    return rows(path, 'SELECT name, type, "notnull", dflt_value FROM pragma_table_info(?)', table)


def indexes(path: Path, table: str) -> list[tuple[Any, ...]]:
    return rows(
        path,
        'SELECT il.name, il."unique", group_concat(ii.name) FROM pragma_index_list(?) il '
        "JOIN pragma_index_info(il.name) ii GROUP BY il.name ORDER BY il.name",
        table,
    )


def foo_rows(path: Path, table: str = "foo") -> list[tuple[Any, ...]]:
    return rows(path, f'SELECT * FROM "{table}" ORDER BY 1')


@pytest.fixture
def with_foo(writer: ReplicaWriter, replica: Path) -> ReplicaWriter:
    apply_tx(writer, "02", create_table(), create_index())
    return writer


# -- create-table / create-index -------------------------------------------------


def test_create_table_writes_the_table_its_metadata_and_a_reset(
    writer: ReplicaWriter, replica: Path
) -> None:
    apply_tx(
        writer,
        "02",
        create_table(
            id=column(1, "int8", notNull=True),
            tags=column(2, "text[]", elemPgTypeClass="b"),
            mood=column(3, "mood", pgTypeClass="e"),
            label=column(4, "varchar", characterMaximumLength=20, dflt="'x'::text"),
        ),
    )
    assert table_info(replica, "foo") == [
        ("id", "int8|NOT_NULL", 0, None),
        ("tags", "text[]|TEXT_ARRAY", 0, None),
        ("mood", "mood|TEXT_ENUM", 0, None),
        ("label", "varchar", 0, None),  # defaults are ignored for new tables
        ("_0_version", "TEXT", 0, None),
    ]
    assert rows(replica, 'SELECT * FROM "_zero.column_metadata" ORDER BY column_name') == [
        ("foo", "id", "int8", 1, 0, 0, None, None),
        ("foo", "label", "varchar", 0, 0, 0, 20, None),
        ("foo", "mood", "mood", 0, 1, 0, None, None),
        ("foo", "tags", "text[]", 0, 0, 1, None, None),
    ]
    assert rows(replica, 'SELECT * FROM "_zero.tableMetadata"') == [
        ("public", "foo", "00", '{"rowKey":{"columns":["id"]}}', None)
    ]
    assert rows(replica, CHANGE_LOG) == [("02", -1, "foo", "02", "r")]
    assert read_replica_state(replica).state_version == "02"


def test_tables_outside_public_are_named_schema_dot_name(
    writer: ReplicaWriter, replica: Path
) -> None:
    table = create_table()
    table["spec"]["schema"] = "app"
    index = create_index()
    index["spec"]["schema"] = "app"
    rel = {**relation(), "schema": "app"}
    apply_tx(writer, "02", table, index, {"tag": "insert", "relation": rel, "new": {"id": 1}})
    assert foo_rows(replica, "app.foo") == [(1, None, "02")]
    assert indexes(replica, "app.foo") == [("app.foo_pkey", 1, "id")]


def test_create_and_drop_index(with_foo: ReplicaWriter, replica: Path) -> None:
    apply_tx(with_foo, "03", create_index(name="foo_name", columns=("name", "id"), unique=False))
    assert indexes(replica, "foo") == [("foo_name", 0, "name,id"), ("foo_pkey", 1, "id")]
    assert rows(replica, CHANGE_LOG)[-1] == ("03", -1, "foo", "03", "r")
    apply_tx(with_foo, "04", {"tag": "drop-index", "id": {"schema": "public", "name": "foo_name"}})
    assert indexes(replica, "foo") == [("foo_pkey", 1, "id")]


# -- data changes ------------------------------------------------------------------------


def test_insert_update_delete_set_rows_versions_and_the_change_log(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    apply_tx(with_foo, "03", insert({"id": 1, "name": "a"}), insert({"id": 2, "name": "b"}))
    assert foo_rows(replica) == [(1, "a", "03"), (2, "b", "03")]
    apply_tx(with_foo, "04", update({"id": 1, "name": "A"}), delete({"id": 2}))
    assert foo_rows(replica) == [(1, "A", "04")]
    assert rows(replica, CHANGE_LOG) == [
        ("02", -1, "foo", "02", "r"),
        ("04", 0, "foo", '{"id":1}', "s"),
        ("04", 1, "foo", '{"id":2}', "d"),
    ]
    assert read_replica_state(replica).state_version == "04"


def test_an_insert_of_an_existing_key_replaces_the_row(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    apply_tx(with_foo, "03", insert({"id": 1, "name": "a"}))
    apply_tx(with_foo, "04", insert({"id": 1}))
    assert foo_rows(replica) == [(1, None, "04")]


def test_an_update_with_a_key_change_moves_the_row(with_foo: ReplicaWriter, replica: Path) -> None:
    apply_tx(with_foo, "03", insert({"id": 1, "name": "a"}))
    apply_tx(with_foo, "04", update({"id": 5, "name": "a"}, key={"id": 1}))
    assert foo_rows(replica) == [(5, "a", "04")]
    assert rows(replica, CHANGE_LOG)[-2:] == [
        ("04", 0, "foo", '{"id":1}', "d"),
        ("04", 1, "foo", '{"id":5}', "s"),
    ]


def test_a_partial_update_keeps_the_columns_it_leaves_out(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    apply_tx(with_foo, "03", insert({"id": 1, "name": "toasted"}))
    apply_tx(with_foo, "04", update({"id": 1}))  # unchanged TOAST column omitted
    assert foo_rows(replica) == [(1, "toasted", "04")]


def test_an_update_of_a_missing_row_falls_back_to_an_upsert(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    apply_tx(with_foo, "03", update({"id": 7, "name": "new"}, key={"id": 6}))
    assert foo_rows(replica) == [(7, "new", "03")]


def test_a_keyless_insert_is_written_but_not_logged(with_foo: ReplicaWriter, replica: Path) -> None:
    apply_tx(with_foo, "03", insert({"id": 1}, columns=()))
    assert foo_rows(replica) == [(1, None, "03")]
    assert [r[4] for r in rows(replica, CHANGE_LOG)] == ["r"]


def test_full_identity_uses_the_unique_index_as_key(with_foo: ReplicaWriter, replica: Path) -> None:
    full = {
        **relation(columns=("id", "name")),
        "rowKey": {"columns": ["id", "name"], "type": "full"},
    }
    apply_tx(
        with_foo,
        "03",
        {"tag": "insert", "relation": full, "new": {"id": 1, "name": "a"}},
        {"tag": "delete", "relation": full, "key": {"id": 1, "name": "a"}},
        {"tag": "insert", "relation": full, "new": {"id": 2, "name": "b"}},
    )
    assert foo_rows(replica) == [(2, "b", "03")]
    assert rows(replica, CHANGE_LOG)[1:] == [
        ("03", 1, "foo", '{"id":1}', "d"),
        ("03", 2, "foo", '{"id":2}', "s"),
    ]


def test_truncate_empties_the_tables_and_logs_it(with_foo: ReplicaWriter, replica: Path) -> None:
    apply_tx(with_foo, "03", insert({"id": 1}), insert({"id": 2}))
    apply_tx(with_foo, "04", {"tag": "truncate", "relations": [relation()]})
    assert foo_rows(replica) == []
    assert rows(replica, CHANGE_LOG)[-1] == ("04", -1, "foo", "04", "t")


def test_values_are_converted_per_column_type(writer: ReplicaWriter, replica: Path) -> None:
    apply_tx(
        writer,
        "02",
        create_table(
            id=column(0, "int8", notNull=True),
            ok=column(1, "bool"),
            doc=column(2, "jsonb"),
            nums=column(3, "int4[]", elemPgTypeClass="b"),
            f=column(4, "float8"),
            ts=column(5, "timestamptz"),
        ),
        create_index(),
    )
    apply_tx(
        writer,
        "03",
        insert(
            {
                "id": 2**62,
                "ok": True,
                "doc": '{"a": [1]}',
                "nums": [1, None],
                "f": "NaN",
                "ts": "infinity",
            }
        ),
        json="s",
    )
    apply_tx(writer, "04", insert({"id": 1, "ok": False, "doc": {"a": 1}, "f": 1.5, "ts": 1.25}))
    assert rows(replica, "SELECT id, ok, doc, nums, f, typeof(f), ts FROM foo ORDER BY id") == [
        (1, 0, '{"a":1}', None, 1.5, "real", 1.25),
        (2**62, 1, '{"a": [1]}', "[1,null]", "NaN", "text", "infinity"),
    ]


# -- schema changes --------------------------------------------------------------------


def test_rename_table_moves_data_metadata_and_bumps_versions(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    apply_tx(with_foo, "03", insert({"id": 1}))
    apply_tx(
        with_foo,
        "04",
        {
            "tag": "rename-table",
            "old": {"schema": "public", "name": "foo"},
            "new": {"schema": "public", "name": "bar"},
        },
        insert({"id": 2}, table="bar"),
    )
    assert foo_rows(replica, "bar") == [(1, None, "03"), (2, None, "04")]
    assert rows(replica, 'SELECT DISTINCT table_name FROM "_zero.column_metadata"') == [("bar",)]
    assert rows(replica, 'SELECT "table", minRowVersion FROM "_zero.tableMetadata"') == [
        ("bar", "04")
    ]
    assert indexes(replica, "bar") == [("foo_pkey", 1, "id")]


def test_add_column_with_a_default_fills_existing_rows(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    apply_tx(with_foo, "03", insert({"id": 1}))
    apply_tx(
        with_foo,
        "04",
        {
            "tag": "add-column",
            "table": {"schema": "public", "name": "foo"},
            "column": {"name": "n", "spec": column(3, "int4", dflt="7", notNull=True)},
            "tableMetadata": {"rowKey": {"columns": ["id"]}, "v": 2},
        },
        insert({"id": 2, "n": 8}),
    )
    assert table_info(replica, "foo")[-1] == ("n", "int4|NOT_NULL", 0, "7")
    assert foo_rows(replica) == [(1, None, "03", 7), (2, None, "04", 8)]
    assert rows(replica, 'SELECT minRowVersion, upstreamMetadata FROM "_zero.tableMetadata"') == [
        ("04", '{"rowKey":{"columns":["id"]},"v":2}')
    ]
    assert rows(replica, CHANGE_LOG)[-2][1:] == (-1, "foo", "04", "r")


def test_add_column_with_an_unsupported_default_rolls_back(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    before = snapshot(replica)
    with_foo.begin("03", {"tag": "begin"})
    with_foo.apply(insert({"id": 1}))
    with pytest.raises(UnsupportedColumnDefaultError, match=r"foo\.at: now\(\)"):
        with_foo.apply(
            {
                "tag": "add-column",
                "table": {"schema": "public", "name": "foo"},
                "column": {"name": "at", "spec": column(3, "timestamptz", dflt="now()")},
            }
        )
    assert not with_foo.in_transaction
    assert snapshot(replica) == before


def add_column(name: str, dflt: str) -> dict[str, Any]:
    return {
        "tag": "add-column",
        "table": {"schema": "public", "name": "foo"},
        "column": {"name": name, "spec": column(3, "text", dflt=dflt)},
    }


@pytest.mark.parametrize(
    "dflt",
    [
        # zero's pattern takes these for one quoted string with a cast (issue 25).
        "'x' CHECK (0) COLLATE 'binary'::text",  # every later insert into foo would fail
        "'x'; DROP TABLE foo; SELECT 'y'::text",  # zero-cache runs DDL with exec()
        "'x' REFERENCES 'bar'::text",
        "1); DROP TABLE foo; --",
    ],
)
@pytest.mark.parametrize("rows_before", [0, 1])
def test_an_injected_default_is_refused_and_the_tables_are_untouched(
    with_foo: ReplicaWriter, replica: Path, dflt: str, rows_before: int
) -> None:
    if rows_before:
        apply_tx(with_foo, "03", insert({"id": 1}))
    before = snapshot(replica)
    with_foo.begin("04", {"tag": "begin"})
    with pytest.raises(
        UnsupportedColumnDefaultError, match=r"^Unsupported default value for foo\.c: "
    ):
        with_foo.apply(add_column("c", dflt))
    assert not with_foo.in_transaction
    assert snapshot(replica) == before
    apply_tx(with_foo, "05", insert({"id": 2}))  # foo takes rows as before
    assert [row[0] for row in foo_rows(replica)] == [*([1] if rows_before else []), 2]
    assert [name for name, *_ in table_info(replica, "foo")] == ["id", "name", "_0_version"]


def test_a_quoted_string_default_with_a_cast_still_fills_existing_rows(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    apply_tx(with_foo, "03", insert({"id": 1}))
    apply_tx(with_foo, "04", add_column("c", "'x'::text"), add_column("d", "'it''s; --'::text"))
    assert table_info(replica, "foo")[-2:] == [
        ("c", "TEXT", 0, "'x'"),
        ("d", "TEXT", 0, "'it''s; --'"),
    ]
    assert foo_rows(replica) == [(1, None, "03", "x", "it's; --")]


def test_update_column_renames(with_foo: ReplicaWriter, replica: Path) -> None:
    apply_tx(with_foo, "03", insert({"id": 1, "name": "a"}))
    apply_tx(
        with_foo,
        "04",
        {
            "tag": "update-column",
            "table": {"schema": "public", "name": "foo"},
            "old": {"name": "name", "spec": column(1, "text")},
            "new": {"name": "title", "spec": column(1, "text")},
        },
    )
    assert [c[0] for c in table_info(replica, "foo")] == ["id", "title", "_0_version"]
    assert foo_rows(replica) == [(1, "a", "03")]
    assert rows(replica, 'SELECT column_name FROM "_zero.column_metadata" ORDER BY 1') == [
        ("id",),
        ("title",),
    ]
    assert rows(replica, 'SELECT minRowVersion FROM "_zero.tableMetadata"') == [("04",)]


def test_update_column_type_change_rebuilds_the_table_with_its_data_and_indexes(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    apply_tx(
        with_foo,
        "03",
        create_index(name="foo_name", columns=("name",), unique=False),
        insert({"id": 1, "name": "12"}),
    )
    apply_tx(
        with_foo,
        "04",
        {
            "tag": "update-column",
            "table": {"schema": "public", "name": "foo"},
            "old": {"name": "name", "spec": column(1, "text")},
            "new": {"name": "num", "spec": column(1, "int8", notNull=True)},
        },
    )
    assert table_info(replica, "foo") == [
        ("id", "int8|NOT_NULL", 0, None),
        ("num", "int8|NOT_NULL", 0, None),
        ("_0_version", "TEXT", 0, None),
    ]
    assert foo_rows(replica) == [(1, 12, "03")]
    assert indexes(replica, "foo") == [("foo_name", 0, "num"), ("foo_pkey", 1, "id")]
    assert rows(
        replica,
        'SELECT upstream_type, is_not_null FROM "_zero.column_metadata" WHERE column_name = ?',
        "num",
    ) == [("int8", 1)]
    assert not rows(replica, "SELECT name FROM sqlite_master WHERE name LIKE 'tmp.%'")


def test_update_column_of_metadata_only_leaves_rows_and_versions(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    apply_tx(
        with_foo,
        "03",
        {
            "tag": "update-column",
            "table": {"schema": "public", "name": "foo"},
            "old": {"name": "name", "spec": column(1, "varchar", characterMaximumLength=5)},
            "new": {
                "name": "name",
                "spec": column(1, "varchar", characterMaximumLength=9, dflt="now()"),
            },
        },
    )
    assert rows(
        replica,
        'SELECT character_max_length FROM "_zero.column_metadata" WHERE column_name = ?',
        "name",
    ) == [(9,)]
    assert rows(replica, 'SELECT minRowVersion FROM "_zero.tableMetadata"') == [("00",)]
    assert [r[4] for r in rows(replica, CHANGE_LOG)] == ["r"]


def test_drop_column(with_foo: ReplicaWriter, replica: Path) -> None:
    apply_tx(with_foo, "03", insert({"id": 1, "name": "a"}))
    apply_tx(
        with_foo,
        "04",
        {"tag": "drop-column", "table": {"schema": "public", "name": "foo"}, "column": "name"},
    )
    assert foo_rows(replica) == [(1, "03")]
    assert rows(replica, 'SELECT column_name FROM "_zero.column_metadata"') == [("id",)]


def test_drop_table(with_foo: ReplicaWriter, replica: Path) -> None:
    apply_tx(with_foo, "03", {"tag": "drop-table", "id": {"schema": "public", "name": "foo"}})
    assert not rows(replica, "SELECT name FROM sqlite_master WHERE tbl_name = 'foo'")
    assert rows(replica, 'SELECT * FROM "_zero.column_metadata"') == []
    assert rows(replica, 'SELECT * FROM "_zero.tableMetadata"') == []
    assert rows(replica, CHANGE_LOG)[-1] == ("03", -1, "foo", "03", "r")


def test_update_table_metadata(with_foo: ReplicaWriter, replica: Path) -> None:
    apply_tx(
        with_foo,
        "03",
        {
            "tag": "update-table-metadata",
            "table": {"schema": "public", "name": "foo"},
            "old": {"rowKey": {"columns": ["id"]}},
            "new": {"rowKey": {"columns": ["name"]}},
        },
    )
    assert rows(replica, 'SELECT upstreamMetadata FROM "_zero.tableMetadata"') == [
        ('{"rowKey":{"columns":["name"]}}',)
    ]


# -- backfill -------------------------------------------------------------------------------


def test_backfill_fills_a_column_and_completion_bumps_versions(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    apply_tx(with_foo, "03", insert({"id": 1}), insert({"id": 2}))
    apply_tx(
        with_foo,
        "04",
        {
            "tag": "add-column",
            "table": {"schema": "public", "name": "foo"},
            "column": {"name": "b", "spec": column(3, "text")},
            "backfill": {"attNum": 3},
        },
        update({"id": 2, "b": "live"}),  # replicated after the backfill's snapshot
    )
    assert rows(
        replica, 'SELECT backfill FROM "_zero.column_metadata" WHERE column_name = ?', "b"
    ) == [('{"attNum":3}',)]
    bf_rel = relation()
    apply_tx(
        with_foo,
        "04.01",
        {
            "tag": "backfill",
            "relation": bf_rel,
            "columns": ["b"],
            "watermark": "03",
            "rowValues": [[1, "old1"], [2, "old2"], [3, "new3"]],
        },
        {"tag": "backfill-completed", "relation": bf_rel, "columns": ["b"], "watermark": "03"},
        json="s",
    )
    assert foo_rows(replica) == [
        (1, None, "03", "old1"),
        (2, None, "04", "live"),
        (3, None, "03", "new3"),
    ]
    assert rows(
        replica, 'SELECT backfill FROM "_zero.column_metadata" WHERE column_name = ?', "b"
    ) == [(None,)]
    assert rows(replica, 'SELECT minRowVersion FROM "_zero.tableMetadata"') == [("04.01",)]
    assert read_replica_state(replica).state_version == "04.01"


# -- transactions, errors, resumption -------------------------------------------------


def test_abort_leaves_nothing(with_foo: ReplicaWriter, replica: Path) -> None:
    before = snapshot(replica)
    with_foo.begin("03", {"tag": "begin"})
    with_foo.apply(insert({"id": 1}))
    with_foo.apply(create_table("bar"))
    with_foo.abort()
    assert snapshot(replica) == before
    apply_tx(with_foo, "03", insert({"id": 9}))  # the same transaction, resent whole
    assert foo_rows(replica) == [(9, None, "03")]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (insert({"id": 1}, table="nope"), "unknown table 'nope'"),
        (insert({"id": 1, "zzz": 2}), "unknown column 'zzz'"),
        ({"tag": "explode"}, "unknown change: 'explode'"),
        ({"tag": "insert", "relation": relation()}, "'new' must be an object"),
        ({"tag": "delete", "relation": {"schema": "public"}, "key": {}}, "'name' must be a string"),
        (update({"name": "x"}), "lacks key column 'id'"),
        (
            create_table(),
            "cannot apply 'create-table' at 04: OperationalError: table \"foo\" already exists",
        ),
        (
            {"tag": "create-index", "spec": {**create_index()["spec"], "tableName": "nope"}},
            "unknown table 'nope'",
        ),
    ],
)
def test_an_error_mid_transaction_leaves_the_file_unchanged(
    with_foo: ReplicaWriter, replica: Path, change: dict[str, Any], message: str
) -> None:
    apply_tx(with_foo, "03", insert({"id": 5}))
    before = snapshot(replica)
    with_foo.begin("04", {"tag": "begin"})
    with_foo.apply(insert({"id": 6}))
    with_foo.apply(update({"id": 5, "name": "changed"}))
    with pytest.raises(ReplicaError, match=re.escape(message)):
        with_foo.apply(change)
    assert not with_foo.in_transaction
    assert snapshot(replica) == before
    assert with_foo.state_version == "03"


def test_commit_must_match_begin(with_foo: ReplicaWriter, replica: Path) -> None:
    with_foo.begin("03", {"tag": "begin"})
    with_foo.apply(insert({"id": 1}))
    with pytest.raises(ReplicaError, match="'commit' version 04 does not match 'begin' version 03"):
        with_foo.commit("04")
    assert foo_rows(replica) == []
    assert read_replica_state(replica).state_version == "02"


def test_transaction_framing_is_enforced(with_foo: ReplicaWriter) -> None:
    with pytest.raises(ReplicaError, match="outside a transaction"):
        with_foo.apply(insert({"id": 1}))
    with pytest.raises(ReplicaError, match="outside a transaction"):
        with_foo.commit("03")
    with pytest.raises(ReplicaError, match="not after the replica's state version 02"):
        with_foo.begin("02")
    with pytest.raises(ReplicaError, match="invalid commit watermark"):
        with_foo.begin("zz")
    with pytest.raises(ReplicaError, match='"json" must be'):
        with_foo.begin("03", {"tag": "begin", "json": "x"})
    with_foo.begin("03")
    with pytest.raises(ReplicaError, match="while transaction 03 is open"):
        with_foo.begin("04")


def test_reopening_resumes_at_the_last_commit(with_foo: ReplicaWriter, replica: Path) -> None:
    apply_tx(with_foo, "03", insert({"id": 1}))
    with_foo.begin("04")
    with_foo.apply(insert({"id": 2}))
    with_foo.close()  # an open transaction is rolled back
    reopened = ReplicaWriter(replica)
    try:
        assert (reopened.replica_version, reopened.state_version) == ("01", "03")
        apply_tx(reopened, "04", insert({"id": 3}))
        assert foo_rows(replica) == [(1, None, "03"), (3, None, "04")]
    finally:
        reopened.close()


def test_backup_mode_logs_no_row_operations(replica: Path) -> None:
    writer = ReplicaWriter(replica, mode="backup")
    try:
        apply_tx(writer, "02", create_table(), create_index(), insert({"id": 1}))
        apply_tx(writer, "03", update({"id": 1, "name": "x"}), delete({"id": 1}))
    finally:
        writer.close()
    assert rows(replica, CHANGE_LOG) == []
    assert foo_rows(replica) == []
    assert read_replica_state(replica).state_version == "03"


def test_a_large_value_does_not_stay_bound_after_its_commit(
    with_foo: ReplicaWriter, replica: Path
) -> None:
    # sqlite3 keeps a cached statement's last bindings until it runs again; after
    # a commit that bound a large value the writer reopens its connection.
    sqlite_memory.probe()
    large = "y" * (8 << 20)
    before = sqlite_memory.memory_used()
    apply_tx(with_foo, "03", insert({"id": 1, "name": large}))
    apply_tx(with_foo, "04", update({"id": 2, "name": large}, key={"id": 1}))
    assert sqlite_memory.memory_used() - before < 4 << 20  # the page cache, not the value
    apply_tx(with_foo, "05", insert({"id": 3, "name": "small"}))  # the new connection writes
    assert rows(replica, 'SELECT id, length(name), _0_version FROM "foo" ORDER BY id') == [
        (2, 8 << 20, "04"),
        (3, 5, "05"),
    ]
    assert read_replica_state(replica).state_version == "05"


def test_row_statements_stay_right_when_their_cache_starts_over(
    with_foo: ReplicaWriter, replica: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cache of two statements meets inserts, partial and full updates, key changes
    # and deletes of varying column sets: every one must still run its own SQL.
    monkeypatch.setattr("app.replica.writer.STATEMENT_CACHE", 2)
    apply_tx(with_foo, "03", insert({"id": 1, "name": "a"}), insert({"id": 2}))
    apply_tx(with_foo, "04", update({"id": 1}), update({"id": 2, "name": "b"}))
    apply_tx(with_foo, "05", update({"id": 3, "name": "c"}, key={"id": 1}), delete({"id": 2}))
    apply_tx(with_foo, "06", insert({"name": "d", "id": 4}), update({"name": "e", "id": 4}))
    assert foo_rows(replica) == [(3, "c", "05"), (4, "e", "06")]
    assert len(with_foo._statements) <= 2
