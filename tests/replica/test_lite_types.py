"""Column types and values as the replica stores them (zero's conversions)."""

from __future__ import annotations

import math
import sqlite3
from typing import Any

import pytest

from app.replica.ddl import (
    LiteColumn,
    create_index_statement,
    create_table_statement,
    lite_column,
    lite_table_columns,
    map_default,
)
from app.replica.errors import ReplicaError, UnsupportedColumnDefaultError
from app.replica.lite_types import lite_type_string, lite_value, zql_value_type


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"pos": 1, "dataType": "int8"}, "int8"),
        ({"pos": 1, "dataType": "int8", "notNull": True}, "int8|NOT_NULL"),
        ({"pos": 1, "dataType": "mood", "pgTypeClass": "e"}, "mood|TEXT_ENUM"),
        (
            {"pos": 1, "dataType": "text[]", "elemPgTypeClass": "b", "notNull": True},
            "text[]|NOT_NULL|TEXT_ARRAY",
        ),
        (
            {"pos": 1, "dataType": "mood[]", "pgTypeClass": "b", "elemPgTypeClass": "e"},
            "mood[]|TEXT_ENUM|TEXT_ARRAY",
        ),
        ({"pos": 1, "dataType": "varchar", "characterMaximumLength": 10}, "varchar"),
    ],
)
def test_the_declared_type_encodes_the_upstream_type_and_attributes(
    spec: dict[str, Any], expected: str
) -> None:
    assert lite_column("t", "c", spec, ignore_default=True).data_type == expected


def test_an_upstream_type_with_a_pipe_is_refused() -> None:
    with pytest.raises(ReplicaError, match="must not contain"):
        lite_type_string("a|b", False, False, False)


def test_an_array_type_without_an_element_class_is_refused() -> None:
    column = lite_column("t", "c", {"pos": 1, "dataType": "text[]"}, ignore_default=True)
    with pytest.raises(ReplicaError, match="elemPgTypeClass"):
        create_table_statement("t", {"c": column})


@pytest.mark.parametrize(
    ("lite_type", "expected"),
    [
        ("int8|NOT_NULL", "number"),
        ("timestamp with time zone", "number"),
        ("varchar(32)", "string"),
        ("uuid", "string"),
        ("bool", "boolean"),
        ("jsonb", "json"),
        ("int4[]|TEXT_ARRAY", "json"),
        ("mood|TEXT_ENUM", "string"),
        ("bytea", None),
    ],
)
def test_zql_value_types(lite_type: str, expected: str | None) -> None:
    assert zql_value_type(lite_type) == expected


@pytest.mark.parametrize(
    ("value", "lite_type", "json_format", "expected"),
    [
        (None, "jsonb", "p", None),
        (True, "bool", "p", 1),
        (False, "bool|NOT_NULL", "s", 0),
        (2**62, "int8", "p", 2**62),
        (1.5, "float8", "p", 1.5),
        ("x", "text", "p", "x"),
        ('{"a": 1}', "jsonb", "s", '{"a": 1}'),  # already JSON text: kept byte for byte
        ('{"a": 1}', "jsonb", "p", '"{\\"a\\": 1}"'),  # a parsed JSON string
        ({"a": [1, True]}, "json", "p", '{"a":[1,true]}'),
        ([1, None, 3], "int4[]|TEXT_ARRAY", "s", "[1,null,3]"),  # NULL elements
        ([{"a": 1}], "jsonb[]|TEXT_ARRAY", "s", '[{"a":1}]'),  # json[] elements are parsed
        ([True, False], "bool[]|TEXT_ARRAY", "p", "[true,false]"),
        ({"k": 1}, "text", "p", '{"k":1}'),  # an object in a non-JSON column
        ([True, [False]], "text", "p", "[1,[0]]"),  # zero stores those booleans as 0/1
    ],
)
def test_values_are_converted_as_zero_does(
    value: Any, lite_type: str, json_format: Any, expected: Any
) -> None:
    assert lite_value(value, lite_type, json_format) == expected


def test_integers_beyond_64_bits_are_stored_as_the_doubles_they_are() -> None:
    # JSON writes an integral double below 1e21 without exponent (float8 1e19 is
    # 10000000000000000000); only doubles get that far, Postgres integers fit int64.
    big = lite_value(10**19, "float8", "p")
    assert isinstance(big, float)
    assert big == 1e19
    assert lite_value(-(2**63), "int8", "p") == -(2**63)
    assert isinstance(lite_value(2**63 - 1, "int8", "p"), int)


