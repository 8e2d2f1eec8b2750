"""Reading one backfill from a real Postgres (spec/source.md §1.5, §1.8).

Each test gets its own scratch database (conftest) with a published table; the
request is built from the catalog the way the schema change would carry it
(``relationOID``, ``schemaOID``, each column's ``attNum``), and read with
:func:`stream_backfill`. Where the rows are compared with the replication stream's,
the same rows are also inserted under a pgoutput slot and read through
:class:`PostgresChangeSource`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import psycopg
import pytest

from app.protocol.lexi import lsn_to_watermark, parse_state_version
from app.protocol.messages import Begin, Commit, Data, Status
from app.sources.postgres.backfill_stream import (
    BackfillNames,
    BackfillSchemaError,
    stream_backfill,
)
from app.sources.postgres.source import PostgresChangeSource, PostgresSourceOptions
from app.sources.postgres.values import TypeRegistry, load_type_registry
from tests.waiting import eventually

WAIT_S = 20.0
POLL_S = 0.05
PUB = "cs_bfs_pub"
NAMES = BackfillNames(slot_prefix="cs_bfs_", position_prefix="cs_bfs/0/backfill")
TEMP_SLOTS = "cs\\_bfs\\_bf\\_%"  # LIKE pattern of the temporary slots

TYPES = (
    "CREATE TABLE t (id int4 PRIMARY KEY, n int8, s text, at timestamptz, d date, "
    "j json, jb jsonb, arr text[], ints int4[][], jbs jsonb[], f float8, b bool, "
    "num numeric, u uuid, by bytea)"
)
TYPE_ROWS = [
    "INSERT INTO t VALUES (1, 9007199254740993, E'tab\\there\\nnew line\\\\back\\rslash', "
    "'2024-01-02 03:04:05.123456+00', '2024-02-29', '{\"a\": [1, 2.5],  \"b\": null}', "
    "'{\"b\": 1, \"a\": \"x\\ty\"}', ARRAY['a', NULL, 'NULL', 'say \"hi\"', E'back\\\\slash', "
    "'', E'tab\\there', '{x,y}'], '{{1,2},{3,NULL}}', ARRAY['{\"k\": [1]}', 'null']::jsonb[], "
    "1.5, true, 123.4500, 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '\\x00ff5c')",
    "INSERT INTO t (id) VALUES (2)",  # every other column NULL
    "INSERT INTO t VALUES (3, -1, E'\\\\N', '-infinity', '0001-01-01 BC', '\"\\\\\"', "
    "'[]', '{}', '{}', '{}', 'NaN', false, 'NaN', "
    "'00000000-0000-0000-0000-000000000000', '')",
    "INSERT INTO t VALUES (4, 0, 'NULL', 'infinity', 'infinity', 'null', 'null', "
    "ARRAY[NULL]::text[], '{{NULL}}', ARRAY[NULL]::jsonb[], '-Infinity', NULL, -0.5, NULL, NULL)",
    "INSERT INTO t SELECT g, g * 1000, repeat(E'x\\t', g % 7), "
    "'2024-01-01 00:00:00+00'::timestamptz + g * interval '1.5 ms', NULL, "
    "json_build_object('g', g), jsonb_build_object('g', g), ARRAY[g::text], ARRAY[g, -g], "
    "NULL, g / 3.0, g % 2 = 0, g, NULL, NULL FROM generate_series(5, 40) g",
]
TYPE_COLUMNS = ("n", "s", "at", "d", "j", "jb", "arr", "ints", "jbs", "f", "b", "num", "u", "by")


async def execute(url: str, *statements: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for s in statements:
            await conn.execute(s.encode())


async def rows(url: str, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(query.encode(), params)
        return await cur.fetchall()


async def registry(url: str) -> TypeRegistry:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return await load_type_registry(conn)


async def backfill_request(
    url: str,
    table: str,
    columns: Sequence[str],
    key: Sequence[str] = ("id",),
    schema: str = "public",
) -> dict[str, Any]:
    """The request as the schema change would make it, from the catalog."""
    found = await rows(
        url,
        "SELECT c.oid::int8, c.relnamespace::int8 FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
        (schema, table),
    )
    assert len(found) == 1, found
    oid, schema_oid = found[0]
    attnums = dict(
        await rows(
            url,
            "SELECT attname::text, attnum::int FROM pg_attribute "
            "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
            (oid,),
        )
    )
    return {
        "table": {
            "schema": schema,
            "name": table,
            "metadata": {
                "schemaOID": schema_oid,
                "relationOID": oid,
                "rowKey": {k: {"attNum": attnums[k]} for k in key},
            },
        },
        "columns": {c: {"attNum": attnums[c]} for c in columns},
    }


async def read_all(
    url: str,
    request: dict[str, Any],
    *,
    publications: Sequence[str] = (PUB,),
    batch_bytes: int | None = None,
) -> list[dict[str, Any]]:
    options = {} if batch_bytes is None else {"batch_bytes": batch_bytes}
    out: list[dict[str, Any]] = []
    types = await registry(url)
    async with asyncio.timeout(WAIT_S):
        async for body in stream_backfill(url, NAMES, publications, request, types, **options):
            out.append(body)
    return out


def backfilled_rows(bodies: list[dict[str, Any]]) -> list[list[Any]]:
    return sorted(
        (row for b in bodies if b["tag"] == "backfill" for row in b["rowValues"]),
        key=lambda r: r[0],
    )


async def temp_slots_gone(url: str) -> None:
    """Until no temporary backfill slot is left (its session ends asynchronously)."""
    query = "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE %s"

    async def gone() -> bool:
        return not await rows(url, query, (TEMP_SLOTS,))

    await eventually(gone, "the temporary backfill slots to go", WAIT_S, poll_s=POLL_S)


async def no_other_sessions(url: str) -> None:
    """Until no other client session of this database is left (the COPY's ended)."""
    query = (
        "SELECT pid, state, query FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND backend_type IN ('client backend', 'walsender')"
    )

    async def alone() -> bool:
        return not await rows(url, query)

    await eventually(alone, "the other sessions to end", WAIT_S, poll_s=POLL_S)


@pytest.fixture
async def typed(db_url: str) -> str:
    """The scratch database with ``t`` (many types) published, empty."""
    await execute(db_url, TYPES, f"CREATE PUBLICATION {PUB} FOR TABLE t")
    return db_url


@pytest.fixture
async def wide(db_url: str) -> str:
    """``w``: 100 rows of 102 COPY bytes each (4-digit id, tab, 96 x's, newline)."""
    await execute(
        db_url,
        "CREATE TABLE w (id int PRIMARY KEY, v text)",
        "INSERT INTO w SELECT g, repeat('x', 96) FROM generate_series(1000, 1099) g",
        f"CREATE PUBLICATION {PUB} FOR TABLE w",
    )
    return db_url


# -- values ---------------------------------------------------------------------------


async def streamed_inserts(url: str, start: str, count: int) -> list[dict[str, Any]]:
    """The next transaction's inserts as the replication stream gives them."""
    options = PostgresSourceOptions(app_id="cs", shard_num=0, publications=(PUB,), slot="cs_bfs_s")
    stream = await PostgresChangeSource(url, options).start_stream(start, [])
    try:
        messages = aiter(stream)
        out: list[Any] = []
        async with asyncio.timeout(WAIT_S):
            while len(out) < count + 2:
                m = await anext(messages)
                if not isinstance(m, Status):
                    out.append(m)
    finally:
        await stream.close()
    assert isinstance(out[0], Begin)
    assert out[0].body["json"] == "s"
    assert isinstance(out[-1], Commit)
    inserts = out[1:-1]
    assert all(isinstance(m, Data) and m.tag == "insert" for m in inserts)
    return [m.body["new"] for m in inserts]


async def test_values_are_the_replication_streams(typed: str) -> None:
    (lsn,) = (
        await rows(
            typed, "SELECT lsn FROM pg_create_logical_replication_slot('cs_bfs_s', 'pgoutput')"
        )
    )[0]
    async with await psycopg.AsyncConnection.connect(typed) as conn:
        for statement in TYPE_ROWS:
            await conn.execute(statement.encode())
        await conn.commit()
    (count,) = (await rows(typed, "SELECT count(*) FROM t"))[0]
    streamed = await streamed_inserts(typed, lsn_to_watermark(str(lsn)), count)

    request = await backfill_request(typed, "t", TYPE_COLUMNS)
    bodies = await read_all(typed, request)
    *batches, done = bodies
    assert [b["tag"] for b in batches] == ["backfill"]  # 40 rows: under 256 KiB
    assert done["tag"] == "backfill-completed"
    relation = {"schema": "public", "name": "t", "rowKey": {"columns": ["id"]}}
    for body in bodies:
        assert body["relation"] == relation
        assert body["columns"] == list(TYPE_COLUMNS)
    backfilled = backfilled_rows(bodies)
    assert len(backfilled) == count
    expected = sorted(
        ([row[c] for c in ("id", *TYPE_COLUMNS)] for row in streamed), key=lambda r: r[0]
    )
    assert backfilled == expected

    # And as spec/source.md §1.5 has them (json as its text: begin json "s").
    assert dict(zip(("id", *TYPE_COLUMNS), backfilled[0], strict=True)) == {
        "id": 1,
        "n": 9007199254740993,
        "s": "tab\there\nnew line\\back\rslash",
        "at": 1704164645123.456,
        "d": 1709164800000,
        "j": '{"a": [1, 2.5],  "b": null}',
        "jb": '{"a": "x\\ty", "b": 1}',
        "arr": ["a", None, "NULL", 'say "hi"', "back\\slash", "", "tab\there", "{x,y}"],
        "ints": [[1, 2], [3, None]],
        "jbs": [{"k": [1]}, None],
        "f": 1.5,
        "b": True,
        "num": 123.45,
        "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        "by": "\\x00ff5c",
    }
    assert backfilled[1] == [2, *[None] * len(TYPE_COLUMNS)]
    assert backfilled[2][1:4] == [-1, "\\N", "-infinity"]
    assert backfilled[2][5] == '"\\\\"'
    assert backfilled[3][2] == "NULL"


# -- batches ----------------------------------------------------------------------------


async def test_batches_are_cut_by_copy_bytes(wide: str) -> None:
    request = await backfill_request(wide, "w", ["v"])
    bodies = await read_all(wide, request, batch_bytes=1000)
    *batches, done = bodies
    # 102-byte lines: the 10th passes 1,000 bytes and ends the batch.
    assert [len(b["rowValues"]) for b in batches] == [10] * 10
    assert all(b["tag"] == "backfill" for b in batches)
    assert [b["status"]["rows"] for b in batches] == list(range(10, 101, 10))
    assert {b["status"]["totalRows"] for b in bodies} == {100}
    assert all(b["status"]["totalBytes"] > 0 for b in bodies)
    assert done == {
        "tag": "backfill-completed",
        "relation": {"schema": "public", "name": "w", "rowKey": {"columns": ["id"]}},
        "columns": ["v"],
        "watermark": batches[0]["watermark"],
        "status": {"rows": 100, "totalRows": 100, "totalBytes": done["status"]["totalBytes"]},
    }
    assert backfilled_rows(bodies) == [[i, "x" * 96] for i in range(1000, 1100)]
    await temp_slots_gone(wide)

    # With the default batch size it is one batch.
    bodies = await read_all(wide, request)
    assert [b["tag"] for b in bodies] == ["backfill", "backfill-completed"]
    assert len(bodies[0]["rowValues"]) == 100


async def test_an_empty_table_is_only_a_completion(wide: str) -> None:
    await execute(wide, "DELETE FROM w")
    bodies = await read_all(wide, await backfill_request(wide, "w", ["id", "v"]))
    assert [b["tag"] for b in bodies] == ["backfill-completed"]
    assert bodies[0]["columns"] == ["v"]  # the key goes in relation.rowKey
    assert bodies[0]["status"]["rows"] == 0
    assert bodies[0]["status"]["totalRows"] == 0


async def test_the_temporary_slot_and_session_are_gone_after_an_early_close(wide: str) -> None:
    request = await backfill_request(wide, "w", ["v"])
    backfill = stream_backfill(wide, NAMES, [PUB], request, await registry(wide), batch_bytes=500)
    first = await asyncio.wait_for(anext(backfill), WAIT_S)
    assert first["tag"] == "backfill"
    assert isinstance(backfill, AsyncGenerator)  # declared an AsyncIterator; closable
    await asyncio.wait_for(backfill.aclose(), WAIT_S)
    await temp_slots_gone(wide)
    await no_other_sessions(wide)
    # And after a complete read.
    await read_all(wide, request)
    await temp_slots_gone(wide)
    await no_other_sessions(wide)


# -- the snapshot -------------------------------------------------------------------------


async def test_the_watermark_is_the_snapshots_lsn_and_later_writes_are_not_in_it(
    wide: str,
) -> None:
    await rows(wide, "SELECT pg_create_logical_replication_slot('cs_bfs_d', 'test_decoding')")
    (before,) = (await rows(wide, "SELECT pg_current_wal_lsn()::text"))[0]
    request = await backfill_request(wide, "w", ["v"])
    backfill = stream_backfill(wide, NAMES, [PUB], request, await registry(wide), batch_bytes=500)
    bodies = [await asyncio.wait_for(anext(backfill), WAIT_S)]
    # Committed after the snapshot: not in it.
    await execute(wide, "INSERT INTO w VALUES (5000, 'late')", "UPDATE w SET v = 'new'")
    async with asyncio.timeout(WAIT_S):
        bodies += [b async for b in backfill]
    (after,) = (await rows(wide, "SELECT pg_current_wal_lsn()::text"))[0]

    watermark = bodies[0]["watermark"]
    assert {b["watermark"] for b in bodies} == {watermark}
    assert parse_state_version(watermark).minor is None
    assert lsn_to_watermark(before) <= watermark <= lsn_to_watermark(after)
    assert backfilled_rows(bodies) == [[i, "x" * 96] for i in range(1000, 1100)]

    # The position message the stream passes to know it is past the snapshot.
    changes = await rows(
        wide,
        "SELECT lsn::text, data FROM pg_logical_slot_get_changes('cs_bfs_d', NULL, NULL) "
        "WHERE data LIKE 'message:%%'",
    )
    positions = [
        (lsn, data) for lsn, data in changes if f"prefix: {NAMES.position_prefix}," in data
    ]
    assert len(positions) == 1, changes
    ((lsn, data),) = positions
    assert "transactional: 0" in data  # outside any transaction: it arrives at once
    assert lsn_to_watermark(lsn) >= watermark


# -- row filters ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("publications", "ids"),
    [
        ({"p1": "WHERE (id > 1090)"}, range(1091, 1100)),
        (
            {"p1": "WHERE (id < 1003)", "p2": "WHERE (id >= 1097)"},
            [1000, 1001, 1002, 1097, 1098, 1099],
        ),
        ({"p1": "WHERE (id < 1003)", "p2": ""}, range(1000, 1100)),
    ],
    ids=["one-filter", "filters-or", "one-without-filter"],
)
async def test_row_filters_keep_to_the_published_rows(
    wide: str, publications: dict[str, str], ids: Sequence[int]
) -> None:
    await execute(
        wide, *(f"CREATE PUBLICATION {p} FOR TABLE w {f}" for p, f in publications.items())
    )
    request = await backfill_request(wide, "w", ["v"])
    bodies = await read_all(wide, request, publications=list(publications))
    assert [r[0] for r in backfilled_rows(bodies)] == list(ids)
    assert bodies[-1]["status"]["totalRows"] == len(ids)


