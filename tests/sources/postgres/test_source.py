"""The Postgres change source against a real server: slot → messages → acks → slot.

Each test gets a fresh database with one published table and a pgoutput slot made
with the SQL function (the shard setup has its own tests). The stream is read the
way the service reads it: ``async for`` over ``start_stream(...)``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from app.protocol import canonical_json
from app.protocol.canonical_json import JsonPieces
from app.protocol.lexi import lsn_to_watermark
from app.protocol.messages import Begin, ChangeSourceMessage, Commit, Control, Data, Status
from app.protocol.pieces import PIECE_CHARS, Pieces
from app.sources.postgres import source as source_module
from app.sources.postgres.connection import ReplicationStreamEnded
from app.sources.postgres.source import (
    PostgresChangeSource,
    PostgresSourceOptions,
)
from app.stop_signals import AbortError
from tests.sources.postgres.test_backfills import Reads, batch, metadata, request
from tests.waiting import eventually

DB = "cs_pgsource"
SLOT = "cs_pgsource_slot"
PUB = "cs_pgsource_pub"


@pytest.fixture
async def upstream(pg_url: str) -> AsyncIterator[tuple[str, str]]:
    """(database URL, the slot's consistent point as a watermark)."""
    admin = pg_url.rsplit("/", 1)[0] + "/postgres"
    url = pg_url.rsplit("/", 1)[0] + f"/{DB}"
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as c:
        await c.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (SLOT,),
        )
        await c.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        await c.execute(f"CREATE DATABASE {DB}")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
        await c.execute(
            "CREATE TABLE items (id int8 PRIMARY KEY, name text, tags text[], "
            "price float8, meta jsonb, at timestamptz, big text)"
        )
        await c.execute("CREATE TABLE nokey (a int, b text)")
        await c.execute("ALTER TABLE nokey REPLICA IDENTITY FULL")
        await c.execute(f"CREATE PUBLICATION {PUB} FOR TABLE items, nokey")
        cur = await c.execute(
            "SELECT lsn FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,)
        )
        row = await cur.fetchone()
        assert row is not None
    yield url, lsn_to_watermark(str(row[0]))
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as c:
        await c.execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
            "WHERE slot_name = %s AND active_pid IS NOT NULL",
            (SLOT,),
        )

        async def dropped() -> bool:
            try:
                await c.execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                    "WHERE slot_name = %s",
                    (SLOT,),
                )
                return True
            except psycopg.errors.ObjectInUse:
                return False

        with contextlib.suppress(AssertionError):  # as before: then DROP DATABASE ... FORCE
            await eventually(dropped, "the slot to be dropped", 5, poll_s=0.1)
        await c.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


def source_for(url: str, **overrides: Any) -> PostgresChangeSource:
    options = PostgresSourceOptions(
        **{"app_id": "zero", "shard_num": 0, "publications": (PUB,), "slot": SLOT, **overrides}
    )
    return PostgresChangeSource(url, options)


async def execute(url: str, *statements: str) -> None:
    async with await psycopg.AsyncConnection.connect(url) as c:
        for s in statements:
            await c.execute(s)
        await c.commit()


async def take(
    it: AsyncIterator[ChangeSourceMessage], n: int, *, skip_status: bool = True
) -> list[ChangeSourceMessage]:
    out: list[ChangeSourceMessage] = []
    while len(out) < n:
        m = await asyncio.wait_for(anext(it), 10)
        if skip_status and isinstance(m, Status):
            continue
        out.append(m)
    return out


def wire(m: ChangeSourceMessage) -> str:
    return canonical_json.dumps(m.as_list())


