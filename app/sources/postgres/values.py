"""Postgres text values → the JSON values the reference emits (spec source.md §1.5, §7).

A :class:`TypeRegistry` knows, per type OID, whether the type is an array (of which
element type, split on which delimiter), a domain (over which base type) or a scalar,
and hands out one cached parser per ``(oid, json_as_string)``.  Built-in types are
known statically; :func:`load_type_registry` reads ``pg_type`` so user types (enums,
domains, arrays of either) resolve too.  Unknown OIDs parse as the text itself.

The rules (zero's ``types/pg.ts`` and postgres.js' defaults):

=================================  =====================================================
bool                               ``t`` → true, ``f`` → false
int2, int4, oid, int8              exact int (int8 is never a float)
float4, float8, numeric            number (numeric through a double, as ``Number(text)``)
json, jsonb                        the raw text if ``json_as_string``, else parsed
timestamp, timestamptz             ms since the Unix epoch, microseconds kept as fraction
time, timetz                       integer ms since midnight UTC (offset subtracted,
                                   wrapped into 0..86400000, sub-ms truncated)
date                               ms since the epoch at that date's UTC midnight
arrays                             lists, elements by the element type's rule; json[] and
                                   jsonb[] elements are always *parsed*
everything else (text, uuid, ...)  the text as Postgres sent it
=================================  =====================================================

Numbers that are integral and within ±2^53 are returned as ``int``: JavaScript prints
``1.0`` as ``1`` anyway, so the JSON text is identical, and the project's codec writes
ints on its fast path.  Timestamps are computed from integer microseconds and divided by
1000 once, so the result is the correctly rounded double of the exact value.

Differs from the reference (on purpose; the reference's output is wrong or lossy there):

* NULL array elements are ``null`` for every element type.  The reference crashes on an
  ``int8[]`` with a NULL and turns the NULLs of ``text[]`` into the string ``"NULL"``.
  A quoted ``"NULL"`` element stays the string ``"NULL"``.
* Timestamps before 1970 with fractional seconds are exact; the reference shifts
  them by a second.
* BC dates and timestamps, and years past 9999, are the exact epoch milliseconds in the
  proleptic Gregorian calendar with astronomical year numbering (1 BC = year 0, as
  JavaScript's ``Date``); the reference gives ``null`` for BC dates.
* NaN, Infinity and -Infinity of float4/float8/numeric are the strings ``"NaN"``,
  ``"Infinity"``, ``"-Infinity"``; ``infinity``/``-infinity`` timestamps and dates are
  the strings ``"infinity"``/``"-infinity"`` (Postgres' spelling, so a consumer can
  write them back).  The reference writes ``null`` for all of these.
* A finite numeric beyond the double range (``1e400``) is its text, not ``null``.
* Timestamp/time offsets with seconds (``+05:30:15``, seen for historical zones) are
  understood; the reference rejects them.
* Domains parse as their base type (a domain over ``int4[]`` gives a list); the
  reference gives the text for every domain.
* Array literals with a ``[lo:hi]=`` bounds prefix parse (the bounds are dropped).
* ``bytea`` is its text (``\\x...``); the reference hands a Node ``Buffer`` onward.
* Malformed text raises :class:`PgValueError` naming the type; the reference maps some
  of it silently (e.g. any bool other than ``t`` is false).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from app.protocol import canonical_json
from app.sources.postgres.pgarray import parse_array

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "JSONValue",
    "PgValueError",
    "TypeInfo",
    "TypeRegistry",
    "ValueParser",
    "load_type_registry",
    "parse_date",
    "parse_time",
    "parse_timestamp",
    "parser_kind",
]

JSONValue: TypeAlias = "bool | int | float | str | list[JSONValue] | dict[str, JSONValue] | None"
ValueParser: TypeAlias = Callable[[str], JSONValue]


class PgValueError(ValueError):
    """A Postgres text value that does not parse as its column's type."""

    def __init__(self, type_name: str, text: str, reason: str) -> None:
        shown = text if len(text) <= 200 else text[:200] + "..."
        super().__init__(f"invalid {type_name} value {shown!r}: {reason}")
        self.type_name = type_name
        self.text = text


