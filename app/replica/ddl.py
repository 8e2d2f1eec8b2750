"""SQL text for the replica's tables and indexes, built from upstream specs as zero does.

Upstream table/column/index specs (spec/source.md §1.6) map to SQLite like this:

* table and index names: ``name`` in schema ``public``, else ``schema.name``;
* every column's declared type is its lite type string (:mod:`app.replica.lite_types`),
  quoted as an identifier; no NOT NULL, no PRIMARY KEY (unique indexes stand in for
  keys), and defaults only for added columns (a new table has no rows to fill);
* every table gets a last column ``_0_version`` (the row version), declared ``"text"``,
  with the replica version as its default when initial sync creates the table;
* only a few default expressions translate to SQLite, each a literal (see
  :func:`map_default`, the one place this rule lives: the Postgres source decides
  "backfill or default" with it and the custom source refuses other defaults with
  it); any other raises :class:`~app.replica.errors.UnsupportedColumnDefaultError`
  (upstream backfills such columns instead). The default is SQL text spliced into
  ``ALTER TABLE … ADD … DEFAULT``, so nothing else may reach it.

The statement text matches zero's, so ``sqlite_master.sql`` reads the same
(``tests/replica/test_reference_parity.py`` compares whole files).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from app.replica.errors import ReplicaError, UnsupportedColumnDefaultError
from app.replica.lite_types import (
    TEXT_ARRAY,
    is_array_column,
    is_enum_column,
    lite_type_string,
)

__all__ = [
    "ZERO_VERSION_COLUMN",
    "LiteColumn",
    "column_def",
    "create_index_statement",
    "create_table_statement",
    "lite_column",
    "lite_table_columns",
    "lite_table_name",
    "map_default",
    "quote_id",
    "shown_default",
]

ZERO_VERSION_COLUMN: Final = "_0_version"
# JavaScript's Number.MAX_SAFE_INTEGER: zero's position for _0_version ("last").
_LAST_POS: Final = 2**53 - 1

# The defaults map_default accepts (always with fullmatch, ASCII only): each is one SQL
# literal, so the text it returns cannot carry anything else into the DDL.
_NUMERIC_LITERAL: Final = re.compile(r"-?\d+(\.\d+)?", re.ASCII)
# One SQL string literal (a quote inside doubled, no NUL: Postgres text holds none),
# then a cast to a simple type name. zero's pattern, "('.*')::(\w+)", has a greedy ".*"
# that also takes "'x' CHECK (0) COLLATE 'binary'" (or "'x'; DROP TABLE t; SELECT 'y'")
# as "the quoted string": SQL an upstream could inject (issue 25).
_QUOTED_WITH_CAST: Final = re.compile(r"('(?:[^'\x00]|'')*')::\w+", re.ASCII)
_EMPTY_ARRAY_CONSTRUCTOR: Final = re.compile(r"ARRAY\s*\[\s*\]::\w+\[\]", re.ASCII | re.IGNORECASE)
_EMPTY_ARRAY_LITERAL: Final = re.compile(r"'\{\}'::\w+\[\]", re.ASCII)
# How much of a refused default an error message shows.
_SHOWN_CHARS: Final = 80
# A legacy form zero refuses to write: attributes followed by "[]".
_INVALID_TYPE: Final = re.compile(r".+\|.*\[\]", re.DOTALL)


@dataclass(frozen=True, slots=True)
class LiteColumn:
    """A replica column: position, declared type, NOT NULL, default (SQL text)."""

    pos: float
    data_type: str
    not_null: bool = False
    dflt: str | None = None
    is_array: bool = False


def quote_id(name: str) -> str:
    """An SQL identifier in double quotes."""
    return '"' + name.replace('"', '""') + '"'


def lite_table_name(schema: str, name: str) -> str:
    return name if schema == "public" else f"{schema}.{name}"


def map_default(table: str, column: str, dflt: str | None) -> str | None:
    """The SQLite default for an upstream default expression, which must be a literal.

    Accepted (the whole text, ASCII): ``None`` or ``""`` (no default); a number
    ``-?\\d+(\\.\\d+)?`` (as is); ``true`` / ``false`` (``1`` / ``0``); one single-quoted
    string, quotes inside doubled, cast to a simple type name, as Postgres writes
    constants (``'abc'::text``, ``'2147483648'::bigint``; the string alone is kept);
    an empty array, ``ARRAY[]::T[]`` or ``'{}'::T[]`` (``'[]'``). Anything else (a
    call, an operator, a subquery, a bare string, ``NULL::T``, ``'{a}'::text[]``, SQL
    after the literal) raises :class:`UnsupportedColumnDefaultError`, one line.
    """
    if not dflt:
        return None
    if _NUMERIC_LITERAL.fullmatch(dflt):
        return dflt
    if dflt in ("true", "false"):
        return "1" if dflt == "true" else "0"
    match = _QUOTED_WITH_CAST.fullmatch(dflt)
    if match:
        return match.group(1)
    if _EMPTY_ARRAY_CONSTRUCTOR.fullmatch(dflt) or _EMPTY_ARRAY_LITERAL.fullmatch(dflt):
        return "'[]'"
    raise UnsupportedColumnDefaultError(
        f"Unsupported default value for {table}.{column}: {shown_default(dflt)}"
    )


def shown_default(dflt: str) -> str:
    """A default for a one-line message: as is if short and printable, else its repr, cut."""
    if len(dflt) <= _SHOWN_CHARS and dflt.isprintable():
        return dflt
    return repr(dflt if len(dflt) <= _SHOWN_CHARS else dflt[:_SHOWN_CHARS] + "...")


def lite_column(
    table: str, name: str, spec: Mapping[str, Any], *, ignore_default: bool
) -> LiteColumn:
    """The replica column for an upstream ColumnSpec."""
    data_type = spec.get("dataType")
    pos = spec.get("pos")
    if not isinstance(data_type, str) or isinstance(pos, bool) or not isinstance(pos, int | float):
        raise ReplicaError(f"invalid column spec for {table}.{name}: {spec!r}")
    array = is_array_column(spec)
    return LiteColumn(
        pos=pos,
        data_type=lite_type_string(data_type, spec.get("notNull"), is_enum_column(spec), array),
        dflt=None if ignore_default else map_default(table, name, spec.get("dflt")),
        is_array=array,
    )


def lite_table_columns(
    table: str, columns: Mapping[str, Any], default_version: str | None = None
) -> dict[str, LiteColumn]:
    """A new table's columns (defaults ignored), plus ``_0_version``."""
    out: dict[str, LiteColumn] = {}
    for name, spec in columns.items():
        if not isinstance(spec, Mapping):
            raise ReplicaError(f"invalid column spec for {table}.{name}: {spec!r}")
        out[name] = lite_column(table, name, spec, ignore_default=True)
    out[ZERO_VERSION_COLUMN] = LiteColumn(
        pos=_LAST_POS,
        data_type="text",
        dflt=f"'{default_version}'" if default_version else None,
    )
    return out