# -- schema checks ---------------------------------------------------------------------------


SCHEMA_CHANGES = {
    "table-dropped": (["DROP TABLE w"], "table has been renamed or dropped"),
    "table-renamed": (["ALTER TABLE w RENAME TO w2"], "table has been renamed or dropped"),
    "table-replaced": (
        [
            "DROP TABLE w",
            "CREATE TABLE w (id int PRIMARY KEY, v text)",
            f"ALTER PUBLICATION {PUB} ADD TABLE w",
        ],
        "table no longer corresponds to the original table",
    ),
    "column-replaced": (
        ["ALTER TABLE w DROP COLUMN v", "ALTER TABLE w ADD COLUMN v text"],
        "column v no longer corresponds to the original column",
    ),
    "column-dropped": (["ALTER TABLE w DROP COLUMN v"], "column v has been renamed or dropped"),
    "column-renamed": (
        ["ALTER TABLE w RENAME COLUMN v TO v2"],
        "column v has been renamed or dropped",
    ),
    "row-key-changed": (
        [
            "ALTER TABLE w ADD COLUMN k int",
            "UPDATE w SET k = id",
            "ALTER TABLE w DROP CONSTRAINT w_pkey",
            "ALTER TABLE w ADD PRIMARY KEY (k)",
        ],
        "row key (e.g. PRIMARY KEY or INDEX) has changed",
    ),
}


