"""The C decoder (app/sources/postgres/_pgrows.c) against the Python path.

``ChangeMapper.map_common`` must give exactly what ``map(decode_message(payload))``
gives, or None (then the Python path runs and says what is wrong). Generated
messages, valid and broken: row changes over every column kind the kernel converts
itself and some it hands to the Python parsers, begins and commits over the whole
range of their fields.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence
from typing import Any

import pytest

from app.protocol.messages import Begin, Commit, Data
from app.sources.postgres import mapper as mapper_module
from app.sources.postgres.mapper import ChangeMapper, MappingError, ShardId
from app.sources.postgres.pgoutput import UNCHANGED_TOAST, PgOutputError, decode_message
from app.sources.postgres.values import (
    BOOL,
    FLOAT8,
    INT2,
    INT4,
    INT8,
    JSONB,
    NUMERIC,
    TEXT,
    TIMESTAMPTZ,
    TypeRegistry,
)
from tests.c_helpers import built, needs

_pgrows = built("app.sources.postgres._pgrows")
pytestmark = needs(_pgrows, "app/sources/postgres/_pgrows.c")

REL_OID = 0x80000010  # above 2**31: unsigned on the wire, signed in the output
TEXT_ARRAY = 1009
# (name, type OID, is key)
COLUMNS = [
    ("id", INT8, True),
    ("n", INT4, True),
    ("s", INT2, False),
    ("flag", BOOL, False),
    ("title", TEXT, False),
    ("x", FLOAT8, False),
    ("j", JSONB, False),
    ("amount", NUMERIC, False),
    ("at", TIMESTAMPTZ, False),
    ("tags", TEXT_ARRAY, False),
]


def relation_payload(ident: bytes = b"d", columns: list[tuple[str, int, bool]] = COLUMNS) -> bytes:
    out = b"R" + struct.pack(">I", REL_OID) + b"public\x00items\x00" + ident
    out += struct.pack(">h", len(columns))
    for name, oid, key in columns:
        out += bytes([1 if key else 0]) + name.encode() + b"\x00" + struct.pack(">Ii", oid, -1)
    return out


def tuple_data(values: Sequence[bytes | str | None]) -> bytes:
    out = struct.pack(">h", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v == "TOAST":
            out += b"u"
        elif isinstance(v, bytes):
            out += b"t" + struct.pack(">i", len(v)) + v
        else:
            raw = v.encode()
            out += b"t" + struct.pack(">i", len(raw)) + raw
    return out


VALUES: dict[int, list[Any]] = {
    INT8: [
        "0",
        "-1",
        "123456789012345678",
        "-999999999999999999",
        "1234567890123456789012",
        "9223372036854775807",
        "12a",
        "",
        "-",
    ],
    INT4: ["7", "-2147483648", "2147483647", "x"],
    INT2: ["1", "-32768", "32767"],
    BOOL: ["t", "f", "yes"],
    TEXT: ["", "plain", "é and 🎉", b"bad \xff\xfe utf-8", 'quote " and \\ and \n', "TOAST"],
    FLOAT8: ["1.5", "1", "NaN", "-Infinity", "1e300", "nope"],
    JSONB: ['{"a": [1, 2]}', "null", "not json {"],
    NUMERIC: ["12.5", "123456789012345678901234567890", "NaN"],
    TIMESTAMPTZ: ["2024-01-02 03:04:05.123456+00", "infinity", "garbage"],
    TEXT_ARRAY: ['{a,"b c",NULL}', "{}", "{unclosed"],
}


def random_row(rng: random.Random, toast: bool) -> list[Any]:
    row: list[Any] = []
    for _name, oid, _key in COLUMNS:
        choices = [*list(VALUES[oid]), None]
        if not toast:
            choices = [c for c in choices if c != "TOAST"]
        row.append(rng.choice(choices))
    return row


def key_tuple(row: list[Any]) -> list[Any]:
    return [v if key else None for v, (_n, _o, key) in zip(row, COLUMNS, strict=True)]


def random_payload(rng: random.Random) -> bytes:
    oid = struct.pack(">I", REL_OID)
    kind = rng.choice("IUUUDD")
    if kind == "I":
        return b"I" + oid + b"N" + tuple_data(random_row(rng, toast=False))
    if kind == "U":
        marker = rng.choice("NKO")
        new = tuple_data(random_row(rng, toast=True))
        if marker == "N":
            return b"U" + oid + b"N" + new
        old_row = random_row(rng, toast=False)
        old = key_tuple(old_row) if marker == "K" else old_row
        return b"U" + oid + marker.encode() + tuple_data(old) + b"N" + new
    marker = rng.choice("KO")
    old_row = random_row(rng, toast=False)
    old = key_tuple(old_row) if marker == "K" else old_row
    return b"D" + oid + marker.encode() + tuple_data(old)


def python_path(m: ChangeMapper, payload: bytes) -> list[Any] | Exception:
    try:
        return m.map(decode_message(payload))
    except (MappingError, PgOutputError) as e:
        return e


@pytest.fixture
def mapper(monkeypatch: pytest.MonkeyPatch) -> ChangeMapper:
    # The built helper, also under CHANGESTREAMER_SPEEDUPS=0 (tests/c_helpers.py).
    assert _pgrows is not None
    _pgrows.setup(Data, UNCHANGED_TOAST, Begin, Commit)
    monkeypatch.setattr(mapper_module, "_pgrows", _pgrows)
    m = ChangeMapper(ShardId("app", 0), TypeRegistry())
    assert m.map(decode_message(relation_payload())) == []
    return m


def test_generated_row_changes_match_the_python_path(mapper: ChangeMapper) -> None:
    rng = random.Random(20261201)
    fast = fallbacks = 0
    for _ in range(3000):
        payload = random_payload(rng)
        expected = python_path(mapper, payload)
        got = mapper.map_common(b"w" + bytes(24) + payload, 25)
        if got is None:
            # The only reason here: a value its parser rejects, which the Python
            # path reports.
            assert isinstance(expected, MappingError), payload
            fallbacks += 1
            continue
        fast += 1
        assert isinstance(got, Data)
        assert [got] == expected, payload
    assert fast > 300, fast
    assert fallbacks > 300, fallbacks


def test_every_valid_common_row_takes_the_c_path(mapper: ChangeMapper) -> None:
    payload = (
        b"I"
        + struct.pack(">I", REL_OID)
        + b"N"
        + tuple_data(
            ["12", "-3", "4", "t", "hé", "2.5", '{"k": 1}', "7", "2024-01-02 03:04:05+00", "{a}"]
        )
    )
    got = mapper.map_common(payload, 0)
    assert got is not None
    assert got.body["new"] == {
        "id": 12,
        "n": -3,
        "s": 4,
        "flag": True,
        "title": "hé",
        "x": 2.5,
        "j": '{"k": 1}',
        "amount": 7,
        "at": 1704164645000,
        "tags": ["a"],
    }
    assert got.body["relation"]["relationOid"] == REL_OID - (1 << 32)
    assert [got] == python_path(mapper, payload)


def test_unchanged_toast_comes_from_the_old_row_or_is_left_out(mapper: ChangeMapper) -> None:
    oid = struct.pack(">I", REL_OID)
    old = ["1", "2", "3", "f", "old title", "1.5", "{}", "1", None, None]
    new = ["1", "2", "3", "t", "TOAST", "2.5", "TOAST", "1", None, None]
    with_old = b"U" + oid + b"O" + tuple_data(old) + b"N" + tuple_data(new)
    without = b"U" + oid + b"N" + tuple_data(new)
    for payload in (with_old, without):
        got = mapper.map_common(payload, 0)
        assert got is not None
        assert [got] == python_path(mapper, payload)
    got = mapper.map_common(with_old, 0)
    assert got is not None
    assert got.body["new"]["title"] == "old title"
    got = mapper.map_common(without, 0)
    assert got is not None
    assert "title" not in got.body["new"]
    assert "j" not in got.body["new"]


def test_broken_messages_fall_back_to_the_python_path(mapper: ChangeMapper) -> None:
    rng = random.Random(7)
    oid = struct.pack(">I", REL_OID)
    valid = b"I" + oid + b"N" + tuple_data(random_row(rng, toast=False))
    broken = [valid[:cut] for cut in range(len(valid))]  # every truncation
    broken += [
        valid + b"\x00",  # trailing byte
        b"I" + oid + b"X" + valid[6:],  # unknown tuple marker
        b"I" + oid + b"N" + struct.pack(">h", 1) + b"b" + struct.pack(">i", 1) + b"\x00",  # binary
        b"I" + oid + b"N" + struct.pack(">h", 1) + b"z",  # unknown column kind
        b"I" + oid + b"N" + struct.pack(">h", 1) + b"t" + struct.pack(">i", -5),
        b"I" + struct.pack(">I", 99) + b"N" + tuple_data(["1"]),  # before its Relation
        b"U" + oid + b"K" + tuple_data(["1"]),  # no new tuple
        b"D" + oid + b"N" + tuple_data(["1"]),  # a delete needs K or O
        b"X" + bytes(20),  # not a message the kernel maps
        b"B" + bytes(19),  # a truncated Begin
        b"B" + bytes(21),  # a Begin with a trailing byte
        b"C" + bytes(24),  # a truncated Commit
        b"C" + bytes(26),  # a Commit with a trailing byte
    ]
    for payload in broken:
        assert mapper.map_common(payload, 0) is None, payload
        assert mapper.map_common(b"w" + bytes(24) + payload, 25) is None, payload


# Edges of the fields: LSNs across the lexi lengths and the u64 range, commit times
# before 1970 and near the int64 ends (whose Unix time overflows an int64: the
# Python path gives it), xids that are negative as int32.
LSNS = [0, 1, 35, 36, 1295, 1296, 0x16B3748, 0xFFFFFFFF, 1 << 32, (1 << 63) + 5, (1 << 64) - 1]
TIMES = [0, -1, -999, -1000, -1001, 1, 999, 1000, 1001, 846_000_000_000_000]
TIMES += [-(1 << 63), (1 << 63) - 1, (1 << 63) - 946_684_800_000_000]
TIMES += [(1 << 63) - 946_684_800_000_001]
XIDS = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]


def begin_payload(lsn: int, time: int, xid: int) -> bytes:
    return b"B" + struct.pack(">QqI", lsn, time, xid)


def commit_payload(flags: int, lsn: int, end_lsn: int, time: int) -> bytes:
    return b"C" + struct.pack(">BQQq", flags, lsn, end_lsn, time)


def test_begins_and_commits_match_the_python_path(mapper: ChangeMapper) -> None:
    rng = random.Random(20261204)
    payloads = [begin_payload(lsn, t, x) for lsn in LSNS for t in TIMES for x in XIDS]
    payloads += [
        commit_payload(f, lsn, rng.choice(LSNS), t) for f in (0, 255) for lsn in LSNS for t in TIMES
    ]
    for _ in range(500):
        payloads.append(
            begin_payload(rng.getrandbits(64), rng.getrandbits(64) - (1 << 63), rng.getrandbits(32))
        )
        payloads.append(
            commit_payload(
                rng.getrandbits(8),
                rng.getrandbits(64),
                rng.getrandbits(64),
                rng.getrandbits(64) - (1 << 63),
            )
        )
    fast = 0
    for payload in payloads:
        expected = python_path(mapper, payload)
        got = mapper.map_common(b"w" + bytes(24) + payload, 25)
        if got is None:
            # Only a commit time whose Unix time overflows an int64 defers.
            (time,) = struct.unpack_from(">q", payload, 9 if payload[0] == ord("B") else 18)
            assert time > (1 << 63) - 1 - 946_684_800_000_000, payload
            continue
        fast += 1
        assert isinstance(got, Begin if payload[0] == ord("B") else Commit)
        assert isinstance(expected, list)
        assert [got] == expected, payload
        assert list(got.body) == list(expected[0].body), payload  # the reference's key order
    assert fast > len(payloads) * 0.8, fast


def test_a_relation_message_replaces_the_columns_it_maps(mapper: ChangeMapper) -> None:
    columns = [("id", INT8, True), ("label", TEXT, False)]
    assert mapper.map(decode_message(relation_payload(b"f", columns))) == []
    payload = b"I" + struct.pack(">I", REL_OID) + b"N" + tuple_data(["5", "five"])
    got = mapper.map_common(payload, 0)
    assert got is not None
    assert got.body["new"] == {"id": 5, "label": "five"}
    assert [got] == python_path(mapper, payload)


def test_without_the_helper_map_common_always_defers(
    mapper: ChangeMapper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mapper_module, "_pgrows", None)
    payload = b"I" + struct.pack(">I", REL_OID) + b"N" + tuple_data(["5"])
    assert mapper.map_common(payload, 0) is None


def test_bad_arguments_raise_type_errors() -> None:
    assert _pgrows is not None
    with pytest.raises(TypeError, match="decode"):
        _pgrows.decode("not bytes", 0, {})
    with pytest.raises(TypeError, match="spec"):
        _pgrows.decode(b"I" + struct.pack(">I", 1) + b"N" + tuple_data([]), 0, {1: (1, 2)})
    with pytest.raises(ValueError, match="offset"):
        _pgrows.decode(b"I", -1, {})
