"""DDL end to end: event triggers → schema-change messages inside the DDL's transaction → replica.

Each test runs DDL together with DML in one upstream transaction and checks that the
subscriber gets ONE begin…commit with the schema changes and the row changes in
statement order, and that the replica (``PRAGMA table_info`` / ``index_list``, rows,
``_zero.tableMetadata``) follows.

DDL that needs a backfill (a table added to a publication, a volatile default) is
streamed with backfills: tests/e2e_pg/test_backfill.py.
"""

from __future__ import annotations

from typing import Any

from app.protocol.canonical_json import loads
from tests.e2e_pg.conftest import (
    StartUpstream,
    Upstream,
    commit_watermark,
    data,
)

PUBLIC = "public"


def tags(tx: list[list[Any]]) -> list[str]:
    return [c["tag"] for c in data(tx)]


def framed(tx: list[list[Any]]) -> None:
    """One begin, data only, one commit with the begin's watermark."""
    assert tx[0][0] == "begin"
    assert tx[-1][0] == "commit"
    assert tx[-1][2]["watermark"] == tx[0][2]["commitWatermark"]
    assert all(m[0] == "data" for m in tx[1:-1])


def columns(env: Upstream, table: str) -> dict[str, tuple[str, str | None]]:
    """Replica column → (declared type, default), without ``_0_version``."""
    # PRAGMA table_info spells a declared type SQLite knows in capitals ("text" → "TEXT").
    return {
        name: (decl if "|" in decl else decl.lower(), dflt)
        for _, name, decl, _, dflt, _ in env.replica_query(f'PRAGMA table_info("{table}")')
        if name != "_0_version"
    }


def indexes(env: Upstream, table: str) -> dict[str, tuple[bool, list[tuple[str, bool]]]]:
    """Replica index → (unique, [(column, descending)])."""
    out: dict[str, tuple[bool, list[tuple[str, bool]]]] = {}
    for _, name, unique, _, _ in env.replica_query(f'PRAGMA index_list("{table}")'):
        keys = [
            (col, bool(desc))
            for _, _, col, desc, _, key in env.replica_query(f'PRAGMA index_xinfo("{name}")')
            if key
        ]
        out[name] = (bool(unique), keys)
    return out


def tables(env: Upstream) -> list[str]:
    return [
        r[0]
        for r in env.replica_query(
            "SELECT name FROM sqlite_master WHERE type = 'table' "
            "AND name NOT LIKE '%.%' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name"
        )
    ]


def upstream_metadata(env: Upstream, table: str) -> Any:
    """The replica's record of the upstream TableMetadata; None when there is none.

    Initial sync records none (as the reference): only schema changes write it.
    """
    rows = env.replica_query(
        'SELECT "upstreamMetadata" FROM "_zero.tableMetadata" WHERE "schema" = ? AND "table" = ?',
        (PUBLIC, table),
    )
    assert len(rows) <= 1, rows
    return loads(rows[0][0]) if rows and rows[0][0] is not None else None


async def test_create_table_with_rows_in_the_same_transaction(upstream: StartUpstream) -> None:
    env = await upstream()
    await env.execute(
        "CREATE TABLE foo (id int PRIMARY KEY, v text NOT NULL)",
        "INSERT INTO foo VALUES (1, 'a'), (2, 'b')",
    )
    tx = await env.next_transaction()
    framed(tx)
    assert tags(tx) == ["create-table", "create-index", "insert", "insert"]
    create, index, *_ = data(tx)
    assert create["spec"]["name"] == "foo"
    assert create["spec"]["primaryKey"] == ["id"]
    assert "backfill" not in create
    assert index["spec"]["name"] == "foo_pkey"
    await env.wait_replica(commit_watermark(tx))
    assert columns(env, "foo") == {"id": ("int4|NOT_NULL", None), "v": ("text|NOT_NULL", None)}
    assert indexes(env, "foo") == {"foo_pkey": (True, [("id", False)])}
    assert await env.replica_rows("foo", order_by="id") == [
        {"id": 1, "v": "a"},
        {"id": 2, "v": "b"},
    ]
    assert upstream_metadata(env, "foo")["rowKey"] == {"id": {"attNum": 1}}


async def test_rename_table_between_inserts(upstream: StartUpstream) -> None:
    env = await upstream(
        ["CREATE TABLE foo (id int PRIMARY KEY, v text)", "INSERT INTO foo VALUES (1, 'synced')"]
    )
    await env.execute(
        "INSERT INTO foo VALUES (2, 'before')",
        "ALTER TABLE foo RENAME TO bar",
        "INSERT INTO bar VALUES (3, 'after')",
    )
    tx = await env.next_transaction()
    framed(tx)
    assert tags(tx) == ["insert", "rename-table", "insert"]
    before, rename, after = data(tx)
    assert before["relation"]["name"] == "foo"
    assert rename["old"] == {"schema": PUBLIC, "name": "foo"}
    assert rename["new"] == {"schema": PUBLIC, "name": "bar"}
    assert after["relation"]["name"] == "bar"
    await env.wait_replica(commit_watermark(tx))
    assert "foo" not in tables(env)
    assert "bar" in tables(env)
    assert await env.replica_rows("bar", order_by="id") == [
        {"id": 1, "v": "synced"},
        {"id": 2, "v": "before"},
        {"id": 3, "v": "after"},
    ]