async def test_transaction_arrives_as_the_reference_shapes_it(upstream: tuple[str, str]) -> None:
    url, start = upstream
    stream = await source_for(url).start_stream(start, [])
    try:
        await execute(
            url,
            "INSERT INTO items VALUES (9007199254740993, 'a', ARRAY['x', NULL], 1.5, "
            "'{\"k\": [1, 2]}', '2024-01-02 03:04:05.123456+00', NULL)",
            "UPDATE items SET id = 2, name = 'b' WHERE id = 9007199254740993",
            "DELETE FROM items WHERE id = 2",
        )
        begin, ins, upd, dele, commit = await take(aiter(stream), 5)
        assert isinstance(begin, Begin)
        assert isinstance(commit, Commit)
        assert begin.commit_watermark == commit.watermark
        assert begin.commit_watermark > start
        assert list(begin.body) == ["tag", "commitLsn", "commitTime", "xid", "json"]
        assert begin.body["json"] == "s"
        assert lsn_to_watermark(begin.body["commitLsn"].replace("/", "/")) == begin.commit_watermark
        assert list(commit.body) == [
            "tag",
            "flags",
            "commitLsn",
            "commitEndLsn",
            "commitTime",
            "commitTimeMs",
        ]
        assert commit.body["commitTimeMs"] == commit.body["commitTime"] // 1000
        relation = (
            '{"tag":"relation","relationOid":%d,"schema":"public","name":"items",'
            '"rowKey":{"columns":["id"],"type":"default"},"keyColumns":["id"],'
            '"replicaIdentity":"default"}'
        )
        assert isinstance(ins, Data)
        oid = ins.body["relation"]["relationOid"]
        assert wire(ins) == (
            '["data",{"tag":"insert","relation":' + relation % oid + ',"new":'
            '{"id":9007199254740993,"name":"a","tags":["x",null],"price":1.5,'
            '"meta":"{\\"k\\": [1, 2]}","at":1704164645123.456,"big":null}}]'
        )
        # The key changed: `key` carries the old key, `old` is null (identity default).
        assert wire(upd) == (
            '["data",{"tag":"update","relation":' + relation % oid + ',"key":'
            '{"id":9007199254740993},"old":null,"new":{"id":2,"name":"b","tags":["x",null],'
            '"price":1.5,"meta":"{\\"k\\": [1, 2]}","at":1704164645123.456,"big":null}}]'
        )
        assert wire(dele) == (
            '["data",{"tag":"delete","relation":' + relation % oid + ',"key":{"id":2},"old":null}]'
        )
    finally:
        await stream.close()


async def test_unchanged_toast_is_left_out_and_identity_full_fills_it(
    upstream: tuple[str, str],
) -> None:
    url, start = upstream
    # Incompressible, so it is stored out of line (TOAST) and not resent when unchanged.
    await execute(
        url,
        "INSERT INTO items (id, name, big) SELECT 1, 'a', string_agg(md5(i::text), '') "
        "FROM generate_series(1, 3000) i",
    )
    stream = await source_for(url).start_stream(start, [])
    try:
        it = aiter(stream)
        await take(it, 3)  # the insert's transaction
        await execute(url, "UPDATE items SET name = 'b' WHERE id = 1")
        _, upd, _ = await take(it, 3)
        assert isinstance(upd, Data)
        assert upd.body["new"] == {
            "id": 1,
            "name": "b",
            "tags": None,
            "price": None,
            "meta": None,
            "at": None,
        }
        assert "big" not in upd.body["new"]
        # Identity FULL: key and old are the whole old row.
        await execute(
            url, "INSERT INTO nokey VALUES (1, 'one')", "UPDATE nokey SET b = 'uno' WHERE a = 1"
        )
        _, _, upd2, _ = await take(it, 4)
        assert isinstance(upd2, Data)
        assert upd2.body["key"] == {"a": 1, "b": "one"} == upd2.body["old"]
        assert upd2.body["new"] == {"a": 1, "b": "uno"}
        assert upd2.body["relation"]["rowKey"] == {"columns": ["a", "b"], "type": "full"}
    finally:
        await stream.close()