# --- scalar OIDs ----------------------------------------------------------------------

BOOL: Final = 16
BYTEA: Final = 17
INT8: Final = 20
INT2: Final = 21
INT4: Final = 23
TEXT: Final = 25
OID: Final = 26
JSON: Final = 114
FLOAT4: Final = 700
FLOAT8: Final = 701
DATE: Final = 1082
TIME: Final = 1083
TIMESTAMP: Final = 1114
TIMESTAMPTZ: Final = 1184
TIMETZ: Final = 1266
NUMERIC: Final = 1700
JSONB: Final = 3802

_MAX_SAFE_INT: Final = 2**53
_EPOCH: Final = datetime(1970, 1, 1)
_EPOCH_UTC: Final = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_ORDINAL: Final = _EPOCH.toordinal()
_ONE_US: Final = timedelta(microseconds=1)
_MS_PER_DAY: Final = 86_400_000
_US_PER_DAY: Final = 86_400_000_000


# --- numbers and bools ----------------------------------------------------------------


def _parse_int(type_name: str) -> ValueParser:
    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise PgValueError(type_name, text, "not an integer") from None

    return parse


def _finite_or_name(x: float) -> float | int | str:
    if math.isfinite(x):
        # JS prints an integral double like an int; an int takes the codec's fast path.
        if x.is_integer() and -_MAX_SAFE_INT <= x <= _MAX_SAFE_INT:
            return int(x)
        return x
    if x != x:
        return "NaN"
    return "Infinity" if x > 0 else "-Infinity"


def _parse_float(type_name: str) -> ValueParser:
    def parse(text: str) -> float | int | str:
        try:
            return _finite_or_name(float(text))
        except ValueError:
            raise PgValueError(type_name, text, "not a number") from None

    return parse


_SHORT_INTEGER: Final = re.compile(r"-?\d{1,15}")


def _parse_numeric(text: str) -> float | int | str:
    if _SHORT_INTEGER.fullmatch(text):
        return int(text)  # exact, and below 2^53 the same number a double holds
    try:
        x = float(text)
    except ValueError:
        raise PgValueError("numeric", text, "not a number") from None
    if math.isinf(x) and text.lstrip("+-").lower() not in ("infinity", "inf"):
        return text  # finite, but beyond a double: keep every digit rather than null
    return _finite_or_name(x)


_BOOLS: Final = {"t": True, "f": False}


def _parse_bool(text: str) -> bool:
    try:
        return _BOOLS[text]
    except KeyError:
        raise PgValueError("bool", text, "expected 't' or 'f'") from None


def _json_parser(type_name: str) -> ValueParser:
    def parse(text: str) -> Any:
        try:
            return canonical_json.loads(text)
        except ValueError as e:
            raise PgValueError(type_name, text, f"not JSON ({e})") from None

    return parse


# --- dates and times ------------------------------------------------------------------


