"""Value conversion against real Postgres output: each type's text as its output function writes it.

Values are read in the text protocol with a loader that keeps the raw text, which is
what pgoutput sends (``::text`` is not always the same: ``true::text`` is ``'true'``,
the output function writes ``t``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg.abc import Buffer
from psycopg.adapt import Loader

from app.protocol import canonical_json
from app.sources.postgres.values import TypeRegistry, load_type_registry

ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
DB = "hpa_values"
URL = f"host=127.0.0.1 port=5432 user=postgres dbname={DB}"

# (column type, SQL literal, expected JSON value with json_as_string=True)
CASES: list[tuple[str, str, Any]] = [
    ("bool", "true", True),
    ("bool", "false", False),
    ("int2", "-32768", -32768),
    ("int4", "2147483647", 2147483647),
    ("int8", "-9223372036854775808", -9223372036854775808),
    ("int8", "9223372036854775807", 9223372036854775807),
    ("oid", "4294967295", 4294967295),
    ("float4", "1.1", 1.1),
    ("float4", "'-Infinity'", "-Infinity"),
    ("float8", "1e308", 1e308),
    ("float8", "5e-324", 5e-324),
    ("float8", "'NaN'", "NaN"),
    ("float8", "'Infinity'", "Infinity"),
    ("numeric", "123.4500", 123.45),
    ("numeric", "'NaN'", "NaN"),
    ("numeric", "'-Infinity'", "-Infinity"),
    ("numeric", "12345678901234567890", 12345678901234567890.0),
    ("json", """'{"a": [1, 2.5], "b": null}'""", '{"a": [1, 2.5], "b": null}'),
    ("jsonb", """'{"b": 1, "a": 123456789012345678901}'""", '{"a": 123456789012345678901, "b": 1}'),
    ("timestamp", "'2024-01-02 03:04:05.123456'", 1704164645123.456),
    ("timestamp", "'1969-12-31 23:59:59.999999'", -0.001),
    ("timestamp", "'1960-06-15 12:00:00.5'", -301233599500),
    ("timestamp", "'0044-03-15 12:00:00 BC'", -63517780800000),
    ("timestamp", "'10000-01-01 00:00:00'", 253402300800000),
    ("timestamp", "'infinity'", "infinity"),
    ("timestamptz", "'2024-01-02 03:04:05.123456+00'", 1704164645123.456),
    ("timestamptz", "'-infinity'", "-infinity"),
    ("date", "'2024-02-29'", 1709164800000),
    ("date", "'0001-01-01 BC'", -62167219200000),
    ("date", "'infinity'", "infinity"),
    ("time", "'24:00:00'", 86400000),
    ("time", "'12:34:56.789999'", 45296789),
    ("timetz", "'00:30:00+01'", 84600000),
    ("timetz", "'12:00:00-05:30:15'", 17 * 3600_000 + 30 * 60_000 + 15_000),
    ("timetz", "'23:59:59.999+15:59'", 8 * 3600_000 + 59_999),
    ("text", "'NULL'", "NULL"),
    ("varchar(10)", "'é'", "é"),
    ("uuid", "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    ("bytea", "'\\x00ff'::bytea", "\\x00ff"),
    ("interval", "'1 day 02:03:04'", "1 day 02:03:04"),
    ("int8[]", "ARRAY[1, NULL, 9223372036854775807]", [1, None, 9223372036854775807]),
    (
        "text[]",
        """ARRAY['a', NULL, 'NULL', 'say "hi"', 'back\\slash', '', ' sp ', '{x,y}']""",
        ["a", None, "NULL", 'say "hi"', "back\\slash", "", " sp ", "{x,y}"],
    ),
    ("int4[]", "'{}'", []),
    ("int4[]", "'{{1,2},{3,NULL}}'", [[1, 2], [3, None]]),
    ("int4[]", "'[0:2]={1,2,3}'", [1, 2, 3]),
    ("float8[]", "ARRAY['NaN', 1.5]::float8[]", ["NaN", 1.5]),
    ("numeric[]", "ARRAY[1.50, NULL]", [1.5, None]),
    (
        "json[]",
        """ARRAY['{"a": 1}', '[1, "x"]', 'null', NULL]::json[]""",
        [{"a": 1}, [1, "x"], None, None],
    ),
    ("jsonb[]", """ARRAY['"s"', '2']::jsonb[]""", ["s", 2]),
    (
        "timestamptz[]",
        "ARRAY['2024-01-02 03:04:05.123456+00', NULL, 'infinity']::timestamptz[]",
        [1704164645123.456, None, "infinity"],
    ),
    ("date[]", "ARRAY['0044-03-15 BC'::date]", [-63517824000000]),
    ("box[]", "ARRAY['((1,1),(0,0))'::box, '((2,2),(1,1))']", ["(1,1),(0,0)", "(2,2),(1,1)"]),
    ("bool[]", "'{t,f,NULL}'", [True, False, None]),
    ("hpa_mood", "'happy'", "happy"),
    ("hpa_mood[]", "ARRAY['sad', NULL]::hpa_mood[]", ["sad", None]),
    ("hpa_posint", "5", 5),
    ("hpa_posint[]", "ARRAY[5, 6]::hpa_posint[]", [5, 6]),
    ("hpa_intlist", "ARRAY[7, NULL]", [7, None]),
]


@pytest.fixture
async def conn() -> AsyncIterator[psycopg.AsyncConnection[tuple[Any, ...]]]:
    async with await psycopg.AsyncConnection.connect(ADMIN, autocommit=True) as admin:
        await admin.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        await admin.execute(f"CREATE DATABASE {DB}")
    try:
        async with await psycopg.AsyncConnection.connect(URL, autocommit=True) as c:
            await c.execute("SET DateStyle = 'ISO, MDY'")
            await c.execute("SET TimeZone = 'UTC'")
            await c.execute("CREATE TYPE hpa_mood AS ENUM ('happy', 'sad')")
            await c.execute("CREATE DOMAIN hpa_posint AS int4 CHECK (VALUE > 0)")
            await c.execute("CREATE DOMAIN hpa_intlist AS int4[]")
            yield c
    finally:
        async with await psycopg.AsyncConnection.connect(ADMIN, autocommit=True) as admin:
            await admin.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


class _RawText(Loader):
    def load(self, data: Buffer) -> str:
        return bytes(data).decode()


async def _raw_rows(
    conn: psycopg.AsyncConnection[tuple[Any, ...]], query: str
) -> list[tuple[Any, ...]]:
    """Rows of ``query`` with every column as the server's output text."""
    cur = conn.cursor()
    await cur.execute(query)
    assert cur.description is not None
    for column in cur.description:
        cur.adapters.register_loader(column.type_code, _RawText)
    await cur.execute(query)  # again, now loaded by _RawText
    return await cur.fetchall()