async def test_add_column_with_a_constant_default(upstream: StartUpstream) -> None:
    env = await upstream(["CREATE TABLE foo (id int PRIMARY KEY)", "INSERT INTO foo VALUES (1)"])
    await env.execute(
        "ALTER TABLE foo ADD COLUMN v text DEFAULT 'x'",
        "ALTER TABLE foo ADD COLUMN n int8 NOT NULL DEFAULT 7",
        "INSERT INTO foo (id) VALUES (2)",
        "INSERT INTO foo VALUES (3, 'y', 8)",
    )
    tx = await env.next_transaction()
    framed(tx)
    assert tags(tx) == ["add-column", "add-column", "insert", "insert"]
    add_v, add_n, insert2, insert3 = data(tx)
    assert add_v["column"]["name"] == "v"
    assert add_v["column"]["spec"]["dflt"] == "'x'::text"
    assert "backfill" not in add_v
    assert add_n["column"]["spec"]["notNull"] is True
    assert insert2["new"] == {"id": 2, "v": "x", "n": 7}
    assert insert3["new"] == {"id": 3, "v": "y", "n": 8}
    await env.wait_replica(commit_watermark(tx))
    assert columns(env, "foo") == {
        "id": ("int4|NOT_NULL", None),
        "v": ("text", "'x'"),
        "n": ("int8|NOT_NULL", "7"),
    }
    # The synced row gets the default, as Postgres gave it.
    assert await env.replica_rows("foo", order_by="id") == [
        {"id": 1, "v": "x", "n": 7},
        {"id": 2, "v": "x", "n": 7},
        {"id": 3, "v": "y", "n": 8},
    ]


async def test_update_column_type_and_name(upstream: StartUpstream) -> None:
    env = await upstream(
        [
            "CREATE TABLE foo (id int PRIMARY KEY, n int4, t text)",
            "CREATE INDEX foo_n ON foo (n)",
            "INSERT INTO foo VALUES (1, 10, 'a')",
        ]
    )
    await env.execute(
        "ALTER TABLE foo ALTER COLUMN n TYPE int8",
        "INSERT INTO foo VALUES (2, 9007199254740993, 'b')",
        "ALTER TABLE foo RENAME COLUMN t TO label",
        "UPDATE foo SET label = 'c' WHERE id = 1",
    )
    tx = await env.next_transaction()
    framed(tx)
    changes = data(tx)
    # The index on n survives the type change (same name, same column): nothing for it.
    assert tags(tx) == ["update-column", "insert", "update-column", "update"]
    retype, rename = changes[0], changes[2]
    assert (retype["old"]["name"], retype["old"]["spec"]["dataType"]) == ("n", "int4")
    assert (retype["new"]["name"], retype["new"]["spec"]["dataType"]) == ("n", "int8")
    assert (rename["old"]["name"], rename["new"]["name"]) == ("t", "label")
    assert changes[1]["new"] == {"id": 2, "n": 9007199254740993, "t": "b"}
    assert changes[3]["new"] == {"id": 1, "n": 10, "label": "c"}
    await env.wait_replica(commit_watermark(tx))
    assert columns(env, "foo") == {
        "id": ("int4|NOT_NULL", None),
        "n": ("int8", None),
        "label": ("text", None),
    }
    assert indexes(env, "foo") == {
        "foo_pkey": (True, [("id", False)]),
        "foo_n": (False, [("n", False)]),
    }
    assert await env.replica_rows("foo", order_by="id") == [
        {"id": 1, "n": 10, "label": "c"},
        {"id": 2, "n": 9007199254740993, "label": "b"},
    ]


async def test_drop_column(upstream: StartUpstream) -> None:
    env = await upstream(
        [
            "CREATE TABLE foo (id int PRIMARY KEY, v text, w text)",
            "INSERT INTO foo VALUES (1, 'v1', 'w1')",
        ]
    )
    await env.execute(
        "UPDATE foo SET v = 'v2' WHERE id = 1",
        "ALTER TABLE foo DROP COLUMN v",
        "INSERT INTO foo VALUES (2, 'w2')",
    )
    tx = await env.next_transaction()
    framed(tx)
    assert tags(tx) == ["update", "drop-column", "insert"]
    update, drop, insert = data(tx)
    assert update["new"] == {"id": 1, "v": "v2", "w": "w1"}
    assert drop == {"tag": "drop-column", "table": {"schema": PUBLIC, "name": "foo"}, "column": "v"}
    assert insert["new"] == {"id": 2, "w": "w2"}
    await env.wait_replica(commit_watermark(tx))
    assert columns(env, "foo") == {"id": ("int4|NOT_NULL", None), "w": ("text", None)}
    assert await env.replica_rows("foo", order_by="id") == [
        {"id": 1, "w": "w1"},
        {"id": 2, "w": "w2"},
    ]


