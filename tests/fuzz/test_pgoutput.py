"""pgoutput frames and rows (app/sources/postgres/pgoutput.py, mapper.py, values.py, _pgrows.c).

Every CopyData frame of the replication connection goes through ``parse_copy_data``
and its payload through ``decode_message`` (``PgOutputError`` for bad bytes), then
``ChangeMapper.map`` (``MappingError``: the stream turns it into reset-required).
Row changes take the C decoder first: ``map_common`` returns None (the Python path
decides) or exactly what ``map(decode_message(payload))`` gives. A column value a
parser refuses is a ``PgValueError`` naming its type, and every mapped change
serializes, since it is stored and forwarded as canonical JSON.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence
from typing import Any, Final

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from app.protocol.canonical_json import dumps
from app.sources.postgres import mapper as mapper_module
from app.sources.postgres.ddl import DdlError, DdlEventProcessor
from app.sources.postgres.mapper import ChangeMapper, MappingError, ShardId
from app.sources.postgres.pgoutput import (
    UNCHANGED_TOAST,
    Delete,
    Insert,
    PgOutputError,
    PgOutputMessage,
    PrimaryKeepalive,
    TupleData,
    Update,
    XLogData,
    decode_message,
    parse_copy_data,
)
from app.sources.postgres.values import (
    BOOL,
    DATE,
    FLOAT4,
    FLOAT8,
    INT2,
    INT4,
    INT8,
    JSON,
    JSONB,
    NUMERIC,
    TEXT,
    TIME,
    TIMESTAMP,
    TIMESTAMPTZ,
    TIMETZ,
    PgValueError,
    TypeRegistry,
    parse_date,
    parse_timestamp,
)
from tests.fuzz.conftest import fuzz_settings, mutated, mutated_json

# map_common runs the helper the mapper loaded: none when not built, or with
# CHANGESTREAMER_SPEEDUPS=0 (then it always defers, and there is nothing to compare).
needs_c = pytest.mark.skipif(
    mapper_module._pgrows is None,
    reason="the mapper runs no _pgrows (not built, or CHANGESTREAMER_SPEEDUPS=0)",
)

REL_OID: Final = 0x80000010  # above 2**31: unsigned on the wire, signed in the output
TOAST: Final = "TOAST"  # marks an unchanged TOASTed value in a generated row
INT8_ARRAY, TEXT_ARRAY, JSONB_ARRAY, DATE_ARRAY, BOX_ARRAY = 1016, 1009, 3807, 1182, 1020

# (name, type OID, is key): every kind the C decoder converts, and many it calls.
COLUMNS: Final = [
    ("id", INT8, True),
    ("n", INT4, True),
    ("s", INT2, False),
    ("flag", BOOL, False),
    ("title", TEXT, False),
    ("x", FLOAT8, False),
    ("f", FLOAT4, False),
    ("j", JSONB, False),
    ("jt", JSON, False),
    ("amount", NUMERIC, False),
    ("at", TIMESTAMPTZ, False),
    ("local", TIMESTAMP, False),
    ("day", DATE, False),
    ("t", TIME, False),
    ("tz", TIMETZ, False),
    ("ids", INT8_ARRAY, False),
    ("tags", TEXT_ARRAY, False),
    ("docs", JSONB_ARRAY, False),
    ("days", DATE_ARRAY, False),
    ("boxes", BOX_ARRAY, False),
    ("other", 2950, False),  # uuid: the text itself
    ("unknown", 99999, False),  # not in the registry: the text itself
]

# --- encoding ------------------------------------------------------------------------------


def cstring(text: str | bytes) -> bytes:
    return (text.encode() if isinstance(text, str) else text) + b"\x00"


def tuple_data(values: Sequence[str | bytes | None]) -> bytes:
    """TupleData: None is NULL, TOAST unchanged, bytes a text value as raw bytes,
    ``b"\\x00b..."`` a binary value (the mapper refuses those)."""
    out = struct.pack(">h", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v == TOAST:
            out += b"u"
        elif isinstance(v, bytes) and v.startswith(b"\x00b"):
            out += b"b" + struct.pack(">i", len(v) - 2) + v[2:]
        else:
            raw = v if isinstance(v, bytes) else v.encode("utf-8", "surrogatepass")
            out += b"t" + struct.pack(">i", len(raw)) + raw
    return out


def relation_message(
    columns: Sequence[tuple[str, int, bool]], *, oid: int = REL_OID, ident: bytes = b"d"
) -> bytes:
    out = b"R" + struct.pack(">I", oid) + cstring("public") + cstring("items") + ident
    out += struct.pack(">h", len(columns))
    for name, type_oid, key in columns:
        out += bytes([1 if key else 0]) + cstring(name) + struct.pack(">Ii", type_oid, -1)
    return out


# --- values --------------------------------------------------------------------------------

# Built from integers and lists, not from_regex: several times cheaper per example.
digits = st.integers(0, 10**25).map(str)
long_digits = st.integers(1, 500).map(lambda n: "9" * n)
years = st.integers(0, 9_999_999).map(lambda y: f"{y:04d}") | long_digits
two = st.sampled_from(["01", "12", "13", "00", "28", "31"]) | st.integers(0, 99).map(
    lambda n: f"{n:02d}"
)
fractions = st.sampled_from(["", "", ".5", ".000001", ".123456", ".1234567", "."])
offsets = st.sampled_from(["", "", "+00", "-05", "+05:30", "+05:30:15", "+1", "-12:00", "+99"])
dates = st.builds(
    lambda y, m, d, bc: f"{y}-{m}-{d}{bc}", years, two, two, st.sampled_from(["", " BC"])
)
times = st.builds(lambda h, m, s, f, o: f"{h}:{m}:{s}{f}{o}", two, two, two, fractions, offsets)
timestamps = st.builds(lambda d, sep, t: f"{d}{sep}{t}", dates, st.sampled_from([" ", "T"]), times)
numbers = st.one_of(
    st.floats().map(repr),
    st.integers(-(10**30), 10**30).map(str),
    st.sampled_from(["1e400", "-1e-400", ".5", "5.", "1_0", " 1", "+1", "0x10", "1e"]),
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
specials = st.sampled_from(
    ["", " ", "NaN", "Infinity", "-Infinity", "infinity", "-infinity", "t", "f", "NULL", "null"]
)


def array_of(elements: st.SearchStrategy[str], delimiter: str = ",") -> st.SearchStrategy[str]:
    element = elements | st.just("NULL") | elements.map(lambda e: '"' + e.replace('"', '\\"') + '"')
    one = st.lists(element, max_size=4).map(lambda items: "{" + delimiter.join(items) + "}")
    nested = st.lists(one, min_size=1, max_size=3).map(
        lambda items: "{" + delimiter.join(items) + "}"
    )
    return one | nested | st.sampled_from(["[0:1]={1,2}", "{", "{}", "{{}", "{1,,2}", '{"a}'])


TEXTS: Final[dict[int, st.SearchStrategy[str]]] = {
    INT8: digits | digits.map(lambda d: "-" + d) | long_digits,
    INT4: digits,
    INT2: digits,
    BOOL: st.sampled_from(["t", "f", "true", "T", "tt"]),
    FLOAT8: numbers,
    FLOAT4: numbers,
    NUMERIC: numbers | long_digits,
    JSONB: json_values.map(dumps),
    JSON: json_values.map(dumps),
    TIMESTAMPTZ: timestamps,
    TIMESTAMP: timestamps,
    DATE: dates,
    TIME: times,
    TIMETZ: times,
    INT8_ARRAY: array_of(digits),
    TEXT_ARRAY: array_of(st.text(alphabet='ab ,{}"\\', max_size=4)),
    JSONB_ARRAY: array_of(json_values.map(dumps)),
    DATE_ARRAY: array_of(dates),
    BOX_ARRAY: array_of(st.just("(1,2),(3,4)"), ";"),
}


def column_values(type_oid: int, *, toast: bool) -> st.SearchStrategy[str | bytes | None]:
    values: st.SearchStrategy[str | bytes | None] = st.one_of(
        TEXTS.get(type_oid, st.text(max_size=8)),
        TEXTS.get(type_oid, st.text(max_size=8)),
        st.text(max_size=12),
        specials,
        st.binary(max_size=6),  # raw bytes: invalid UTF-8 is replaced
        st.none(),
    )
    return values | st.just(TOAST) if toast else values


# A valid value of each column, so that a row fails (if it does) where a draw put a
# generated value, not at its first column.
PLAIN_ROW: Final[list[str | bytes | None]] = [
    "1", "-2", "3", "t", "hé", "1.5", "0.25", '{"k":[1]}', "[]", "12.5",
    "2024-01-02 03:04:05.123456+00", "2024-01-02 03:04:05", "2024-01-02", "03:04:05",
    "03:04:05+02", "{1,NULL}", '{a,"b c"}', '{"{}"}', "{2024-01-02}", "{(1,2),(3,4)}",
    "4b4d6d8e-0000-4000-8000-000000000000", "?",
]  # fmt: skip


@st.composite
def rows(draw: st.DrawFn, *, toast: bool) -> list[str | bytes | None]:
    """PLAIN_ROW with a few columns drawn, and sometimes cut short."""
    row = list(PLAIN_ROW)
    for _ in range(draw(st.integers(0, 5))):
        i = draw(st.integers(0, len(COLUMNS) - 1))
        row[i] = draw(column_values(COLUMNS[i][1], toast=toast))
    return row[: draw(st.sampled_from([len(row)] * 6 + list(range(len(row)))))]


def key_tuple(row: list[Any]) -> list[Any]:
    return [v if key else None for v, (_n, _o, key) in zip(row, COLUMNS, strict=False)]


OID_BYTES: Final = struct.pack(">I", REL_OID)


@st.composite
def row_changes(draw: st.DrawFn) -> bytes:
    """An Insert, Update or Delete of the relation, valid in its framing."""
    kind = draw(st.sampled_from("IUUDD"))
    if kind == "I":
        return b"I" + OID_BYTES + b"N" + tuple_data(draw(rows(toast=False)))
    if kind == "U":
        marker = draw(st.sampled_from("NKO"))
        new = tuple_data(draw(rows(toast=True)))
        if marker == "N":
            return b"U" + OID_BYTES + b"N" + new
        old = draw(rows(toast=marker == "O"))
        if marker == "K":
            old = key_tuple(old)
        return b"U" + OID_BYTES + marker.encode() + tuple_data(old) + b"N" + new
    marker = draw(st.sampled_from("KO"))
    old = draw(rows(toast=False))
    return b"D" + OID_BYTES + marker.encode() + tuple_data(key_tuple(old) if marker == "K" else old)


# A DDL event as our triggers emit it (an ALTER TABLE adding column v), to be edited.
_ID_COLUMN: Final = {"pos": 1, "dflt": None, "notNull": True, "typeOID": 23, "dataType": "int4"}
_V_COLUMN: Final = {"pos": 2, "dflt": "1", "notNull": False, "typeOID": 25, "dataType": "text"}


def _schema(columns: dict[str, Any], ident: str) -> dict[str, Any]:
    table = {
        "oid": 10,
        "schema": "public",
        "schemaOID": 2200,
        "name": "t",
        "replicaIdentity": ident,
        "columns": columns,
        "primaryKey": ["id"],
        "publications": {"p": {"rowFilter": None}},
    }
    index = {
        "schema": "public",
        "tableName": "t",
        "name": "t_pkey",
        "unique": True,
        "isReplicaIdentity": True,
        "columns": {"id": "ASC"},
    }
    return {"tables": [table], "indexes": [index]}


DDL_EVENTS: Final = [
    {
        "type": kind,
        "version": 1,
        "event": {"tag": "ALTER TABLE"},
        "context": {"query": "ALTER TABLE t ADD v text"},
        "previousSchema": _schema({"id": _ID_COLUMN}, ident),
        "schema": _schema({"id": _ID_COLUMN, "v": _V_COLUMN}, ident),
    }
    for kind in ("ddlUpdate", "ddlStart", "schemaSnapshot")
    for ident in "dfi"
]
ddl_events = st.sampled_from(DDL_EVENTS).flatmap(lambda e: mutated_json(e, json_values))

u32, i32, u64, i64 = (
    st.integers(0, 2**32 - 1),
    st.integers(-(2**31), 2**31 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(-(2**63), 2**63 - 1),
)
names = st.text(max_size=6).filter(lambda t: "\x00" not in t)


@st.composite
def other_messages(draw: st.DrawFn) -> bytes:
    """Every other message kind, valid in its framing."""
    kind = draw(st.sampled_from("BCOYRTM"))
    if kind == "B":
        return b"B" + struct.pack(">Qqi", draw(u64), draw(i64), draw(i32))
    if kind == "C":
        return b"C" + struct.pack(
            ">BQQq", draw(st.integers(0, 255)), draw(u64), draw(u64), draw(i64)
        )
    if kind == "O":
        return b"O" + struct.pack(">Q", draw(u64)) + cstring(draw(names))
    if kind == "Y":
        return b"Y" + struct.pack(">I", draw(u32)) + cstring(draw(names)) + cstring(draw(names))
    if kind == "R":
        columns = draw(
            st.lists(
                st.tuples(names, st.sampled_from([c[1] for c in COLUMNS]) | u32, st.booleans())
            )
        )
        ident = draw(st.sampled_from([b"d", b"n", b"f", b"i", b"x"]))
        return relation_message(columns, oid=draw(st.sampled_from([REL_OID, 1]) | u32), ident=ident)
    if kind == "T":
        oids = draw(st.lists(st.sampled_from([REL_OID, 7]), max_size=3))
        return (
            b"T"
            + struct.pack(">iB", len(oids), draw(st.integers(0, 255)))
            + b"".join(struct.pack(">I", o) for o in oids)
        )
    prefix = draw(st.sampled_from(["app/0/ddl", "app/0", "app/0/lag", "other"]) | names)
    content = draw(
        st.binary(max_size=8)
        | json_values.map(lambda v: dumps(v).encode())
        | ddl_events.map(lambda v: dumps(v).encode())
    )
    return (
        b"M"
        + struct.pack(">BQ", draw(st.integers(0, 1)), draw(u64))
        + cstring(prefix)
        + struct.pack(">i", len(content))
        + content
    )


payloads = st.one_of(
    st.binary(max_size=40),
    row_changes(),
    other_messages(),
    row_changes().flatmap(mutated),
    other_messages().flatmap(mutated),
)


def python_path(mapper: ChangeMapper, payload: bytes) -> list[Any] | Exception:
    """``map(decode_message(payload))``, or the one error each of them may raise."""
    try:
        message = decode_message(payload)
    except PgOutputError as e:
        return e
    try:
        return mapper.map(message)
    except MappingError as e:
        return e


def new_mapper() -> ChangeMapper:
    mapper = ChangeMapper(ShardId("app", 0), TypeRegistry())
    assert mapper.map(decode_message(relation_message(COLUMNS))) == []
    return mapper


# --- frames and messages ----------------------------------------------------------------


@fuzz_settings()
@given(
    st.binary(max_size=40)
    | st.builds(lambda p: b"w" + bytes(24) + p, st.binary(max_size=8)).flatmap(mutated)
    | st.builds(lambda r: b"k" + bytes(16) + r, st.binary(max_size=1)).flatmap(mutated)
)
def test_a_copy_data_frame_is_wal_data_a_keepalive_or_a_pgoutput_error(frame: bytes) -> None:
    try:
        parsed = parse_copy_data(frame)
    except PgOutputError:
        return
    if isinstance(parsed, XLogData):
        assert parsed.payload == frame[25:]
    else:
        assert isinstance(parsed, PrimaryKeepalive)
        assert len(frame) == 18


@fuzz_settings(2)
@given(payloads)
@example(b"I" + OID_BYTES + b"N" + struct.pack(">h", -1))
@example(b"T" + struct.pack(">iB", 2**31 - 1, 0))
@example(b"R" + OID_BYTES + b"\x00\x00d" + struct.pack(">h", -5))
def test_a_payload_is_a_message_or_a_pgoutput_error(payload: bytes) -> None:
    with contextlib.suppress(PgOutputError):
        decode_message(payload)
    with contextlib.suppress(PgOutputError):
        decode_message(memoryview(b"\xff" + payload)[1:])


@fuzz_settings()
@given(row_changes())
def test_a_well_framed_row_change_decodes_to_text_null_or_toast_values(payload: bytes) -> None:
    message: PgOutputMessage = decode_message(payload)
    assert isinstance(message, (Insert, Update, Delete))
    assert message.relation_oid == REL_OID
    tuples: list[TupleData | None]
    if isinstance(message, Insert):
        tuples = [message.new]
    elif isinstance(message, Update):
        tuples = [message.old, message.new]
    else:
        tuples = [message.old]
    for values in tuples:
        for v in values or ():
            # bytes only where the generator wrote a binary value (b"\x00b" + data)
            assert v is None or v is UNCHANGED_TOAST or isinstance(v, (str, bytes))


# --- mapping -------------------------------------------------------------------------------


@fuzz_settings()
@given(st.lists(payloads, min_size=1, max_size=4))
def test_mapping_gives_changes_that_serialize_or_a_mapping_error(batch: list[bytes]) -> None:
    mapper = new_mapper()
    for payload in batch:
        result = python_path(mapper, payload)
        if isinstance(result, Exception):
            continue
        for message in result:
            dumps(message.as_list())


@fuzz_settings()
@given(st.lists(ddl_events, min_size=1, max_size=3))
def test_ddl_events_are_schema_changes_or_a_ddl_error(events: list[dict[str, Any]]) -> None:
    processor = DdlEventProcessor()
    for event in events:
        try:
            changes = processor.process(event)
        except DdlError:
            continue
        dumps(changes)


def test_the_plain_row_takes_the_c_path() -> None:
    payload = b"I" + OID_BYTES + b"N" + tuple_data(PLAIN_ROW)
    mapper = new_mapper()
    expected = python_path(mapper, payload)
    assert isinstance(expected, list)
    if mapper_module._pgrows is not None:
        assert [mapper.map_common(payload, 0)] == expected


@needs_c
@fuzz_settings(2)
@given(
    row_changes() | row_changes().flatmap(mutated) | st.binary(max_size=24), st.binary(max_size=3)
)
def test_the_c_row_decoder_gives_the_python_paths_data_or_defers(
    payload: bytes, head: bytes
) -> None:
    mapper = new_mapper()
    expected = python_path(mapper, payload)
    got = mapper.map_common(head + payload, len(head))
    assert got == mapper.map_common(payload, 0)
    if got is not None:
        assert [got] == expected, payload


# --- value parsers -------------------------------------------------------------------------

REGISTRY: Final = TypeRegistry()
PARSED_TYPES: Final = [oid for _, oid, _ in COLUMNS]


@fuzz_settings(2)
@given(
    st.sampled_from(PARSED_TYPES).flatmap(
        lambda oid: st.tuples(st.just(oid), column_values(oid, toast=False))
    )
)
def test_a_value_parses_to_json_or_a_pg_value_error(case: tuple[int, str | bytes | None]) -> None:
    oid, text = case
    if not isinstance(text, str):
        return
    for json_as_string in (True, False):
        try:
            value = REGISTRY.parser(oid, json_as_string=json_as_string)(text)
        except PgValueError:
            continue
        dumps([value])


@pytest.mark.parametrize("parse", [parse_date, parse_timestamp])
@pytest.mark.parametrize("year", ["9" * 400, "9" * 5000, "1" + "0" * 8])
def test_a_year_beyond_postgres_range_is_a_pg_value_error(parse: Any, year: str) -> None:
    # Found by fuzzing: years of hundreds of digits raised OverflowError (and of
    # thousands, int()'s ValueError) instead of naming the type.
    for text in (f"{year}-01-01", f"{year}-01-01 00:00:00.5", f"{year}-01-01 00:00:00+01"):
        if parse is parse_date and " " in text:
            continue
        with pytest.raises(PgValueError):
            parse(text)


def test_a_ddl_message_with_a_malformed_schema_is_a_mapping_error() -> None:
    # Found by fuzzing: a table that is not an object escaped as AttributeError.
    event = {
        "type": "ddlUpdate",
        "version": 1,
        "context": {"query": "ALTER TABLE t"},
        "event": {"tag": "ALTER TABLE"},
        "schema": {"tables": [1], "indexes": []},
    }
    content = dumps(event).encode()
    payload = (
        b"M"
        + struct.pack(">BQ", 1, 0)
        + cstring("app/0/ddl")
        + struct.pack(">i", len(content))
        + content
    )
    with pytest.raises(MappingError, match="invalid ddl event"):
        new_mapper().map(decode_message(payload))


@pytest.mark.parametrize(
    "event",
    [
        {"type": ["ddlUpdate"], "version": 1},
        {"type": "ddlUpdate", "version": [1], "context": {"query": "q"}, "event": {"tag": "X"}},
        {"type": "ddlUpdate", "version": {"v": 1}, "context": {"query": "q"}},
    ],
)
def test_a_ddl_event_with_an_array_or_object_for_its_type_or_version_is_no_crash(
    event: dict[str, Any],
) -> None:
    # Found by fuzzing: `in` a frozenset raised TypeError (unhashable) for these.
    processor = DdlEventProcessor()
    if isinstance(event["type"], str):
        with pytest.raises(DdlError, match="unsupported ddl event version"):
            processor.process(event)
    else:
        assert processor.process(event) == []  # an unknown type: ignored
