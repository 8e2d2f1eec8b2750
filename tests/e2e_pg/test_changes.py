"""Row changes end to end: upstream statement → subscriber's JSON → replica rows.

Covers what the mapper and the replica writer must get right together: unchanged
TOAST values, primary-key changes, REPLICA IDENTITY FULL, truncate flags and CASCADE,
transaction framing (multi-row, rolled back, 100,000 rows) and the slot's
``confirmed_flush_lsn`` following the stored commits.
"""

from __future__ import annotations

import psycopg

from app.protocol.lexi import lsn_to_watermark
from tests.e2e_pg.conftest import WAIT_S, StartUpstream, commit_watermark, data
from tests.waiting import eventually

ITEMS = "CREATE TABLE items (id int4 PRIMARY KEY, name text, n int8)"


def rel(name: str, key: list[str], identity: str = "default") -> dict[str, object]:
    return {"schema": "public", "name": name, "rowKey": {"columns": key, "type": identity}}


def assert_relation(change: dict[str, object], name: str, key: list[str], identity: str) -> None:
    relation = change["relation"]
    assert isinstance(relation, dict)
    assert relation["schema"] == "public"
    assert relation["name"] == name
    assert relation["rowKey"] == {"columns": key, "type": identity}
    assert relation["keyColumns"] == key
    assert relation["replicaIdentity"] == identity


async def test_multi_row_transaction_is_one_begin_commit_in_order(
    upstream: StartUpstream,
) -> None:
    env = await upstream([ITEMS, "INSERT INTO items VALUES (1, 'one', 10)"])
    await env.execute(
        "INSERT INTO items VALUES (2, 'two', 20)",
        "INSERT INTO items VALUES (3, 'three', 30)",
        "UPDATE items SET name = 'uno' WHERE id = 1",
        "DELETE FROM items WHERE id = 2",
        "INSERT INTO items VALUES (4, 'four', 40)",
    )
    tx = await env.next_transaction()
    assert [m[0] for m in tx] == ["begin"] + ["data"] * 5 + ["commit"]
    begin, commit = tx[0], tx[-1]
    assert begin[1]["tag"] == "begin"
    assert begin[1]["json"] == "s"
    assert commit[2] == {"watermark": begin[2]["commitWatermark"]}
    assert commit[1]["commitLsn"] == begin[1]["commitLsn"]
    assert lsn_to_watermark(begin[1]["commitLsn"]) == commit_watermark(tx)
    changes = data(tx)
    assert [(c["tag"], c.get("new")) for c in changes] == [
        ("insert", {"id": 2, "name": "two", "n": 20}),
        ("insert", {"id": 3, "name": "three", "n": 30}),
        ("update", {"id": 1, "name": "uno", "n": 10}),
        ("delete", None),
        ("insert", {"id": 4, "name": "four", "n": 40}),
    ]
    assert changes[2]["key"] is None
    assert changes[2]["old"] is None
    assert changes[3]["key"] == {"id": 2}
    assert changes[3]["old"] is None
    for c in changes:
        assert_relation(c, "items", ["id"], "default")
    assert await env.replica_rows("items", at=commit_watermark(tx), order_by="id") == [
        {"id": 1, "name": "uno", "n": 10},
        {"id": 3, "name": "three", "n": 30},
        {"id": 4, "name": "four", "n": 40},
    ]


BIG = "(SELECT string_agg(md5(i::text), '') FROM generate_series(1, 400) i)"


