"""pgoutput v1 and CopyData framing: golden bytes for every kind, errors, and a real slot."""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import cast

import psycopg
import pytest

from app.sources.postgres.pgoutput import (
    PG_EPOCH_OFFSET_US,
    UNCHANGED_TOAST,
    Begin,
    Commit,
    Delete,
    Insert,
    LogicalMessage,
    Origin,
    PgOutputError,
    PrimaryKeepalive,
    Relation,
    RelationColumn,
    Truncate,
    TypeMessage,
    Update,
    XLogData,
    decode_message,
    format_lsn,
    parse_copy_data,
    parse_lsn,
    standby_status_update,
)

# 2024-01-02 03:04:05.123456 UTC
UNIX_US = 1_704_164_645_123_456
PG_US = UNIX_US - PG_EPOCH_OFFSET_US


def tuple_data(*cols: bytes) -> bytes:
    return struct.pack(">h", len(cols)) + b"".join(cols)


def text(value: str) -> bytes:
    raw = value.encode()
    return b"t" + struct.pack(">i", len(raw)) + raw


# --- frames ---------------------------------------------------------------------------


def test_xlogdata_frame_carries_positions_and_payload() -> None:
    frame = (
        b"w"
        + bytes.fromhex("0000000001529750")  # walStart
        + bytes.fromhex("0000000001529780")  # walEnd
        + struct.pack(">q", PG_US)
        + b"B..."
    )
    assert parse_copy_data(frame) == XLogData(0x1529750, 0x1529780, UNIX_US, b"B...")


def test_xlogdata_frame_accepts_memoryview() -> None:
    frame = b"w" + bytes(24) + b"C"
    parsed = parse_copy_data(memoryview(frame))
    assert isinstance(parsed, XLogData)
    assert parsed.payload == b"C"
    assert parsed.send_time_us == PG_EPOCH_OFFSET_US


def test_keepalive_frame_with_and_without_reply_request() -> None:
    frame = b"k" + bytes.fromhex("00000016B374D848") + struct.pack(">q", PG_US) + b"\x01"
    assert parse_copy_data(frame) == PrimaryKeepalive(0x16B374D848, UNIX_US, True)
    assert parse_copy_data(frame[:-1] + b"\x00") == PrimaryKeepalive(0x16B374D848, UNIX_US, False)


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"", "empty CopyData frame"),
        (b"w" + bytes(23), "XLogData frame truncated: 24 bytes"),
        (b"k" + bytes(16), "keepalive frame has 17 bytes, expected 18"),
        (b"k" + bytes(18), "keepalive frame has 19 bytes, expected 18"),
        (b"x123", "unknown CopyData frame type b'x' at offset 0"),
    ],
)
def test_malformed_frames_are_rejected(frame: bytes, message: str) -> None:
    with pytest.raises(PgOutputError, match=message.replace("(", r"\(")):
        parse_copy_data(frame)


def test_standby_status_update_golden_bytes() -> None:
    frame = standby_status_update(0x16B374D848, now_unix_us=UNIX_US)
    assert frame == (
        b"r"
        + bytes.fromhex("00000016B374D848") * 3
        + bytes.fromhex("0002b0ec8517d580")  # PG_US = 757479845123456, big-endian
        + b"\x00"
    )
    assert len(frame) == 34
    assert struct.unpack(">q", frame[25:33]) == (PG_US,)


def test_standby_status_update_round_trip() -> None:
    frame = standby_status_update(2**64 - 1, now_unix_us=0, reply_requested=True)
    kind, write, flush, apply, clock, reply = struct.unpack(">cQQQqB", frame)
    assert (kind, write, flush, apply, reply) == (b"r", 2**64 - 1, 2**64 - 1, 2**64 - 1, 1)
    assert clock + PG_EPOCH_OFFSET_US == 0
    zero = standby_status_update(0, now_unix_us=UNIX_US)
    assert struct.unpack(">cQQQqB", zero)[1:4] == (0, 0, 0)


