"""Every type of spec source.md §1.5, from a Postgres row to the subscriber's JSON and the replica.

One table has a column per case. Row 1 is inserted before the service starts, so the
initial sync copies it (COPY text → value parsers → SQLite); row 2 has the same values
and is inserted afterwards, so it is streamed (pgoutput → mapper → JSON → backup
replicator → SQLite). Each case checks:

* the streamed insert's value, compared as JSON text (so ``9223372036854775807`` must
  be a bare integer literal and ``1704164645123.456`` JavaScript's float spelling);
* the replica value (and SQLite storage class) of the initial-sync row;
* the replica value of the streamed row, which must be identical.

The expected values are this project's documented ones (``app/sources/postgres/
values.py``), including where they are "more correct" than the reference: NULL array
elements, pre-1970 fractions, BC dates, NaN/±Infinity as strings, numeric beyond the
double range as its text.

The pipeline runs once for the module (``observed``); the cases only read its result.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from app.protocol.canonical_json import dumps
from tests.e2e_pg.conftest import StartUpstream, commit_watermark, data, running_upstream

BIG_NUMERIC = "1" + "0" * 400


class Case(NamedTuple):
    name: str
    pg_type: str
    literal: str
    wire: Any  # the value in the subscriber's insert
    lite: Any  # the value SQLite returns for the replica column
    storage: str  # typeof() of that value in SQLite


CASES = [
    Case("bool_t", "bool", "true", True, 1, "integer"),
    Case("bool_f", "bool", "false", False, 0, "integer"),
    Case("int2_max", "int2", "32767", 32767, 32767, "integer"),
    Case("int2_min", "int2", "-32768", -32768, -32768, "integer"),
    Case("int4_max", "int4", "2147483647", 2147483647, 2147483647, "integer"),
    Case("int4_min", "int4", "-2147483648", -2147483648, -2147483648, "integer"),
    Case("int8_max", "int8", "9223372036854775807", 2**63 - 1, 2**63 - 1, "integer"),
    Case("int8_min", "int8", "-9223372036854775808", -(2**63), -(2**63), "integer"),
    Case("int8_2p53_1", "int8", "9007199254740993", 2**53 + 1, 2**53 + 1, "integer"),
    Case("oid", "oid", "4294967295", 4294967295, 4294967295, "integer"),
    Case("float4", "float4", "0.1", 0.1, 0.1, "real"),
    Case("float4_ninf", "float4", "'-Infinity'", "-Infinity", "-Infinity", "text"),
    Case("float8", "float8", "1.7976931348623157e308", 1.7976931348623157e308,
         1.7976931348623157e308, "real"),
    Case("float8_tiny", "float8", "5e-324", 5e-324, 5e-324, "real"),
    Case("float8_nan", "float8", "'NaN'", "NaN", "NaN", "text"),
    Case("float8_inf", "float8", "'Infinity'", "Infinity", "Infinity", "text"),
    Case("numeric", "numeric", "123.456", 123.456, 123.456, "real"),
    Case("numeric_int", "numeric", "-42", -42, -42, "integer"),
    Case("numeric_nan", "numeric", "'NaN'", "NaN", "NaN", "text"),
    Case("numeric_inf", "numeric", "'Infinity'", "Infinity", "Infinity", "text"),
    Case("numeric_ninf", "numeric", "'-Infinity'", "-Infinity", "-Infinity", "text"),
    # Beyond a double: the wire keeps every digit (documented); SQLite's NUMERIC
    # affinity then turns that all-digit text into REAL +Inf in the replica.
    Case("numeric_huge", "numeric", "1e400", BIG_NUMERIC, math.inf, "real"),
    Case("json", "json", """'{"b": 1, "a": [1, 2.50]}'""", '{"b": 1, "a": [1, 2.50]}',
         '{"b": 1, "a": [1, 2.50]}', "text"),
    Case("jsonb", "jsonb", """'{"b": 1, "a": [1, 2.50]}'""", '{"a": [1, 2.50], "b": 1}',
         '{"a": [1, 2.50], "b": 1}', "text"),
    # Same declared type as the reference ("jsonb"): NUMERIC affinity stores a bare JSON
    # number as a number, so the replica keeps its value, not its text ("12.50").
    Case("jsonb_number", "jsonb", "'12.50'", "12.50", 12.5, "real"),
    Case("jsonb_string", "jsonb", """'"x\\"y"'""", '"x\\"y"', '"x\\"y"', "text"),
    Case("timestamp", "timestamp", "'2024-01-02 03:04:05.123456'", 1704164645123.456,
         1704164645123.456, "real"),
    Case("timestamptz", "timestamptz", "'2024-01-02 05:04:05.123456+02'",
         1704164645123.456, 1704164645123.456, "real"),
    Case("timestamptz_whole_ms", "timestamptz", "'2024-01-02 03:04:05.5+00'",
         1704164645500, 1704164645500, "integer"),
    Case("timestamptz_pre1970", "timestamptz", "'1960-06-15 12:30:45.25+00'",
         -301231754750, -301231754750, "integer"),
    Case("timestamptz_pre1970_us", "timestamptz", "'1969-12-31 23:59:59.999999+00'",
         -0.001, -0.001, "real"),
    Case("timestamptz_bc", "timestamptz", "'0044-03-15 12:00:00+00 BC'", -63517780800000,
         -63517780800000, "integer"),
    Case("timestamptz_inf", "timestamptz", "'infinity'", "infinity", "infinity", "text"),
    Case("timestamptz_ninf", "timestamptz", "'-infinity'", "-infinity", "-infinity", "text"),
    Case("timestamp_bc", "timestamp", "'4713-01-01 00:00:00 BC'", -210863520000000,
         -210863520000000, "integer"),
    Case("time", "time", "'13:45:30.123456'", 49530123, 49530123, "integer"),
    Case("time_24", "time", "'24:00:00'", 86400000, 86400000, "integer"),
    Case("timetz", "timetz", "'13:45:30.123+02'", 42330123, 42330123, "integer"),
    Case("timetz_wraps", "timetz", "'01:00:00+05'", 72000000, 72000000, "integer"),
    Case("date", "date", "'2024-02-29'", 1709164800000, 1709164800000, "integer"),
    Case("date_bc", "date", "'0001-01-01 BC'", -62167219200000, -62167219200000, "integer"),
    Case("date_inf", "date", "'infinity'", "infinity", "infinity", "text"),
    Case("text", "text", "E'h\\u00e9llo \"q\" \\\\ tab\\t nl\\n'", 'héllo "q" \\ tab\t nl\n',
         'héllo "q" \\ tab\t nl\n', "text"),
    Case("text_numeric_looking", "text", "'0012'", "0012", "0012", "text"),
    Case("varchar", "varchar(10)", "'abc'", "abc", "abc", "text"),
    Case("char", "char(5)", "'ab'", "ab   ", "ab   ", "text"),
    Case("uuid", "uuid", "'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'",
         "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "text"),
    Case("bytea", "bytea", "'\\x0001ff'::bytea", "\\x0001ff", "\\x0001ff", "text"),
    Case("enum", "hpe_mood", "'happy'", "happy", "happy", "text"),
    Case("int4_array", "int4[]", "'{1,2,3}'", [1, 2, 3], "[1,2,3]", "text"),
    Case("int4_array_empty", "int4[]", "'{}'", [], "[]", "text"),
    Case("int8_array_nulls", "int8[]", "ARRAY[9223372036854775807, NULL, -1]",
         [2**63 - 1, None, -1], "[9223372036854775807,null,-1]", "text"),
    Case("text_array_nulls", "text[]", """ARRAY['a', NULL, 'NULL', '']""",
         ["a", None, "NULL", ""], '["a",null,"NULL",""]', "text"),
    Case("int4_array_nested", "int4[][]", "'{{1,2},{3,4}}'", [[1, 2], [3, 4]],
         "[[1,2],[3,4]]", "text"),
    Case("json_array", "json[]", """ARRAY['{"a": 1}', '[1, "x"]']::json[]""",
         [{"a": 1}, [1, "x"]], '[{"a":1},[1,"x"]]', "text"),
    Case("jsonb_array", "jsonb[]", """ARRAY['{"b": 2}', NULL, '"s"']::jsonb[]""",
         [{"b": 2}, None, "s"], '[{"b":2},null,"s"]', "text"),
    Case("varchar_array", "varchar[]",
         """ARRAY['a,b', 'say "hi"', E'back\\\\slash', ' sp ', '{x}', 'NULL']""",
         ["a,b", 'say "hi"', "back\\slash", " sp ", "{x}", "NULL"],
         '["a,b","say \\"hi\\"","back\\\\slash"," sp ","{x}","NULL"]', "text"),
    Case("timestamptz_array", "timestamptz[]",
         "ARRAY['2024-01-02 03:04:05.123456+00', NULL, 'infinity']::timestamptz[]",
         [1704164645123.456, None, "infinity"], '[1704164645123.456,null,"infinity"]', "text"),
    Case("float8_array", "float8[]", "ARRAY['NaN', 1.5, '-Infinity']::float8[]",
         ["NaN", 1.5, "-Infinity"], '["NaN",1.5,"-Infinity"]', "text"),
    Case("bool_array", "bool[]", "ARRAY[true, false, NULL]", [True, False, None],
         "[true,false,null]", "text"),
    Case("enum_array", "hpe_mood[]", "ARRAY['sad', 'happy']::hpe_mood[]", ["sad", "happy"],
         '["sad","happy"]', "text"),
    Case("null_int4", "int4", "NULL", None, None, "null"),
]  # fmt: skip

SETUP = [
    "CREATE TYPE hpe_mood AS ENUM ('sad', 'happy')",
    "CREATE TABLE types (id int4 PRIMARY KEY, "
    + ", ".join(f'"{c.name}" {c.pg_type}' for c in CASES)
    + ")",
]


def insert(row_id: int) -> str:
    columns = ", ".join(f'"{c.name}"' for c in CASES)
    values = ", ".join(c.literal for c in CASES)
    return f"INSERT INTO types (id, {columns}) VALUES ({row_id}, {values})"


@dataclass(frozen=True)
class Observed:
    begin: dict[str, Any]
    streamed: dict[str, Any]  # the insert's "new"
    initial_row: dict[str, tuple[Any, str]]  # column → (value, typeof) in the replica
    streamed_row: dict[str, tuple[Any, str]]
    replica_types: dict[str, str]  # column → declared type


async def _observe(pg_url: str, work_dir: Path) -> Observed:
    async with running_upstream(pg_url, "hpe_types", work_dir, [*SETUP, insert(1)]) as env:
        await env.execute(insert(2))
        tx = await env.next_transaction()
        (change,) = data(tx)
        assert change["tag"] == "insert"
        await env.wait_replica(commit_watermark(tx))
        selects = ", ".join(f'"{c.name}", typeof("{c.name}")' for c in CASES)
        rows = {
            row[0]: row[1:]
            for row in env.replica_query(f"SELECT id, {selects} FROM types ORDER BY id")
        }
        declared = {r[1]: r[2] for r in env.replica_query("PRAGMA table_info(types)")}

        def by_column(values: tuple[Any, ...]) -> dict[str, tuple[Any, str]]:
            return {c.name: (values[2 * i], values[2 * i + 1]) for i, c in enumerate(CASES)}

        assert sorted(rows) == [1, 2]
        return Observed(tx[0][1], change["new"], by_column(rows[1]), by_column(rows[2]), declared)


@pytest.fixture(scope="module")
def observed(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Observed:
    # One pipeline run for every case below (the setup is most of the cost).
    return asyncio.run(_observe(pg_url, tmp_path_factory.mktemp("hpe_types")))


def test_begin_sends_json_values_as_strings(observed: Observed) -> None:
    assert observed.begin["json"] == "s"
    assert observed.streamed["id"] == 2
    assert set(observed.streamed) == {"id"} | {c.name for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_streamed_value(observed: Observed, case: Case) -> None:
    assert dumps(observed.streamed[case.name]) == dumps(case.wire)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_initial_sync_replica_value(observed: Observed, case: Case) -> None:
    value, storage = observed.initial_row[case.name]
    assert (value, storage) == (case.lite, case.storage)
    assert type(value) is type(case.lite)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_streamed_replica_value_matches_initial_sync(observed: Observed, case: Case) -> None:
    value, storage = observed.streamed_row[case.name]
    assert (value, storage) == observed.initial_row[case.name]
    assert type(value) is type(observed.initial_row[case.name][0])


def test_replica_declares_upstream_types(observed: Observed) -> None:
    declared = observed.replica_types
    assert declared["int8_max"] == "int8"
    assert declared["timestamptz"] == "timestamptz"
    assert declared["enum"] == "hpe_mood|TEXT_ENUM"
    assert declared["int4_array"] == "int4[]|TEXT_ARRAY"
    assert declared["enum_array"] == "hpe_mood[]|TEXT_ENUM|TEXT_ARRAY"
    assert declared["char"] == "bpchar"
    assert declared["varchar"] == "varchar"


async def test_integral_double_beyond_int64_reaches_the_replica(upstream: StartUpstream) -> None:
    env = await upstream(
        [
            "CREATE TABLE big (id int4 PRIMARY KEY, f float8, n numeric)",
            "INSERT INTO big VALUES (1, 1e19, 12345678901234567890)",
        ]
    )
    await env.execute("INSERT INTO big VALUES (2, 1e19, 12345678901234567890)")
    tx = await env.next_transaction()
    (change,) = data(tx)
    assert dumps(change["new"]) == '{"id":2,"f":10000000000000000000,"n":12345678901234567000}'
    # Bounded short: with the bug the replica never gets there.
    await env.wait_replica(commit_watermark(tx), within_s=3)
    assert env.replica_query("SELECT id, f, typeof(f), n, typeof(n) FROM big ORDER BY id") == [
        (1, 1e19, "real", 1.2345678901234567e19, "real"),
        (2, 1e19, "real", 1.2345678901234567e19, "real"),
    ]