async def test_unchanged_toast_value_is_left_out_and_the_replica_keeps_it(
    upstream: StartUpstream,
) -> None:
    env = await upstream(
        [
            "CREATE TABLE docs (id int4 PRIMARY KEY, title text, body text)",
            f"INSERT INTO docs VALUES (1, 'synced', {BIG})",
        ]
    )
    big = (await env.query(f"SELECT {BIG}"))[0][0]
    assert len(big) == 12800
    # Stored out of line (TOAST), so an update that leaves it alone sends 'u'.
    await env.execute(f"INSERT INTO docs VALUES (2, 'streamed', {BIG})")
    tx = await env.next_transaction()
    assert data(tx)[0]["new"] == {"id": 2, "title": "streamed", "body": big}

    await env.execute("UPDATE docs SET title = 'renamed' WHERE id IN (1, 2)")
    tx = await env.next_transaction()
    updates = data(tx)
    assert [u["new"] for u in updates] == [
        {"id": 1, "title": "renamed"},
        {"id": 2, "title": "renamed"},
    ]
    assert all("body" not in u["new"] for u in updates)
    assert await env.replica_rows("docs", at=commit_watermark(tx), order_by="id") == [
        {"id": 1, "title": "renamed", "body": big},
        {"id": 2, "title": "renamed", "body": big},
    ]


async def test_unchanged_toast_value_is_filled_from_the_old_row_with_identity_full(
    upstream: StartUpstream,
) -> None:
    env = await upstream(
        [
            "CREATE TABLE docs (id int4 PRIMARY KEY, title text, body text)",
            "ALTER TABLE docs REPLICA IDENTITY FULL",
            f"INSERT INTO docs VALUES (1, 'synced', {BIG})",
        ]
    )
    big = (await env.query(f"SELECT {BIG}"))[0][0]
    await env.execute("UPDATE docs SET title = 'renamed' WHERE id = 1")
    (update,) = data(await env.next_transaction())
    assert update["old"] == {"id": 1, "title": "synced", "body": big}
    assert update["key"] == update["old"]
    assert update["new"] == {"id": 1, "title": "renamed", "body": big}


async def test_primary_key_change_sends_the_old_key_and_moves_the_replica_row(
    upstream: StartUpstream,
) -> None:
    env = await upstream([ITEMS, "INSERT INTO items VALUES (1, 'one', 10), (2, 'two', 20)"])
    await env.execute("UPDATE items SET id = 100, name = 'moved' WHERE id = 1")
    tx = await env.next_transaction()
    (update,) = data(tx)
    assert update["tag"] == "update"
    assert update["key"] == {"id": 1}
    assert update["old"] is None
    assert update["new"] == {"id": 100, "name": "moved", "n": 10}
    assert await env.replica_rows("items", at=commit_watermark(tx), order_by="id") == [
        {"id": 2, "name": "two", "n": 20},
        {"id": 100, "name": "moved", "n": 10},
    ]


async def test_replica_identity_full_update_and_delete_carry_the_old_row(
    upstream: StartUpstream,
) -> None:
    env = await upstream(
        [
            ITEMS,
            "ALTER TABLE items REPLICA IDENTITY FULL",
            "INSERT INTO items VALUES (1, 'one', 10), (2, 'two', NULL)",
        ]
    )
    await env.execute(
        "UPDATE items SET name = 'uno', id = 11 WHERE id = 1",
        "DELETE FROM items WHERE id = 2",
    )
    tx = await env.next_transaction()
    update, delete = data(tx)
    assert_relation(update, "items", ["id", "name", "n"], "full")
    assert update["old"] == {"id": 1, "name": "one", "n": 10}
    assert update["key"] == {"id": 1, "name": "one", "n": 10}
    assert update["new"] == {"id": 11, "name": "uno", "n": 10}
    assert_relation(delete, "items", ["id", "name", "n"], "full")
    assert delete["old"] == {"id": 2, "name": "two", "n": None}
    assert delete["key"] == {"id": 2, "name": "two", "n": None}
    assert await env.replica_rows("items", at=commit_watermark(tx)) == [
        {"id": 11, "name": "uno", "n": 10}
    ]