def _days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (year 0 = 1 BC).

    Howard Hinnant's algorithm: count from a March-based year so the leap day is last,
    in 400-year eras (146097 days each); Python's floor division makes it exact for
    negative years too, where ``datetime`` cannot go.
    """
    if month <= 2:
        year -= 1
    era = year // 400
    yoe = year - era * 400
    doy = (153 * ((month + 9) % 12) + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


# Years of at most 7 digits: Postgres' own end at 5874897 (dates) and 294276
# (timestamps), and longer ones would overflow a double (or int()) instead of failing
# as a PgValueError.
_DATE_RE: Final = re.compile(r"(\d{4,7})-(\d\d)-(\d\d)( BC)?")
_TIMESTAMP_RE: Final = re.compile(
    r"(\d{4,7})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
    r"(?:([+-])(\d\d?)(?::(\d\d))?(?::(\d\d))?)?( BC)?"
)
_TIME_RE: Final = re.compile(
    r"(\d\d?):(\d\d):(\d\d)(?:\.(\d{1,6}))?(?:([+-])(\d\d?)(?::(\d\d))?(?::(\d\d))?)?"
)
_INFINITIES: Final = ("infinity", "-infinity")


def _epoch_day(type_name: str, text: str, y: str, m: str, d: str, bc: str | None) -> int:
    year, month, day = int(y), int(m), int(d)
    if not (1 <= month <= 12 and 1 <= day <= 31):
        raise PgValueError(type_name, text, "month or day out of range")
    if bc:
        if year == 0:
            raise PgValueError(type_name, text, "there is no year 0 BC")
        year = 1 - year  # 1 BC is astronomical year 0
    return _days_from_civil(year, month, day)


def _offset_us(sign: str | None, hh: str | None, mm: str | None, ss: str | None) -> int:
    if sign is None:
        return 0
    seconds = int(hh or 0) * 3600 + int(mm or 0) * 60 + int(ss or 0)
    return seconds * 1_000_000 if sign == "+" else -seconds * 1_000_000


def _ms(us: int) -> float | int:
    # One division of the exact integer: correctly rounded, whatever the sign.
    if us % 1000:
        return us / 1000
    return _safe(us // 1000)


def _safe(ms: int) -> float | int:
    # zero reads integers beyond 2^53 as BigInt, which a timestamp must never be.
    return ms if -_MAX_SAFE_INT <= ms <= _MAX_SAFE_INT else float(ms)


def _timestamp_parser(type_name: str) -> Callable[[str], float | int | str]:
    def parse(text: str) -> float | int | str:
        # Fast path: datetime's C parser covers years 1-9999 with any offset it knows.
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            pass
        else:
            epoch = _EPOCH if parsed.tzinfo is None else _EPOCH_UTC
            us = (parsed - epoch) // _ONE_US
            return _ms(us)
        m = _TIMESTAMP_RE.fullmatch(text)
        if m is None:
            if text in _INFINITIES:
                return text
            raise PgValueError(type_name, text, "expected ISO 'YYYY-MM-DD HH:MM:SS[.f][+TZ][ BC]'")
        y, mo, d, hh, mi, ss, frac, sign, oh, om, os_, bc = m.groups()
        hour, minute, second = int(hh), int(mi), int(ss)
        if hour > 23 or minute > 59 or second > 59:
            raise PgValueError(type_name, text, "time of day out of range")
        days = _epoch_day(type_name, text, y, mo, d, bc)
        us = (days * 86400 + hour * 3600 + minute * 60 + second) * 1_000_000
        if frac:
            us += int(frac.ljust(6, "0"))
        us -= _offset_us(sign, oh, om, os_)
        return _ms(us)

    return parse


_parse_timestamptz: Final = _timestamp_parser("timestamptz")


def parse_timestamp(text: str) -> float | int | str:
    """A ``timestamp``/``timestamptz`` text as ms since the Unix epoch (see module doc)."""
    return _parse_timestamptz(text)


def parse_date(text: str) -> float | int | str:
    """A ``date`` text as ms since the Unix epoch at that day's UTC midnight."""
    if len(text) == 10:  # YYYY-MM-DD: the C parser
        try:
            return (date.fromisoformat(text).toordinal() - _EPOCH_ORDINAL) * _MS_PER_DAY
        except ValueError:
            pass
    m = _DATE_RE.fullmatch(text)
    if m is None:
        if text in _INFINITIES:
            return text
        raise PgValueError("date", text, "expected ISO 'YYYY-MM-DD[ BC]'")
    return _safe(_epoch_day("date", text, *m.groups()) * _MS_PER_DAY)