async def _texts_and_types(
    conn: psycopg.AsyncConnection[tuple[Any, ...]], table: str
) -> list[tuple[str | None, int]]:
    """Every column of ``table``'s single row as text, with the type OID pgoutput would send."""
    cur = await conn.execute(
        "SELECT attname, atttypid::int8 FROM pg_attribute "
        "WHERE attrelid = %s::regclass AND attnum > 0 ORDER BY attnum",
        (table,),
    )
    columns = await cur.fetchall()
    (row,) = await _raw_rows(conn, f"SELECT * FROM {table}")
    return [(text, int(oid)) for text, (_, oid) in zip(row, columns, strict=True)]


async def test_every_type_as_postgres_prints_it(
    conn: psycopg.AsyncConnection[tuple[Any, ...]],
) -> None:
    columns = ", ".join(f"c{i} {sql_type}" for i, (sql_type, _, _) in enumerate(CASES))
    literals = ", ".join(literal for _, literal, _ in CASES)
    await conn.execute(f"CREATE TABLE hpa_all ({columns})")
    await conn.execute(f"INSERT INTO hpa_all VALUES ({literals})")
    registry = await load_type_registry(conn)

    results = await _texts_and_types(conn, "hpa_all")
    for (sql_type, literal, expected), (text, oid) in zip(CASES, results, strict=True):
        assert text is not None
        assert registry.knows(oid), sql_type
        value = registry.parser(oid, json_as_string=True)(text)
        assert (sql_type, literal, value) == (sql_type, literal, expected)
        assert type(value) is type(expected), (sql_type, text, value)
        canonical_json.dumps([value])  # never a NaN/Infinity float