def test_standby_status_update_rejects_out_of_range_lsn() -> None:
    with pytest.raises(ValueError, match="outside the unsigned 64-bit range"):
        standby_status_update(-1, now_unix_us=0)
    with pytest.raises(ValueError, match="outside the unsigned 64-bit range"):
        standby_status_update(2**64, now_unix_us=0)


# --- LSN text -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lsn", "text"),
    [
        (0, "00000000/00000000"),
        (0x1529750, "00000000/01529750"),
        (0x16B374D848, "00000016/B374D848"),
        (2**64 - 1, "FFFFFFFF/FFFFFFFF"),
    ],
)
def test_format_and_parse_lsn(lsn: int, text: str) -> None:
    assert format_lsn(lsn) == text
    assert parse_lsn(text) == lsn


def test_parse_lsn_accepts_postgres_short_lower_case_form() -> None:
    assert parse_lsn("16/b374d848") == 0x16B374D848
    assert parse_lsn("0/0") == 0


@pytest.mark.parametrize("bad", ["", "1529750", "0/", "/1", "123456789/0", "0/G", " 0/1"])
def test_parse_lsn_rejects_malformed_text(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid LSN"):
        parse_lsn(bad)


def test_format_lsn_rejects_out_of_range() -> None:
    with pytest.raises(ValueError, match="outside"):
        format_lsn(2**64)


# --- messages: golden bytes -----------------------------------------------------------


def test_begin() -> None:
    payload = (
        b"B"
        + bytes.fromhex("0000000001529750")
        + struct.pack(">q", PG_US)
        + bytes.fromhex("ffffffff")  # xid as signed int32
    )
    assert decode_message(payload) == Begin(0x1529750, UNIX_US, -1)


def test_commit() -> None:
    payload = (
        b"C\x00"
        + bytes.fromhex("0000000001529750")
        + bytes.fromhex("0000000001529780")
        + struct.pack(">q", PG_US)
    )
    assert decode_message(payload) == Commit(0, 0x1529750, 0x1529780, UNIX_US)


def test_origin() -> None:
    payload = b"O" + bytes.fromhex("0000000000000010") + b"node_a\x00"
    assert decode_message(payload) == Origin(0x10, "node_a")


def test_type() -> None:
    payload = b"Y" + bytes.fromhex("00004000") + b"public\x00mood\x00"
    assert decode_message(payload) == TypeMessage(16384, "public", "mood")


def test_relation() -> None:
    payload = (
        b"R"
        + bytes.fromhex("80000001")  # OID >= 2**31 stays unsigned here
        + b"public\x00foo\x00"
        + b"d"
        + struct.pack(">h", 2)
        + b"\x01id\x00"
        + struct.pack(">Ii", 23, -1)
        + b"\x00v\xc3\xa9\x00"  # "vé", UTF-8
        + struct.pack(">Ii", 1043, 68)
    )
    assert decode_message(payload) == Relation(
        oid=0x80000001,
        namespace="public",
        name="foo",
        replica_identity="d",
        columns=(
            RelationColumn("id", 23, -1, True),
            RelationColumn("vé", 1043, 68, False),
        ),
    )


@pytest.mark.parametrize("ident", ["d", "n", "f", "i"])
def test_relation_replica_identities(ident: str) -> None:
    payload = b"R\x00\x00\x00\x01\x00t\x00" + ident.encode() + b"\x00\x00"
    message = decode_message(payload)
    assert isinstance(message, Relation)
    assert message.replica_identity == ident
    assert message.namespace == ""  # pg_catalog is sent as an empty namespace
    assert message.columns == ()


def test_insert_with_every_column_kind() -> None:
    payload = (
        b"I"
        + struct.pack(">I", 16384)
        + b"N"
        + tuple_data(
            text("1"), b"n", b"u", text("h\u00e9llo"), text(""), b"b\x00\x00\x00\x02\x00\xff"
        )
    )
    assert decode_message(payload) == Insert(
        16384, ("1", None, UNCHANGED_TOAST, "héllo", "", b"\x00\xff")
    )


def test_insert_with_zero_columns() -> None:
    assert decode_message(b"I\x00\x00\x00\x07N\x00\x00") == Insert(7, ())


def test_update_without_old_tuple() -> None:
    payload = b"U" + struct.pack(">I", 5) + b"N" + tuple_data(text("1"), b"u")
    assert decode_message(payload) == Update(5, None, None, ("1", UNCHANGED_TOAST))


def test_update_with_key_tuple() -> None:
    payload = (
        b"U"
        + struct.pack(">I", 5)
        + b"K"
        + tuple_data(text("1"), b"n")
        + b"N"
        + tuple_data(text("2"), text("b"))
    )
    assert decode_message(payload) == Update(5, "K", ("1", None), ("2", "b"))


def test_update_with_full_old_tuple() -> None:
    payload = (
        b"U"
        + struct.pack(">I", 5)
        + b"O"
        + tuple_data(text("1"), text("big"))
        + b"N"
        + tuple_data(text("1"), b"u")
    )
    assert decode_message(payload) == Update(5, "O", ("1", "big"), ("1", UNCHANGED_TOAST))


@pytest.mark.parametrize("kind", ["K", "O"])
def test_delete(kind: str) -> None:
    payload = b"D" + struct.pack(">I", 9) + kind.encode() + tuple_data(text("42"), b"n")
    assert decode_message(payload) == Delete(9, kind, ("42", None))  # type: ignore[arg-type]


def test_truncate_options() -> None:
    oids = struct.pack(">II", 16384, 0xFFFFFFF0)
    assert decode_message(b"T" + struct.pack(">iB", 2, 3) + oids) == Truncate(
        (16384, 0xFFFFFFF0), True, True
    )
    assert decode_message(b"T" + struct.pack(">iB", 1, 1) + oids[:4]) == Truncate(
        (16384,), True, False
    )
    assert decode_message(b"T" + struct.pack(">iB", 1, 2) + oids[:4]) == Truncate(
        (16384,), False, True
    )
    assert decode_message(b"T" + struct.pack(">iB", 0, 0)) == Truncate((), False, False)


def test_logical_message() -> None:
    payload = (
        b"M\x01"
        + bytes.fromhex("0000000001529760")
        + b"zero/0/ddl\x00"
        + struct.pack(">i", 4)
        + b'{"a"'
    )
    assert decode_message(payload) == LogicalMessage(True, 0x1529760, "zero/0/ddl", b'{"a"')
    non_tx = b"M\x00" + bytes(8) + b"p\x00" + struct.pack(">i", 0)
    assert decode_message(non_tx) == LogicalMessage(False, 0, "p", b"")


def test_decode_accepts_memoryview_and_bytearray() -> None:
    payload = b"I\x00\x00\x00\x07N" + tuple_data(text("x"))
    assert decode_message(memoryview(payload)) == Insert(7, ("x",))
    assert decode_message(bytearray(payload)) == Insert(7, ("x",))


def test_invalid_utf8_is_replaced_not_fatal() -> None:
    payload = b"I\x00\x00\x00\x07N" + tuple_data(b"t\x00\x00\x00\x02\xe9x")
    assert decode_message(payload) == Insert(7, ("\ufffdx",))


# --- messages: errors -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "empty pgoutput message"),
        (b"Z\x00", "unknown pgoutput message type b'Z' at offset 0"),
        (b"B" + bytes(10), "'B' message truncated: Begin fields at offset 1"),
        (b"C" + bytes(24), "'C' message truncated: Commit fields at offset 1"),
        (
            b"O" + bytes(8) + b"abc",
            "'O' message truncated: origin name .no NUL terminator. at offset 9",
        ),
        (b"Y\x00\x00", "'Y' message truncated: type OID at offset 1"),
        (
            b"R\x00\x00\x00\x01public\x00t\x00d\x00\x01\x01id\x00\x00\x00",
            "'R' message truncated: column type at offset 21",
        ),
        (b"R\x00\x00\x00\x01\x00t\x00x\x00\x00", "unknown replica identity b'x' at offset 8"),
        (b"I\x00\x00\x00\x07", "'I' message truncated: new tuple marker at offset 5"),
        (b"I\x00\x00\x00\x07X\x00\x00", "expected new tuple marker .'N'., got b'X' at offset 5"),
        (b"I\x00\x00\x00\x07N\x00", "'I' message truncated: tuple column count at offset 6"),
        (b"I\x00\x00\x00\x07N\x00\x02n", "'I' message truncated: tuple column kind at offset 9"),
        (
            b"I\x00\x00\x00\x07N\x00\x01t\x00\x00\x00\x05abc",
            "'I' message truncated: column value of 5 bytes at offset 13",
        ),
        (b"I\x00\x00\x00\x07N\x00\x01t\x00\x00", "column value length at offset 9"),
        (b"I\x00\x00\x00\x07N\x00\x01q", "unknown tuple column kind b'q' at offset 8"),
        (b"U\x00\x00\x00\x07X", "expected tuple marker .'K' or 'O' or 'N'., got b'X' at offset 5"),
        (b"U\x00\x00\x00\x07K\x00\x00", "'U' message truncated: new tuple marker at offset 8"),
        (b"D\x00\x00\x00\x07N\x00\x00", "expected old tuple marker .'K' or 'O'., got b'N'"),
        (b"T\x00\x00\x00\x02\x00\x00\x00\x00\x01", "'T' message truncated: 2 relation OIDs"),
        (b"T\xff\xff\xff\xff\x00", "negative relation count -1"),
        (
            b"M\x01" + bytes(8) + b"p\x00\x00\x00\x00\x09ab",
            "message content of 9 bytes at offset 16",
        ),
        (b"B" + bytes(20) + b"!", "1 unexpected trailing byte.s. at offset 21"),
    ],
)
def test_malformed_messages_name_type_and_offset(payload: bytes, message: str) -> None:
    with pytest.raises(PgOutputError, match=message):
        decode_message(payload)