async def test_rolled_back_transaction_emits_nothing(upstream: tuple[str, str]) -> None:
    url, start = upstream
    stream = await source_for(url).start_stream(start, [])
    try:
        async with await psycopg.AsyncConnection.connect(url) as c:
            await c.execute("INSERT INTO items (id) VALUES (100)")
            await c.rollback()
        await execute(url, "INSERT INTO items (id) VALUES (101)")
        _, ins, _ = await take(aiter(stream), 3)
        assert isinstance(ins, Data)
        assert ins.body["new"]["id"] == 101
    finally:
        await stream.close()


async def test_truncate_carries_its_options(upstream: tuple[str, str]) -> None:
    url, start = upstream
    stream = await source_for(url).start_stream(start, [])
    try:
        await execute(url, "TRUNCATE items, nokey RESTART IDENTITY CASCADE")
        _, trunc, _ = await take(aiter(stream), 3)
        assert isinstance(trunc, Data)
        assert trunc.body["tag"] == "truncate"
        assert trunc.body["cascade"] is True
        assert trunc.body["restartIdentity"] is True
        assert [r["name"] for r in trunc.body["relations"]] == ["items", "nokey"]
    finally:
        await stream.close()


async def slot_column(url: str, column: str) -> Any:
    """One column of the test slot's row in pg_replication_slots."""
    async with await psycopg.AsyncConnection.connect(url) as c:
        cur = await c.execute(
            f"SELECT {column} FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)
        )
        row = await cur.fetchone()
        assert row is not None
        return row[0]


async def confirmed_flush(url: str) -> str:
    return lsn_to_watermark(str(await slot_column(url, "confirmed_flush_lsn")))


async def test_ack_moves_the_slot_and_restart_resumes_after_it(upstream: tuple[str, str]) -> None:
    url, start = upstream
    source = source_for(url)
    stream = await source.start_stream(start, [])
    try:
        it = aiter(stream)
        await execute(url, "INSERT INTO items (id) VALUES (1)")
        await execute(url, "INSERT INTO items (id) VALUES (2)")
        msgs = await take(it, 6)
        first, second = msgs[2], msgs[5]
        assert isinstance(first, Commit)
        assert isinstance(second, Commit)
        before = await confirmed_flush(url)
        assert before < first.watermark
        stream.ack(["status", first.body, {"watermark": first.watermark}])

        async def moved() -> bool:
            return await confirmed_flush(url) >= first.watermark

        await eventually(moved, f"the slot to move to {first.watermark}", 5, poll_s=0.05)
        # The slot moved to the acked commit, not to the unacked second one.
        assert first.watermark <= await confirmed_flush(url) < second.watermark
    finally:
        await stream.close()
    # A new stream after the first commit starts with the second transaction.
    stream = await source.start_stream(first.watermark, [])
    try:
        begin = (await take(aiter(stream), 1))[0]
        assert isinstance(begin, Begin)
        assert begin.commit_watermark == second.watermark
    finally:
        await stream.close()


async def test_a_large_value_arrives_in_pieces_and_the_stream_goes_on(
    upstream: tuple[str, str],
) -> None:
    """A frame over a chunk is decoded from its chunks: the large text value is
    ``JsonPieces`` whose change text is exactly the whole path's, the other
    columns parse as usual, and small rows after it take the usual path."""
    url, start = upstream
    stream = await source_for(url).start_stream(start, [])
    try:
        it = aiter(stream)
        value = 'é😀 "quoted" \\ \n' + "x" * 3_000_000
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
            await c.execute(
                "INSERT INTO items (id, name, tags, price, big) VALUES (1, 'n', '{a,b}', 1.5, %s)",
                (value,),
            )
            await c.execute("UPDATE items SET name = 'm' WHERE id = 1")  # big: unchanged TOAST
            await c.execute("INSERT INTO items (id, big) VALUES (2, 'small')")
        messages = await take(it, 9)
        insert = messages[1]
        assert isinstance(insert, Data)
        big = insert.body["new"]["big"]
        assert isinstance(big, JsonPieces)
        assert max(map(len, big.text.parts)) <= 2 * PIECE_CHARS
        text = canonical_json.dumps_text(insert.body)
        assert isinstance(text, Pieces)
        expected = {**insert.body, "new": {**insert.body["new"], "big": value}}
        assert text.join() == canonical_json.dumps(expected)
        assert insert.body["new"]["tags"] == ["a", "b"]
        update, small = messages[4], messages[7]
        assert isinstance(update, Data)
        assert "big" not in update.body["new"]
        assert isinstance(small, Data)
        assert small.body["new"]["big"] == "small"
    finally:
        await stream.close()