def column_def(column: LiteColumn) -> str:
    """``"type" [NOT NULL] [DEFAULT x]`` for CREATE TABLE and ADD COLUMN."""
    data_type = column.data_type
    # zero refuses these inconsistent types; a replica holding one would not load there.
    if (TEXT_ARRAY in data_type) != ("[]" in data_type) or ("[]" in data_type) != (column.is_array):
        raise ReplicaError(
            f"array type {data_type!r} needs both '[]' and an element type class (elemPgTypeClass)"
        )
    if _INVALID_TYPE.fullmatch(data_type):
        raise ReplicaError(f"invalid column type {data_type!r}")
    out = quote_id(data_type)
    if column.not_null:
        out += " NOT NULL"
    if column.dflt:
        out += f" DEFAULT {column.dflt}"
    return out


def create_table_statement(name: str, columns: Mapping[str, LiteColumn]) -> str:
    ordered = sorted(columns.items(), key=lambda item: item[1].pos)
    defs = ",\n".join(f"{quote_id(col)} {column_def(spec)}" for col, spec in ordered)
    return f"CREATE TABLE {quote_id(name)} (\n{defs}\n);"


def create_index_statement(
    name: str, table: str, columns: Mapping[str, str], *, unique: bool
) -> str:
    cols = ",".join(f"{quote_id(col)} {direction}" for col, direction in columns.items())
    return (
        f"CREATE {'UNIQUE ' if unique else ''}INDEX {quote_id(name)} ON {quote_id(table)} ({cols});"
    )