async def test_json_columns_parse_when_not_sent_as_strings(
    conn: psycopg.AsyncConnection[tuple[Any, ...]],
) -> None:
    await conn.execute("CREATE TABLE hpa_json (j json, b jsonb)")
    await conn.execute(
        """INSERT INTO hpa_json VALUES ('{"n": 123456789012345678901}', '[1, {"x": null}]')"""
    )
    registry = await load_type_registry(conn)
    (j, j_oid), (b, b_oid) = await _texts_and_types(conn, "hpa_json")
    assert j is not None
    assert b is not None
    assert registry.parser(j_oid, json_as_string=False)(j) == {"n": 123456789012345678901}
    assert registry.parser(b_oid, json_as_string=False)(b) == [1, {"x": None}]


@pytest.mark.parametrize(
    "zone",
    [
        "America/St_Johns",  # -03:30 / -02:30
        "Asia/Kathmandu",  # +05:45
        "Europe/Amsterdam",  # 1900: local mean time +00:19:32, printed with seconds
        "Pacific/Kiritimati",  # +14
    ],
)
async def test_timestamptz_respects_the_printed_offset(
    conn: psycopg.AsyncConnection[tuple[Any, ...]], zone: str
) -> None:
    await conn.execute(f"SET TimeZone = '{zone}'")
    await conn.execute("CREATE TABLE hpa_tz (t timestamptz)")
    await conn.execute(
        "INSERT INTO hpa_tz VALUES ('2024-01-02 03:04:05.123456+00'), ('2024-07-01 12:00:00+00'),"
        " ('1900-01-01 00:00:00.000001+00'), ('1969-12-31 23:59:59.5+00'),"
        " ('0044-03-15 12:00:00+00 BC')"
    )
    registry = await load_type_registry(conn)
    parse = registry.parser(1184, json_as_string=True)
    rows = await _raw_rows(
        conn, "SELECT t, extract(epoch FROM t) * 1000, to_char(t, 'OF') FROM hpa_tz ORDER BY t"
    )
    offsets = set()
    for text, exact_ms, offset in rows:
        offsets.add(offset)
        # extract(epoch) is an exact numeric in PG 14+: compare with the correctly rounded double.
        assert parse(text) == float(Decimal(exact_ms)), (zone, text)
    assert "+00" not in offsets  # the zone really printed non-UTC offsets


async def test_dates_and_times_against_extract_epoch(
    conn: psycopg.AsyncConnection[tuple[Any, ...]],
) -> None:
    await conn.execute("CREATE TABLE hpa_dates (d date, t timestamp)")
    await conn.execute(
        "INSERT INTO hpa_dates SELECT d::date, d + interval '13:14:15.123456' FROM "
        "generate_series('4713-01-01 BC'::timestamp, '3000-01-01', interval '9876 days') d"
    )
    registry = await load_type_registry(conn)
    parse_date = registry.parser(1082, json_as_string=True)
    parse_ts = registry.parser(1114, json_as_string=True)
    rows = await _raw_rows(
        conn,
        "SELECT d, extract(epoch FROM d) * 1000, t, extract(epoch FROM t) * 1000 FROM hpa_dates",
    )
    assert len(rows) > 200
    assert any(text.endswith(" BC") for text, *_ in rows)
    for d_text, d_ms, t_text, t_ms in rows:
        assert parse_date(d_text) == int(Decimal(d_ms)), d_text
        assert parse_ts(t_text) == float(Decimal(t_ms)), t_text


async def test_a_static_registry_treats_unloaded_user_types_as_text(
    conn: psycopg.AsyncConnection[tuple[Any, ...]],
) -> None:
    cur = await conn.execute("SELECT 'hpa_intlist'::regtype::oid::int8")
    row = await cur.fetchone()
    assert row is not None
    oid = int(row[0])
    assert not TypeRegistry().knows(oid)
    assert TypeRegistry().parser(oid, json_as_string=True)("{1,2}") == "{1,2}"
    loaded = await load_type_registry(conn)
    assert loaded.parser(oid, json_as_string=True)("{1,2}") == [1, 2]