async def test_drop_table(upstream: StartUpstream) -> None:
    env = await upstream(
        [
            "CREATE TABLE foo (id int PRIMARY KEY)",
            "CREATE TABLE keep (id int PRIMARY KEY)",
            "INSERT INTO foo VALUES (1)",
        ]
    )
    assert "foo" in tables(env)
    await env.execute("INSERT INTO foo VALUES (2)", "DROP TABLE foo", "INSERT INTO keep VALUES (1)")
    tx = await env.next_transaction()
    framed(tx)
    assert tags(tx) == ["insert", "drop-index", "drop-table", "insert"]
    assert data(tx)[1]["id"] == {"schema": PUBLIC, "name": "foo_pkey"}
    assert data(tx)[2]["id"] == {"schema": PUBLIC, "name": "foo"}
    await env.wait_replica(commit_watermark(tx))
    assert tables(env) == ["keep"]
    assert env.replica_query("SELECT name FROM sqlite_master WHERE name = 'foo_pkey'") == []
    assert env.replica_query(
        'SELECT count(*) FROM "_zero.tableMetadata" WHERE "table" = \'foo\''
    ) == [(0,)]
    assert await env.replica_rows("keep") == [{"id": 1}]


async def test_create_and_drop_index(upstream: StartUpstream) -> None:
    env = await upstream(
        [
            "CREATE TABLE foo (id int PRIMARY KEY, a int, b int)",
            "INSERT INTO foo VALUES (1, 1, 1)",
        ]
    )
    await env.execute(
        "INSERT INTO foo VALUES (2, 2, 2)",
        "CREATE UNIQUE INDEX foo_ba ON foo (b DESC, a)",
        "CREATE INDEX foo_a ON foo (a)",
    )
    tx = await env.next_transaction()
    framed(tx)
    assert tags(tx) == ["insert", "create-index", "create-index"]
    created = data(tx)[1]["spec"]
    assert created["columns"] == {"b": "DESC", "a": "ASC"}
    assert created["unique"] is True
    await env.wait_replica(commit_watermark(tx))
    assert indexes(env, "foo") == {
        "foo_pkey": (True, [("id", False)]),
        "foo_ba": (True, [("b", True), ("a", False)]),
        "foo_a": (False, [("a", False)]),
    }

    await env.execute("DROP INDEX foo_ba", "INSERT INTO foo VALUES (3, 1, 1)")
    tx = await env.next_transaction()
    framed(tx)
    assert tags(tx) == ["drop-index", "insert"]
    assert data(tx)[0]["id"] == {"schema": PUBLIC, "name": "foo_ba"}
    await env.wait_replica(commit_watermark(tx))
    assert set(indexes(env, "foo")) == {"foo_pkey", "foo_a"}
    assert len(await env.replica_rows("foo")) == 3


async def test_replica_identity_change_updates_the_table_metadata(
    upstream: StartUpstream,
) -> None:
    env = await upstream(
        [
            "CREATE TABLE foo (id int PRIMARY KEY, code text NOT NULL, v text)",
            "CREATE UNIQUE INDEX foo_code ON foo (code)",
            "INSERT INTO foo VALUES (1, 'one', 'a')",
        ]
    )
    assert upstream_metadata(env, "foo") is None
    await env.execute(
        "ALTER TABLE foo REPLICA IDENTITY USING INDEX foo_code",
        "UPDATE foo SET v = 'b' WHERE id = 1",
    )
    tx = await env.next_transaction()
    framed(tx)
    # The index's isReplicaIdentity flag changed: it is re-created around the metadata.
    assert tags(tx) == ["drop-index", "update-table-metadata", "create-index", "update"]
    _, metadata, index, update = data(tx)
    assert metadata["table"] == {"schema": PUBLIC, "name": "foo"}
    assert metadata["old"]["rowKey"] == {"id": {"attNum": 1}}
    assert metadata["new"]["rowKey"] == {"code": {"attNum": 2}}
    assert index["spec"]["isReplicaIdentity"] is True
    assert update["relation"]["rowKey"] == {"columns": ["code"], "type": "index"}
    assert update["new"] == {"id": 1, "code": "one", "v": "b"}
    await env.wait_replica(commit_watermark(tx))
    assert upstream_metadata(env, "foo")["rowKey"] == {"code": {"attNum": 2}}
    assert indexes(env, "foo") == {
        "foo_pkey": (True, [("id", False)]),
        "foo_code": (True, [("code", False)]),
    }
    assert await env.replica_rows("foo") == [{"id": 1, "code": "one", "v": "b"}]