async def test_a_key_change_in_a_large_row_reaches_the_running_backfill(
    upstream: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row change goes through the same bookkeeping, whichever decoder made
    it: a key-changing UPDATE in a frame over a chunk (issue 26) voids the running
    backfill's older batches of its table, which then starts over, as a small
    one does. (The backfill's reader is the manager tests' double: the test says
    when it has read what; replication is the real server's.)"""
    reads = Reads()
    monkeypatch.setattr(
        source_module, "stream_backfill", lambda _u, _n, _p, request, _r: reads(request)
    )
    url, start = upstream
    req = request(
        {"schema": "public", "name": "items"}, ("big",), {**metadata(), "rowKey": {"id": {}}}
    )
    stream = await source_for(url).start_stream(start, [req])
    try:
        it = aiter(stream)
        read = await reads.call(1)  # the backfill of items runs
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
            await c.execute("INSERT INTO items (id, big) VALUES (1, %s)", ("a" * 2_000_000,))
            await c.execute("UPDATE items SET id = 5, big = %s WHERE id = 1", ("b" * 2_000_000,))
        messages = await take(it, 6)
        update = messages[4]
        assert isinstance(update, Data)
        assert update.body["key"] == {"id": 1}
        assert isinstance(update.body["new"]["big"], JsonPieces)  # the large-frame decoder
        key_change_commit = messages[5]
        assert isinstance(key_change_commit, Commit)
        changed_at = key_change_commit.watermark
        # A batch read before the key change: voided, and the backfill reads again.
        read.feed(batch(req, start, [1, "a"]))
        following = asyncio.ensure_future(take(it, 1))
        again = await reads.call(2)
        assert again.request == req
        again.feed(batch(req, changed_at, [5, "b"]))
        (begin,) = await asyncio.wait_for(following, 10)
        assert isinstance(begin, Begin)
        assert (await take(it, 1))[0].body["watermark"] == changed_at
    finally:
        await stream.close()


async def test_close_right_after_an_ack_ends_the_stream(upstream: tuple[str, str]) -> None:
    # An ack wakes the standby writer; a close() in the same loop step used to
    # cancel it just as its wait_for() completed, which Python 3.11 swallows: the
    # writer kept sending keepalives and close() never returned (CI hung here).
    url, start = upstream
    stream = await source_for(url).start_stream(start, [])
    stream.ack(["status", {}, {"watermark": start}])
    closing = asyncio.ensure_future(stream.close())
    done, _ = await asyncio.wait({closing}, timeout=10)
    if not done:
        closing.cancel()
    assert closing in done, "close() did not return within 10 s"
    # The walsender is gone: the slot is free for the next stream.

    async def free() -> bool:
        return not await slot_active(url)

    await eventually(free, "the slot to be free", 5, poll_s=0.05)
    assert not await slot_active(url)


async def slot_active(url: str) -> bool:
    return bool(await slot_column(url, "active"))


async def test_keepalives_become_ack_statuses_and_our_keepalives_hold_the_connection(
    upstream: tuple[str, str],
) -> None:
    url, start = upstream
    # A 2 s wal_sender_timeout (settable per connection): Postgres asks for a reply
    # after 1 s of silence and drops a client silent for 2 s. We answer with
    # manual keepalives at 75 % of it, so the stream survives several timeouts.
    short = url + "?options=-c%20wal_sender_timeout%3D2000"
    stream = await source_for(short).start_stream(start, [])
    try:
        it = aiter(stream)
        statuses = []
        deadline = asyncio.get_running_loop().time() + 5
        while asyncio.get_running_loop().time() < deadline:
            # Statuses come about once a second; a loaded machine (the whole suite
            # on 2 cores) may starve the walsender for a few seconds: a bound, not a
            # measure.
            m = await asyncio.wait_for(anext(it), 20)
            assert isinstance(m, Status)
            statuses.append(m)
        assert len(statuses) >= 2
        assert all(s.ack and s.body == {"ack": True} for s in statuses)
        assert all(s.watermark >= start for s in statuses)
        # Still alive after 2.5 timeouts: a transaction comes through.
        await execute(url, "INSERT INTO items (id) VALUES (7)")
        msgs = await take(it, 3)
        assert [m.kind for m in msgs] == ["begin", "data", "commit"]
    finally:
        await stream.close()


async def test_another_process_taking_the_slot_ends_the_stream(
    upstream: tuple[str, str],
) -> None:
    url, start = upstream
    source = source_for(url)
    first = await source.start_stream(start, [])
    try:
        second = await source.start_stream(start, [])  # terminates the first's backend
        try:
            with pytest.raises(ReplicationStreamEnded) as info:
                await take(aiter(first), 1, skip_status=False)
            assert info.value.sqlstate == "57P01"
        finally:
            await second.close()
    finally:
        await first.close()


async def test_missing_slot_is_a_clear_error(upstream: tuple[str, str]) -> None:
    url, start = upstream
    options = PostgresSourceOptions(
        app_id="zero", shard_num=0, publications=(PUB,), slot="cs_no_such_slot"
    )
    # Not retried: the service stops (a restart then re-syncs or says what to do).
    with pytest.raises(AbortError, match="replication slot cs_no_such_slot does not exist"):
        await PostgresChangeSource(url, options).start_stream(start, [])


async def test_a_slot_that_cannot_serve_at_the_start_is_reset_required_alone(
    upstream: tuple[str, str], pg_url: str
) -> None:
    # A slot of another database (here: ours, made in the admin database) cannot
    # stream this one. With no transaction open, the stream says reset-required and
    # nothing else: a rollback outside a transaction would stop the service instead.
    url, start = upstream
    admin = pg_url.rsplit("/", 1)[0] + "/postgres"
    slot = "cs_other_database_slot"
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as c:
        await c.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    try:
        stream = await source_for(url, slot=slot).start_stream(start, [])
        try:
            msgs = await take(aiter(stream), 1)
            assert [m.kind for m in msgs] == ["control"]
            control = msgs[0]
            assert isinstance(control, Control)
            assert control.tag == "reset-required"
            assert "can no longer be used" in str((control.error_details or {}).get("reason"))
        finally:
            await stream.close()
    finally:
        async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as c:
            await c.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


async def test_degraded_mode_resets_on_a_schema_change(upstream: tuple[str, str]) -> None:
    url, start = upstream
    stream = await source_for(url, ddl_detection=False, initial_schema={"tables": []}).start_stream(
        start, []
    )
    try:
        await execute(url, "INSERT INTO items (id) VALUES (1)")
        msgs = await take(aiter(stream), 3)
        assert [m.kind for m in msgs] == ["begin", "rollback", "control"]
        control = msgs[2]
        assert isinstance(control, Control)
        assert control.tag == "reset-required"
        assert control.message is not None
        assert control.message.startswith("Unable to continue replication from LSN ")
        details = control.error_details or {}
        assert details["reason"] == "relation public.items is not in the initial schema"
    finally:
        await stream.close()