# --- real Postgres --------------------------------------------------------------------

PG_ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
WIRE_DB = "hpa_wire"
SLOT = "hpa_slot"


@pytest.fixture
def wire_db() -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        _drop_slot(admin)
        admin.execute(f"DROP DATABASE IF EXISTS {WIRE_DB} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {WIRE_DB}")
    try:
        with psycopg.connect(
            f"host=127.0.0.1 port=5432 user=postgres dbname={WIRE_DB}", autocommit=True
        ) as conn:
            try:
                yield conn
            finally:
                _drop_slot(conn)
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            _drop_slot(admin)
            admin.execute(f"DROP DATABASE IF EXISTS {WIRE_DB} WITH (FORCE)")


def _drop_slot(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    conn.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
        (SLOT,),
    )


def test_real_slot_changes_decode(wire_db: psycopg.Connection[tuple[object, ...]]) -> None:
    conn = wire_db
    conn.execute("CREATE TABLE hpa_t (id int PRIMARY KEY, v text, n int8)")
    conn.execute("CREATE TABLE hpa_full (id int, big text)")
    conn.execute("ALTER TABLE hpa_full REPLICA IDENTITY FULL")
    conn.execute("CREATE PUBLICATION hpa_pub FOR TABLE hpa_t, hpa_full")
    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))

    with conn.transaction():
        conn.execute("INSERT INTO hpa_t VALUES (1, 'a', NULL), (2, 'é', 9223372036854775807)")
    conn.execute("UPDATE hpa_t SET v = 'b' WHERE id = 1")
    conn.execute("UPDATE hpa_t SET id = 10 WHERE id = 1")
    conn.execute("DELETE FROM hpa_t WHERE id = 2")
    conn.execute("INSERT INTO hpa_full VALUES (1, repeat('ab', 20000))")
    # Out-of-line, uncompressed storage: an update that leaves v alone does not resend it.
    conn.execute("ALTER TABLE hpa_t ALTER COLUMN v SET STORAGE EXTERNAL")
    conn.execute("INSERT INTO hpa_t VALUES (3, repeat('x', 100000), 0)")
    conn.execute("UPDATE hpa_t SET n = 1 WHERE id = 3")
    conn.execute("TRUNCATE hpa_t")
    # Non-transactional first: it is decoded once the next commit flushes the WAL.
    conn.execute("SELECT pg_logical_emit_message(false, 'nt', 'z')")
    conn.execute("SELECT pg_logical_emit_message(true, 'x', 'y')")

    rows = conn.execute(
        "SELECT lsn::text, data FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL, "
        "'proto_version', '1', 'publication_names', 'hpa_pub', 'messages', 'true')",
        (SLOT,),
    ).fetchall()
    decoded = [decode_message(bytes(cast(bytes, data))) for _, data in rows]
    kinds = "".join(
        type(m).__name__[0] if not isinstance(m, LogicalMessage) else "M" for m in decoded
    )
    # One B…C group per transaction; a Relation before the first use of a table and
    # again after its schema (ALTER) or relfilenode (TRUNCATE) changed.
    assert kinds == "BRIICBUCBUCBDCBRICBRICBUCBRTCMBMC"

    groups = _transactions(decoded)
    relation = groups[0][0]
    assert isinstance(relation, Relation)
    assert (relation.namespace, relation.name, relation.replica_identity) == (
        "public",
        "hpa_t",
        "d",
    )
    assert relation.columns == (
        RelationColumn("id", 23, -1, True),
        RelationColumn("v", 25, -1, False),
        RelationColumn("n", 20, -1, False),
    )
    oid = relation.oid
    assert groups[0][1:] == [
        Insert(oid, ("1", "a", None)),
        Insert(oid, ("2", "é", "9223372036854775807")),
    ]
    assert groups[1] == [Update(oid, None, None, ("1", "b", None))]
    # The key changed: the old key arrives as a K tuple with non-key columns NULL.
    assert groups[2] == [Update(oid, "K", ("1", None, None), ("10", "b", None))]
    assert groups[3] == [Delete(oid, "K", ("2", None, None))]
    full_rel, full_insert = groups[4]
    assert isinstance(full_rel, Relation)
    assert full_rel.replica_identity == "f"
    assert all(c.is_key for c in full_rel.columns)
    assert isinstance(full_insert, Insert)
    assert full_insert.relation_oid == full_rel.oid
    assert full_insert.new == ("1", "ab" * 20000)
    assert groups[5][1:] == [Insert(oid, ("3", "x" * 100000, "0"))]
    # The untouched out-of-line value is not sent again.
    assert groups[6] == [Update(oid, None, None, ("3", UNCHANGED_TOAST, "1"))]
    assert groups[7][1:] == [Truncate((oid,), False, False)]
    (message,) = groups[8]
    assert isinstance(message, LogicalMessage)
    assert (message.transactional, message.prefix, message.content) == (True, "x", b"y")
    assert message.lsn == parse_lsn(rows[-2][0])  # type: ignore[arg-type]
    outside = decoded[-4]
    assert isinstance(outside, LogicalMessage)
    assert (outside.transactional, outside.prefix, outside.content) == (False, "nt", b"z")

    begins = [m for m in decoded if isinstance(m, Begin)]
    commits = [m for m in decoded if isinstance(m, Commit)]
    for begin, commit in zip(begins, commits, strict=True):
        assert begin.final_lsn == commit.commit_lsn
        assert commit.end_lsn > commit.commit_lsn
        assert begin.commit_time_us == commit.commit_time_us
        assert commit.flags == 0
    assert [c.commit_lsn for c in commits] == sorted(c.commit_lsn for c in commits)
    now_us = conn.execute("SELECT (extract(epoch from now()) * 1e6)::int8").fetchone()
    assert now_us is not None
    # Unix-epoch micros: within an hour of the server's clock (catches a missed epoch shift).
    assert abs(commits[-1].commit_time_us - int(now_us[0])) < 3_600_000_000  # type: ignore[call-overload]


def _transactions(messages: Sequence[object]) -> list[list[object]]:
    groups: list[list[object]] = []
    current: list[object] | None = None
    for m in messages:
        if isinstance(m, Begin):
            current = []
        elif isinstance(m, Commit):
            assert current is not None
            groups.append(current)
            current = None
        elif current is not None:
            current.append(m)
    return groups
