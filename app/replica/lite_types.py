"""Upstream column types on the replica, and upstream JSON values as SQLite values.

**Declared types.** zero keeps the upstream type name as the SQLite column's declared
type, with attributes appended after ``|`` (the "lite type string"):
``int8``, ``int8|NOT_NULL``, ``mood|TEXT_ENUM``, ``text[]|NOT_NULL|TEXT_ARRAY``.
SQLite derives the column affinity from that text (``int8`` → INTEGER, ``float8`` →
REAL, ``text`` → TEXT, most others NUMERIC), which is what zero relies on. The same
facts are also written, unencoded, to ``"_zero.column_metadata"`` (see
:mod:`app.replica.metadata`); readers prefer that table.

**Values** (:func:`lite_value`), as zero's replicator converts them:

* ``null`` stays NULL; strings, ints and floats are stored as they are;
* ``true``/``false`` become ``1``/``0``;
* JSON/JSONB columns and arrays (zero treats every array as JSON): the JSON text.
  When the transaction's ``json`` format is ``"s"`` a string value already *is* that
  text and is stored unchanged; otherwise the value is serialized with
  :func:`app.protocol.canonical_json.dumps`;
* any other object/array value is serialized the same way;
* integers must fit SQLite's signed 64 bits (zero fails on those too).

Values only our Postgres source emits, and how they come back out of SQLite:

* NULL array elements are JSON ``null`` inside the array's JSON text;
* NaN/±Infinity floats arrive as the strings ``"NaN"``, ``"Infinity"``,
  ``"-Infinity"`` and timestamp ±infinity as ``"infinity"``/``"-infinity"``. They are
  stored as those strings; SQLite's REAL/NUMERIC affinity leaves text that is not a
  numeric literal alone, so reading the column gives back the same ``str`` (with
  ``typeof(col) = 'text'``) next to the ``float`` values of ordinary rows.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Final, Literal

from app.protocol.canonical_json import dumps
from app.replica.errors import ReplicaError

__all__ = [
    "JSON_PARSED",
    "JSON_STRINGIFIED",
    "JsonFormat",
    "LiteValue",
    "is_array",
    "is_array_column",
    "is_enum",
    "is_enum_column",
    "is_nullable",
    "lite_row",
    "lite_type_string",
    "lite_value",
    "upstream_data_type",
    "zql_value_type",
]

JsonFormat = Literal["p", "s"]
JSON_PARSED: Final = "p"
JSON_STRINGIFIED: Final = "s"

LiteValue = int | float | str | bytes | None

NOT_NULL: Final = "|NOT_NULL"
# "TEXT" in the attribute gives enum and array columns TEXT affinity in SQLite.
TEXT_ENUM: Final = "|TEXT_ENUM"
TEXT_ARRAY: Final = "|TEXT_ARRAY"

PG_TYPE_CLASS_ENUM: Final = "e"

_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1

_NUMBER_TYPES: Final = frozenset(
    {
        "smallint", "integer", "int", "int2", "int4", "int8", "bigint",
        "smallserial", "serial", "serial2", "serial4", "serial8", "bigserial",
        "decimal", "numeric", "real", "double precision", "float", "float4", "float8",
        "date", "time", "timetz", "time with time zone", "time without time zone",
        "timestamp", "timestamptz", "timestamp with time zone",
        "timestamp without time zone",
    }
)  # fmt: skip
_STRING_TYPES: Final = frozenset(
    {
        "bpchar", "character", "character varying", "text", "varchar",
        "cidr", "ean13", "inet", "isbn", "isbn13", "ismn", "ismn13", "issn", "issn13",
        "macaddr", "macaddr8", "pg_lsn", "upc", "uuid",
    }
)  # fmt: skip


def lite_type_string(data_type: str, not_null: bool | None, is_enum: bool, is_array: bool) -> str:
    """The declared SQLite type for an upstream column (see the module docstring)."""
    if "|" in data_type:
        raise ReplicaError(f"upstream type {data_type!r} must not contain '|'")
    return (
        data_type
        + (NOT_NULL if not_null else "")
        + (TEXT_ENUM if is_enum else "")
        + (TEXT_ARRAY if is_array else "")
    )


def is_enum_column(spec: Mapping[str, Any]) -> bool:
    """An enum, or an array of enums (ColumnSpec ``pgTypeClass``/``elemPgTypeClass``)."""
    elem = spec.get("elemPgTypeClass")
    return (elem if elem is not None else spec.get("pgTypeClass")) == PG_TYPE_CLASS_ENUM


def is_array_column(spec: Mapping[str, Any]) -> bool:
    """Array columns are the ones with an element type class."""
    return spec.get("elemPgTypeClass") is not None


def upstream_data_type(lite_type: str) -> str:
    """``"int8|NOT_NULL"`` → ``"int8"``."""
    delim = lite_type.find("|")
    return lite_type[:delim] if delim > 0 else lite_type


def is_nullable(lite_type: str) -> bool:
    return NOT_NULL not in lite_type


def is_enum(lite_type: str) -> bool:
    return TEXT_ENUM in lite_type


def is_array(lite_type: str) -> bool:
    # Replicas written before |TEXT_ARRAY existed mark arrays with "[]" only.
    return TEXT_ARRAY in lite_type or "[]" in lite_type


@functools.lru_cache(maxsize=1024)
def zql_value_type(lite_type: str) -> str | None:
    """``number``, ``string``, ``boolean`` or ``json``; None for types zero cannot sync.

    Cached (a table has few distinct column types): ``lite_value`` asks it for every
    value the replica writes and initial sync loads."""
    if is_array(lite_type):
        return "json"
    base = upstream_data_type(lite_type).lower()
    paren = base.find("(")
    if paren != -1:
        base = base[:paren]
    if base in _NUMBER_TYPES:
        return "number"
    if base in _STRING_TYPES:
        return "string"
    if base in ("bool", "boolean"):
        return "boolean"
    if base in ("json", "jsonb"):
        return "json"
    return "string" if is_enum(lite_type) else None


def lite_value(value: Any, lite_type: str, json_format: JsonFormat) -> LiteValue:
    """One upstream JSON value as the SQLite value zero stores for it."""
    if value is None:
        return None
    if zql_value_type(lite_type) == "json":
        if json_format == JSON_STRINGIFIED and isinstance(value, str):
            return value
        return dumps(value)
    if value is True:
        return 1
    if value is False:
        return 0
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            # An integral double written without an exponent (JavaScript, and our
            # codec, print them in full below 1e21: float8 1e19 arrives as
            # 10000000000000000000); Postgres integer types never get here. SQLite
            # stores it as the REAL it is, as the initial sync does.
            return float(value)
        return value
    if isinstance(value, (str, float)):
        return value
    if isinstance(value, list):
        # zero stores non-JSON arrays with their booleans as 0/1.
        return dumps(_booleans_as_ints(value))
    if isinstance(value, dict):
        return dumps(value)
    raise ReplicaError(f"value of type {type(value).__name__} is not a JSON value")


def lite_row(
    row: Mapping[str, Any],
    columns: Mapping[str, str],
    json_format: JsonFormat,
    table: str,
) -> dict[str, LiteValue]:
    """Converts every value of ``row``; ``columns`` maps column name → lite type."""
    out: dict[str, LiteValue] = {}
    for name, value in row.items():
        lite_type = columns.get(name)
        if lite_type is None:
            raise ReplicaError(f"unknown column {name!r} in table {table!r}")
        out[name] = lite_value(value, lite_type, json_format)
    return out


def _booleans_as_ints(value: Any) -> Any:
    if value is True:
        return 1
    if value is False:
        return 0
    if isinstance(value, list):
        return [_booleans_as_ints(v) for v in value]
    return value