async def test_truncate_cascade_and_restart_identity(upstream: StartUpstream) -> None:
    env = await upstream(
        [
            "CREATE TABLE parent (id int4 PRIMARY KEY)",
            "CREATE TABLE child (id int4 PRIMARY KEY, parent int4 REFERENCES parent)",
            "CREATE TABLE counter (id serial PRIMARY KEY, v text)",
            "INSERT INTO parent VALUES (1), (2)",
            "INSERT INTO child VALUES (10, 1), (20, 2)",
            "INSERT INTO counter (v) VALUES ('a'), ('b')",
        ]
    )
    assert len(await env.replica_rows("child")) == 2
    await env.execute("TRUNCATE parent CASCADE")
    tx = await env.next_transaction()
    (truncate,) = data(tx)
    assert truncate["tag"] == "truncate"
    assert truncate["cascade"] is True
    assert truncate["restartIdentity"] is False
    assert sorted(r["name"] for r in truncate["relations"]) == ["child", "parent"]
    await env.wait_replica(commit_watermark(tx))
    assert await env.replica_rows("parent") == []
    assert await env.replica_rows("child") == []
    assert len(await env.replica_rows("counter")) == 2

    await env.execute("TRUNCATE counter RESTART IDENTITY", "INSERT INTO counter (v) VALUES ('c')")
    tx = await env.next_transaction()
    truncate, insert = data(tx)
    assert truncate["cascade"] is False
    assert truncate["restartIdentity"] is True
    assert [r["name"] for r in truncate["relations"]] == ["counter"]
    assert insert["new"] == {"id": 1, "v": "c"}
    assert await env.replica_rows("counter", at=commit_watermark(tx)) == [{"id": 1, "v": "c"}]


async def test_rolled_back_transaction_emits_nothing(upstream: StartUpstream) -> None:
    env = await upstream([ITEMS])
    async with await psycopg.AsyncConnection.connect(env.url) as conn:
        await conn.execute("INSERT INTO items VALUES (1, 'never', 0)")
        await conn.execute("INSERT INTO items VALUES (2, 'never', 0)")
        await conn.rollback()
    await env.execute("INSERT INTO items VALUES (3, 'kept', 3)")
    tx = await env.next_transaction()
    assert [m[0] for m in tx] == ["begin", "data", "commit"]
    assert data(tx)[0]["new"] == {"id": 3, "name": "kept", "n": 3}
    assert await env.replica_rows("items", at=commit_watermark(tx)) == [
        {"id": 3, "name": "kept", "n": 3}
    ]


ROWS = 100_000


async def test_big_transaction_arrives_whole(upstream: StartUpstream) -> None:
    env = await upstream([ITEMS])
    await env.execute(
        f"INSERT INTO items SELECT i, 'row ' || i, i * 2 FROM generate_series(1, {ROWS}) i"
    )
    first = await env.next_message()
    assert first[0] == "begin"
    ids = []
    while (m := await env.next_message())[0] == "data":
        assert m[1]["tag"] == "insert"
        ids.append(m[1]["new"]["id"])
    assert m[0] == "commit"
    assert m[2]["watermark"] == first[2]["commitWatermark"]
    assert ids == list(range(1, ROWS + 1))
    await env.wait_replica(m[2]["watermark"])
    assert env.replica_query("SELECT count(*), min(id), max(id), sum(n) FROM items") == [
        (ROWS, 1, ROWS, ROWS * (ROWS + 1))
    ]


async def test_slot_confirmed_flush_lsn_advances_once_changes_are_stored(
    upstream: StartUpstream,
) -> None:
    env = await upstream([ITEMS])
    await env.execute("INSERT INTO items VALUES (1, 'one', 1)")
    tx = await env.next_transaction()
    watermark = commit_watermark(tx)
    slot = env.runtime.slot
    confirmed: str | None = None

    async def advanced() -> bool:
        nonlocal confirmed
        rows = await env.query(
            f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{slot}'"
        )
        assert len(rows) == 1
        confirmed = lsn_to_watermark(rows[0][0])
        return confirmed >= watermark

    await eventually(
        advanced,
        lambda: f"confirmed_flush_lsn at {confirmed} to reach {watermark}",
        WAIT_S,
        poll_s=0.05,
    )
    assert confirmed is not None
    assert confirmed >= watermark