def _time_parser(type_name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        m = _TIME_RE.fullmatch(text)
        if m is None:
            raise PgValueError(type_name, text, "expected 'HH:MM:SS[.f][+TZ]'")
        hh, mi, ss, frac, sign, oh, om, os_ = m.groups()
        hour, minute, second = int(hh), int(mi), int(ss)
        if minute > 59 or second > 59 or hour > 24:
            raise PgValueError(type_name, text, "time of day out of range")
        # Sub-millisecond digits are truncated, as the reference does.
        ms = (hour * 3600 + minute * 60 + second) * 1000 + (
            int(frac[:3].ljust(3, "0")) if frac else 0
        )
        if hour == 24 and ms != _MS_PER_DAY:
            raise PgValueError(type_name, text, "24:00:00 is the only time past 23:59:59")
        if sign is not None:
            ms -= _offset_us(sign, oh, om, os_) // 1000
            # 86400000 itself (24:00:00) is kept, as the reference keeps it.
            if ms < 0 or ms > _MS_PER_DAY:
                ms %= _MS_PER_DAY
        return ms

    return parse


_parse_time: Final = _time_parser("time")


def parse_time(text: str) -> int:
    """A ``time``/``timetz`` text as integer ms since midnight UTC."""
    return _parse_time(text)


# --- the registry ---------------------------------------------------------------------

_SCALARS: Final[dict[int, tuple[str, ValueParser]]] = {
    BOOL: ("bool", _parse_bool),
    INT8: ("int8", _parse_int("int8")),
    INT2: ("int2", _parse_int("int2")),
    INT4: ("int4", _parse_int("int4")),
    OID: ("oid", _parse_int("oid")),
    FLOAT4: ("float4", _parse_float("float4")),
    FLOAT8: ("float8", _parse_float("float8")),
    NUMERIC: ("numeric", _parse_numeric),
    JSON: ("json", _json_parser("json")),
    JSONB: ("jsonb", _json_parser("jsonb")),
    TIMESTAMP: ("timestamp", _timestamp_parser("timestamp")),
    TIMESTAMPTZ: ("timestamptz", _parse_timestamptz),
    TIME: ("time", _parse_time),
    TIMETZ: ("timetz", _time_parser("timetz")),
    DATE: ("date", parse_date),
}


# What a parser does, for the C row decoder (app/sources/postgres/_pgrows.c), which
# converts the commonest kinds itself and calls the parser for the rest.
KIND_CALL: Final = 0  # call the parser
KIND_TEXT: Final = 1  # the text itself (the parser is ``str``)
KIND_INT: Final = 2  # int(text), exact
KIND_BOOL: Final = 3  # 't' / 'f'
_INT_PARSERS: Final = frozenset(_SCALARS[oid][1] for oid in (INT2, INT4, INT8, OID))


def parser_kind(parser: ValueParser) -> int:
    """Which of the kinds above ``parser`` (from :meth:`TypeRegistry.parser`) is."""
    if parser is str:
        return KIND_TEXT
    if parser in _INT_PARSERS:
        return KIND_INT
    if parser is _parse_bool:
        return KIND_BOOL
    return KIND_CALL


@dataclass(frozen=True, slots=True)
class TypeInfo:
    """What the registry needs of one ``pg_type`` row."""

    oid: int
    name: str
    elem: int = 0  # element type, for arrays
    delimiter: str = ","  # this type's delimiter *as an array element* (box: ';')
    base: int = 0  # base type, for domains
    array: int = 0  # this type's array type


def _builtin_types() -> dict[int, TypeInfo]:
    # Built-in scalars a replicated table commonly has, with their array types.
    # (name, oid, array oid); everything else is loaded from pg_type.
    rows = [
        ("bool", BOOL, 1000),
        ("bytea", BYTEA, 1001),
        ("char", 18, 1002),
        ("name", 19, 1003),
        ("int8", INT8, 1016),
        ("int2", INT2, 1005),
        ("int4", INT4, 1007),
        ("text", TEXT, 1009),
        ("oid", OID, 1028),
        ("json", JSON, 199),
        ("xml", 142, 143),
        ("point", 600, 1017),
        ("lseg", 601, 1018),
        ("path", 602, 1019),
        ("box", 603, 1020),
        ("polygon", 604, 1027),
        ("line", 628, 629),
        ("cidr", 650, 651),
        ("float4", FLOAT4, 1021),
        ("float8", FLOAT8, 1022),
        ("circle", 718, 719),
        ("macaddr8", 774, 775),
        ("money", 790, 791),
        ("macaddr", 829, 1040),
        ("inet", 869, 1041),
        ("bpchar", 1042, 1014),
        ("varchar", 1043, 1015),
        ("date", DATE, 1182),
        ("time", TIME, 1183),
        ("timestamp", TIMESTAMP, 1115),
        ("timestamptz", TIMESTAMPTZ, 1185),
        ("interval", 1186, 1187),
        ("timetz", TIMETZ, 1270),
        ("bit", 1560, 1561),
        ("varbit", 1562, 1563),
        ("numeric", NUMERIC, 1231),
        ("uuid", 2950, 2951),
        ("tsvector", 3614, 3643),
        ("tsquery", 3615, 3645),
        ("jsonb", JSONB, 3807),
        ("jsonpath", 4072, 4073),
        ("int4range", 3904, 3905),
        ("numrange", 3906, 3907),
        ("tsrange", 3908, 3909),
        ("tstzrange", 3910, 3911),
        ("daterange", 3912, 3913),
        ("int8range", 3926, 3927),
    ]
    types: dict[int, TypeInfo] = {}
    for name, oid, array in rows:
        types[oid] = TypeInfo(oid, name, delimiter=";" if oid == 603 else ",", array=array)
        types[array] = TypeInfo(array, "_" + name, elem=oid)
    return types


_BUILTIN_TYPES: Final = _builtin_types()
_MAX_DOMAIN_DEPTH: Final = 32


class TypeRegistry:
    """Type OIDs → cached value parsers (see the module docstring for the rules)."""

    def __init__(self, types: dict[int, TypeInfo] | None = None) -> None:
        self._types: dict[int, TypeInfo] = dict(_BUILTIN_TYPES)
        if types:
            self._types.update(types)
        self._parsers: tuple[dict[int, ValueParser], dict[int, ValueParser]] = ({}, {})

    def knows(self, type_oid: int) -> bool:
        """Whether ``type_oid`` is a type this registry has a row for."""
        return type_oid in self._types or type_oid in _SCALARS

    def type_name(self, type_oid: int) -> str:
        info = self._types.get(type_oid)
        return info.name if info is not None else str(type_oid)

    def parser(self, type_oid: int, *, json_as_string: bool) -> ValueParser:
        """The parser for values of ``type_oid``; cached, so call it once per column."""
        cache = self._parsers[json_as_string]
        parser = cache.get(type_oid)
        if parser is None:
            parser = cache[type_oid] = self._build(type_oid, json_as_string)
        return parser

    def _build(self, type_oid: int, json_as_string: bool) -> ValueParser:
        oid = self._resolve_domain(type_oid)
        scalar = _SCALARS.get(oid)
        if scalar is not None:
            if json_as_string and oid in (JSON, JSONB):
                return str  # the text as sent: str(s) is s
            return scalar[1]
        info = self._types.get(oid)
        if info is None or not info.elem:
            return str
        elem = self._types.get(info.elem)
        if elem is None or elem.array != oid:
            # Only the canonical array of a type is an array: int2vector, oidvector and
            # point also have an element type but their own text format.
            return str
        # json[] elements are parsed even when json columns are sent as text.
        element = self.parser(info.elem, json_as_string=False)
        delimiter = elem.delimiter
        type_name = info.name

        def parse(text: str) -> list[Any]:
            try:
                return parse_array(text, element, delimiter)
            except PgValueError:
                raise
            except ValueError as e:
                raise PgValueError(type_name, text, str(e)) from None

        return parse

    def _resolve_domain(self, oid: int) -> int:
        for _ in range(_MAX_DOMAIN_DEPTH):
            info = self._types.get(oid)
            if info is None or not info.base:
                return oid
            oid = info.base
        raise ValueError(f"domain type {oid} nests deeper than {_MAX_DOMAIN_DEPTH} levels")


_TYPES_QUERY: Final = (
    "SELECT oid::int8, typname::text, typelem::int8, typdelim::text, typbasetype::int8, "
    "typarray::int8 FROM pg_catalog.pg_type WHERE typtype IN ('b', 'd', 'e', 'r', 'm', 'c')"
)


async def load_type_registry(conn: psycopg.AsyncConnection[Any]) -> TypeRegistry:
    """A registry with every type of the connected database (on a normal connection).

    Pseudo-types (``typtype = 'p'``) are left out; nothing has columns of them.
    """
    async with conn.cursor() as cur:
        await cur.execute(_TYPES_QUERY)
        rows = await cur.fetchall()
    types: dict[int, TypeInfo] = {}
    for oid, name, elem, delim, base, array in rows:
        types[int(oid)] = TypeInfo(
            int(oid), str(name), int(elem), str(delim), int(base), int(array)
        )
    return TypeRegistry(types)