@pytest.mark.parametrize("change", SCHEMA_CHANGES.values(), ids=SCHEMA_CHANGES.keys())
async def test_a_request_the_table_no_longer_matches_is_a_schema_error(
    wide: str, change: tuple[list[str], str]
) -> None:
    statements, reason = change
    request = await backfill_request(wide, "w", ["v"])
    await execute(wide, *statements)
    with pytest.raises(BackfillSchemaError) as raised:
        await read_all(wide, request)
    assert str(raised.value) == f"cannot backfill public.w[v]: {reason}"
    await temp_slots_gone(wide)
    await no_other_sessions(wide)


async def test_a_replaced_schema_is_a_schema_error(db_url: str) -> None:
    await execute(
        db_url,
        "CREATE SCHEMA s",
        "CREATE TABLE s.x (id int PRIMARY KEY, v text)",
        f"CREATE PUBLICATION {PUB} FOR TABLES IN SCHEMA s",
    )
    request = await backfill_request(db_url, "x", ["v"], schema="s")
    await execute(
        db_url,
        "DROP SCHEMA s CASCADE",
        "CREATE SCHEMA s",
        "CREATE TABLE s.x (id int PRIMARY KEY, v text)",
        f"ALTER PUBLICATION {PUB} ADD TABLES IN SCHEMA s",
    )
    with pytest.raises(BackfillSchemaError) as raised:
        await read_all(db_url, request)
    assert str(raised.value) == (
        "cannot backfill s.x[v]: schema no longer corresponds to the original schema"
    )


async def test_a_request_without_table_metadata_is_a_schema_error(wide: str) -> None:
    request = await backfill_request(wide, "w", ["v"])
    request["table"]["metadata"] = None
    with pytest.raises(BackfillSchemaError) as raised:
        await read_all(wide, request)
    assert str(raised.value) == (
        "cannot backfill public.w[v]: the request has no table metadata with a row key"
    )