@pytest.mark.parametrize("column_type", ["float8", "float4", "numeric", "timestamptz", "date"])
def test_special_float_strings_come_back_out_as_the_same_strings(column_type: str) -> None:
    conn = sqlite3.connect(":memory:")
    conn.execute(f'CREATE TABLE t (v "{column_type}")')
    specials = ["NaN", "Infinity", "-Infinity", "infinity", "-infinity"]
    for value in [*specials, 2.5]:
        conn.execute("INSERT INTO t VALUES (?)", (lite_value(value, column_type, "s"),))
    got = conn.execute("SELECT v, typeof(v) FROM t ORDER BY rowid").fetchall()
    assert got == [*[(s, "text") for s in specials], (2.5, "real")]
    assert math.isinf(float(got[1][0]))  # a reader can turn them back into floats


@pytest.mark.parametrize(
    ("dflt", "expected"),
    [
        (None, None),
        ("", None),
        ("42", "42"),
        ("-1.5", "-1.5"),
        ("true", "1"),
        ("false", "0"),
        ("'foo'::text", "'foo'"),
        ("'2147483648'::bigint", "'2147483648'"),
        ("'it''s'::text", "'it''s'"),
        ("''::text", "''"),
        ("''''::text", "''''"),
        ("'x'''::text", "'x'''"),
        ("'a;b -- c\n)'::text", "'a;b -- c\n)'"),
        ("ARRAY[]::text[]", "'[]'"),
        ("'{}'::integer[]", "'[]'"),
    ],
)
def test_supported_column_defaults(dflt: str | None, expected: str | None) -> None:
    assert map_default("t", "c", dflt) == expected


@pytest.mark.parametrize("dflt", ["now()", "'{a}'::text[]", "nextval('s'::regclass)"])
def test_other_column_defaults_are_refused(dflt: str) -> None:
    with pytest.raises(UnsupportedColumnDefaultError, match=r"Unsupported default value for t\.c"):
        map_default("t", "c", dflt)


# Defaults that would put an upstream's SQL into the replica's DDL (issue 25). The first
# ones match zero's "('.*')::(\w+)", whose greedy ".*" spans several literals.
INJECTED_DEFAULTS = [
    "'x' CHECK (0) COLLATE 'binary'::text",
    "'x'; DROP TABLE foo; SELECT 'y'::text",
    "'x' REFERENCES 'bar'::text",
    "'a' || 'b'::text",
    "'x''::text",  # unterminated: the quote before :: is doubled
    "'x\x00'::text",
    "'x'::text; DROP TABLE foo",
    "'x'::text\n",
    "1); DROP TABLE foo; --",
    "(SELECT 1)",
    "42 CHECK (0)",
    "\u0661\u0662",  # Arabic-Indic digits, which \d matches without re.ASCII
    "'x'",  # no cast: Postgres always writes one
    "NULL::text",
]


@pytest.mark.parametrize("dflt", INJECTED_DEFAULTS)
def test_only_a_literal_default_is_accepted(dflt: str) -> None:
    with pytest.raises(
        UnsupportedColumnDefaultError, match=r"^Unsupported default value for t\.c: "
    ):
        map_default("t", "c", dflt)


def test_a_refused_default_is_shown_on_one_line() -> None:
    with pytest.raises(UnsupportedColumnDefaultError) as raised:
        map_default("t", "c", "'x'\n; DROP TABLE t; " + "-" * 200)
    assert str(raised.value) == (
        "Unsupported default value for t.c: \"'x'\\n; DROP TABLE t; " + "-" * 60 + '..."'
    )


def test_create_table_text_matches_zero() -> None:
    columns = lite_table_columns(
        "foo",
        {
            "name": {"pos": 2, "dataType": "varchar", "dflt": "'x'::text"},
            "id": {"pos": 1, "dataType": "int8", "notNull": True},
        },
        default_version="01",
    )
    assert create_table_statement("foo", columns) == (
        'CREATE TABLE "foo" (\n'
        '"id" "int8|NOT_NULL",\n'
        '"name" "varchar",\n'
        '"_0_version" "text" DEFAULT \'01\'\n'
        ");"
    )
    assert columns["_0_version"] == LiteColumn(pos=2**53 - 1, data_type="text", dflt="'01'")


def test_create_index_text_matches_zero() -> None:
    assert (
        create_index_statement("s.i", "s.t", {"a": "ASC", "b": "DESC"}, unique=True)
        == 'CREATE UNIQUE INDEX "s.i" ON "s.t" ("a" ASC,"b" DESC);'
    )
    assert (
        create_index_statement("i", "t", {"a": "ASC"}, unique=False)
        == 'CREATE INDEX "i" ON "t" ("a" ASC);'
    )
