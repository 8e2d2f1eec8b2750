"""The Postgres logical replication wire format: CopyData frames and pgoutput v1 messages.

Pure bytes in, frozen dataclasses out (and the one client frame, the standby status
update, out as bytes); no I/O, no value conversion.  Spec: source.md §5.7, and
https://www.postgresql.org/docs/current/protocol-logicalrep-message-formats.html.

Conventions of this module:

* LSNs are unsigned 64-bit ints (``0`` = none); :func:`format_lsn` writes them the way
  zero emits ``commitLsn`` (``"00000000/01529750"``).
* Times are microseconds since the **Unix** epoch (Postgres sends 2000-01-01 based
  micros; we convert at the edge, both ways, so no caller ever sees the PG epoch).
* Relation and type OIDs stay unsigned here; the mapper turns relation OIDs into
  signed int32 for output, as zero does.  ``xid`` is signed int32, as zero reads it.
* A tuple is a plain ``tuple`` with one entry per column: ``None`` for NULL, the
  :data:`UNCHANGED_TOAST` sentinel for an unchanged TOASTed value, a ``str`` for text
  and ``bytes`` for binary columns.  Strings are decoded with replacement of invalid
  UTF-8 (zero's TextDecoder does the same), so a ``SQL_ASCII`` database holding
  Latin-1 bytes degrades a value instead of wedging replication forever.

Speed: every replicated row passes through :func:`decode_message`, so fields are read
with precompiled ``struct.unpack_from`` on the buffer, strings are found with
``bytes.index``, and the only per-item loop is one iteration per column.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from app.protocol.canonical_json import JsonPieces

__all__ = [
    "PG_EPOCH_OFFSET_US",
    "UNCHANGED_TOAST",
    "Begin",
    "Commit",
    "Delete",
    "Insert",
    "LogicalMessage",
    "Origin",
    "PgOutputError",
    "PgOutputMessage",
    "PrimaryKeepalive",
    "Relation",
    "RelationColumn",
    "Truncate",
    "TupleData",
    "TupleValue",
    "TypeMessage",
    "UnchangedToast",
    "Update",
    "XLogData",
    "decode_message",
    "format_lsn",
    "parse_copy_data",
    "parse_lsn",
    "standby_status_update",
]

# (2000-01-01 - 1970-01-01) in microseconds: Postgres timestamps count from 2000.
PG_EPOCH_OFFSET_US: Final = 946_684_800_000_000


class PgOutputError(ValueError):
    """Bytes that are not a well-formed replication frame or pgoutput v1 message."""


class UnchangedToast:
    """Type of :data:`UNCHANGED_TOAST`: a column whose TOASTed value was not sent."""

    __slots__ = ()
    _instance: UnchangedToast | None = None

    def __new__(cls) -> UnchangedToast:
        # A singleton, so `value is UNCHANGED_TOAST` is the test (also after copying).
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"

    def __reduce__(self) -> str:
        return "UNCHANGED_TOAST"


UNCHANGED_TOAST: Final = UnchangedToast()

# JsonPieces: a large text value as its JSON text, put in by large_rows.py (never
# by the decoder here).
TupleValue: TypeAlias = str | UnchangedToast | bytes | JsonPieces | None
TupleData: TypeAlias = tuple[TupleValue, ...]

# --- frames ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class XLogData:
    """A ``w`` frame: WAL data carrying one pgoutput message."""

    wal_start: int
    wal_end: int
    send_time_us: int  # Unix epoch micros
    payload: bytes


@dataclass(frozen=True, slots=True)
class PrimaryKeepalive:
    """A ``k`` frame: the server's position, and whether it wants an answer now."""

    wal_end: int
    send_time_us: int  # Unix epoch micros
    reply_requested: bool


_XLOG_HEADER: Final = struct.Struct(">QQq")
_KEEPALIVE: Final = struct.Struct(">Qq?")
_STANDBY_STATUS: Final = struct.Struct(">cQQQqB")


def parse_copy_data(frame: bytes | bytearray | memoryview) -> XLogData | PrimaryKeepalive:
    """Parse one CopyData frame received on a replication connection."""
    data = bytes(frame)
    if not data:
        raise PgOutputError("empty CopyData frame")
    kind = data[0]
    if kind == 0x77:  # w
        if len(data) < 25:
            raise PgOutputError(f"XLogData frame truncated: {len(data)} bytes, header needs 25")
        wal_start, wal_end, send_time = _XLOG_HEADER.unpack_from(data, 1)
        return XLogData(wal_start, wal_end, send_time + PG_EPOCH_OFFSET_US, data[25:])
    if kind == 0x6B:  # k
        if len(data) != 18:
            raise PgOutputError(f"keepalive frame has {len(data)} bytes, expected 18")
        wal_end, send_time, reply = _KEEPALIVE.unpack_from(data, 1)
        return PrimaryKeepalive(wal_end, send_time + PG_EPOCH_OFFSET_US, reply)
    raise PgOutputError(f"unknown CopyData frame type {bytes([kind])!r} at offset 0")


def standby_status_update(lsn: int, *, now_unix_us: int, reply_requested: bool = False) -> bytes:
    """The 34-byte ``r`` frame confirming ``lsn`` as written, flushed and applied."""
    if not 0 <= lsn < 1 << 64:
        raise ValueError(f"LSN {lsn} is outside the unsigned 64-bit range")
    return _STANDBY_STATUS.pack(
        b"r", lsn, lsn, lsn, now_unix_us - PG_EPOCH_OFFSET_US, 1 if reply_requested else 0
    )


# --- LSN text -------------------------------------------------------------------------

_LSN_TEXT: Final = re.compile(r"([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})")


def format_lsn(lsn: int) -> str:
    """Upper-case hex, 8 zero-padded digits each side (``00000000/01529750``), as zero
    emits ``commitLsn``."""
    if not 0 <= lsn < 1 << 64:
        raise ValueError(f"LSN {lsn} is outside the unsigned 64-bit range")
    return f"{lsn >> 32:08X}/{lsn & 0xFFFFFFFF:08X}"


def parse_lsn(text: str) -> int:
    """Parse Postgres' ``H/L`` LSN text (1 to 8 hex digits each side, any case)."""
    m = _LSN_TEXT.fullmatch(text)
    if m is None:
        raise ValueError(f"invalid LSN {text!r}: expected 'H/L' with 1 to 8 hex digits each")
    return (int(m.group(1), 16) << 32) | int(m.group(2), 16)


# --- pgoutput messages ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int
    commit_time_us: int  # Unix epoch micros
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time_us: int  # Unix epoch micros


@dataclass(frozen=True, slots=True)
class Origin:
    commit_lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class TypeMessage:
    type_oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class RelationColumn:
    name: str
    type_oid: int
    type_modifier: int
    is_key: bool


ReplicaIdentity: TypeAlias = Literal["d", "n", "f", "i"]


@dataclass(frozen=True, slots=True)
class Relation:
    oid: int
    namespace: str  # empty for pg_catalog
    name: str
    replica_identity: ReplicaIdentity
    columns: tuple[RelationColumn, ...]


OldKind: TypeAlias = Literal["K", "O"]


@dataclass(frozen=True, slots=True)
class Insert:
    relation_oid: int
    new: TupleData


@dataclass(frozen=True, slots=True)
class Update:
    relation_oid: int
    old_kind: OldKind | None  # K: key columns only (others NULL), O: the full old row
    old: TupleData | None
    new: TupleData


@dataclass(frozen=True, slots=True)
class Delete:
    relation_oid: int
    old_kind: OldKind
    old: TupleData


@dataclass(frozen=True, slots=True)
class Truncate:
    relation_oids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


PgOutputMessage: TypeAlias = (
    Begin
    | Commit
    | Origin
    | TypeMessage
    | Relation
    | Insert
    | Update
    | Delete
    | Truncate
    | LogicalMessage
)


class _Truncated(Exception):
    """Internal: ran past the end while reading ``what`` at ``offset``."""

    def __init__(self, offset: int, what: str) -> None:
        self.offset = offset
        self.what = what


_U8: Final = struct.Struct(">B")
_I16: Final = struct.Struct(">h")
_I32: Final = struct.Struct(">i")
_U32: Final = struct.Struct(">I")
_BEGIN: Final = struct.Struct(">Qqi")
_COMMIT: Final = struct.Struct(">BQQq")
_ORIGIN_LSN: Final = struct.Struct(">Q")
_RELATION_HEAD: Final = struct.Struct(">I")
_COLUMN_TYPE: Final = struct.Struct(">Ii")
_TRUNCATE_HEAD: Final = struct.Struct(">iB")
_MESSAGE_HEAD: Final = struct.Struct(">BQ")
_REPLICA_IDENTITIES: Final[dict[int, ReplicaIdentity]] = {
    0x64: "d",
    0x6E: "n",
    0x66: "f",
    0x69: "i",
}


def decode_message(payload: bytes | bytearray | memoryview) -> PgOutputMessage:
    """Decode one pgoutput proto v1 message (the payload of an XLogData frame)."""
    data = payload if type(payload) is bytes else bytes(payload)
    if not data:
        raise PgOutputError("empty pgoutput message")
    kind = data[0]
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise PgOutputError(f"unknown pgoutput message type {bytes([kind])!r} at offset 0")
    try:
        message, end = decoder(data)
    except _Truncated as e:
        raise PgOutputError(
            f"pgoutput {chr(kind)!r} message truncated: {e.what} at offset {e.offset} "
            f"runs past the end ({len(data)} bytes)"
        ) from None
    if end != len(data):
        raise PgOutputError(
            f"pgoutput {chr(kind)!r} message has {len(data) - end} unexpected trailing "
            f"byte(s) at offset {end}"
        )
    return message


def _unpack(s: struct.Struct, data: bytes, pos: int, what: str) -> tuple[int, ...]:
    if pos + s.size > len(data):
        raise _Truncated(pos, what)
    return s.unpack_from(data, pos)


def _cstring(data: bytes, pos: int, what: str) -> tuple[str, int]:
    try:
        end = data.index(b"\0", pos)
    except ValueError:
        raise _Truncated(pos, f"{what} (no NUL terminator)") from None
    return data[pos:end].decode("utf-8", "replace"), end + 1


def _begin(data: bytes) -> tuple[Begin, int]:
    lsn, time, xid = _unpack(_BEGIN, data, 1, "Begin fields")
    return Begin(lsn, time + PG_EPOCH_OFFSET_US, xid), 1 + _BEGIN.size


def _commit(data: bytes) -> tuple[Commit, int]:
    flags, lsn, end_lsn, time = _unpack(_COMMIT, data, 1, "Commit fields")
    return Commit(flags, lsn, end_lsn, time + PG_EPOCH_OFFSET_US), 1 + _COMMIT.size


def _origin(data: bytes) -> tuple[Origin, int]:
    (lsn,) = _unpack(_ORIGIN_LSN, data, 1, "origin commit LSN")
    name, pos = _cstring(data, 9, "origin name")
    return Origin(lsn, name), pos


def _type(data: bytes) -> tuple[TypeMessage, int]:
    (oid,) = _unpack(_U32, data, 1, "type OID")
    namespace, pos = _cstring(data, 5, "type namespace")
    name, pos = _cstring(data, pos, "type name")
    return TypeMessage(oid, namespace, name), pos


def _relation(data: bytes) -> tuple[Relation, int]:
    (oid,) = _unpack(_RELATION_HEAD, data, 1, "relation OID")
    namespace, pos = _cstring(data, 5, "relation namespace")
    name, pos = _cstring(data, pos, "relation name")
    (ident_byte,) = _unpack(_U8, data, pos, "replica identity")
    ident = _REPLICA_IDENTITIES.get(ident_byte)
    if ident is None:
        raise PgOutputError(
            f"pgoutput 'R' message: unknown replica identity {bytes([ident_byte])!r} "
            f"at offset {pos}"
        )
    (ncols,) = _unpack(_I16, data, pos + 1, "column count")
    pos += 3
    columns: list[RelationColumn] = []
    for _ in range(ncols):
        (flags,) = _unpack(_U8, data, pos, "column flags")
        col_name, pos = _cstring(data, pos + 1, "column name")
        type_oid, typmod = _unpack(_COLUMN_TYPE, data, pos, "column type")
        pos += 8
        columns.append(RelationColumn(col_name, type_oid, typmod, bool(flags & 1)))
    return Relation(oid, namespace, name, ident, tuple(columns)), pos


def _tuple(data: bytes, pos: int) -> tuple[TupleData, int]:
    """Read TupleData at ``pos``; the hot loop of the whole decoder.

    Bounds are checked by the reads themselves (``IndexError``, ``struct.error``):
    a ``try`` costs nothing in 3.11 until something raises, and that is rare.
    """
    if pos + 2 > len(data):
        raise _Truncated(pos, "tuple column count")
    (ncols,) = _I16.unpack_from(data, pos)
    pos += 2
    size = len(data)
    unpack_len = _I32.unpack_from
    values: list[TupleValue] = []
    append = values.append
    try:
        for _ in range(ncols):
            kind = data[pos]
            if kind == 0x74:  # t
                (n,) = unpack_len(data, pos + 1)
                start = pos + 5
                pos = start + n
                if n < 0 or pos > size:
                    raise _Truncated(start, f"column value of {n} bytes")
                chunk = data[start:pos]
                try:
                    append(chunk.decode())  # strict UTF-8 without arguments is the fast call
                except UnicodeDecodeError:
                    append(chunk.decode("utf-8", "replace"))
            elif kind == 0x6E:  # n
                pos += 1
                append(None)
            elif kind == 0x75:  # u
                pos += 1
                append(UNCHANGED_TOAST)
            elif kind == 0x62:  # b
                (n,) = unpack_len(data, pos + 1)
                start = pos + 5
                pos = start + n
                if n < 0 or pos > size:
                    raise _Truncated(start, f"column value of {n} bytes")
                append(data[start:pos])
            else:
                raise PgOutputError(f"unknown tuple column kind {bytes([kind])!r} at offset {pos}")
    except IndexError:
        raise _Truncated(pos, "tuple column kind") from None
    except struct.error:
        raise _Truncated(pos + 1, "column value length") from None
    return tuple(values), pos


def _expect(data: bytes, pos: int, allowed: bytes, what: str) -> int:
    if pos >= len(data):
        raise _Truncated(pos, what)
    byte = data[pos]
    if byte not in allowed:
        raise PgOutputError(
            f"pgoutput {chr(data[0])!r} message: expected {what} "
            f"({' or '.join(repr(chr(b)) for b in allowed)}), got {bytes([byte])!r} at offset {pos}"
        )
    return byte


def _insert(data: bytes) -> tuple[Insert, int]:
    (oid,) = _unpack(_U32, data, 1, "relation OID")
    _expect(data, 5, b"N", "new tuple marker")
    new, pos = _tuple(data, 6)
    return Insert(oid, new), pos


def _update(data: bytes) -> tuple[Update, int]:
    (oid,) = _unpack(_U32, data, 1, "relation OID")
    marker = _expect(data, 5, b"KON", "tuple marker")
    if marker == 0x4E:  # N: no old tuple
        new, pos = _tuple(data, 6)
        return Update(oid, None, None, new), pos
    old, pos = _tuple(data, 6)
    _expect(data, pos, b"N", "new tuple marker")
    new, pos = _tuple(data, pos + 1)
    return Update(oid, "K" if marker == 0x4B else "O", old, new), pos


def _delete(data: bytes) -> tuple[Delete, int]:
    (oid,) = _unpack(_U32, data, 1, "relation OID")
    marker = _expect(data, 5, b"KO", "old tuple marker")
    old, pos = _tuple(data, 6)
    return Delete(oid, "K" if marker == 0x4B else "O", old), pos


def _truncate(data: bytes) -> tuple[Truncate, int]:
    count, options = _unpack(_TRUNCATE_HEAD, data, 1, "truncate header")
    if count < 0:
        raise PgOutputError(f"pgoutput 'T' message: negative relation count {count} at offset 1")
    end = 6 + 4 * count
    if end > len(data):
        raise _Truncated(6, f"{count} relation OIDs")
    oids = struct.unpack_from(f">{count}I", data, 6)
    return Truncate(oids, bool(options & 1), bool(options & 2)), end


def _message(data: bytes) -> tuple[LogicalMessage, int]:
    flags, lsn = _unpack(_MESSAGE_HEAD, data, 1, "message header")
    prefix, pos = _cstring(data, 10, "message prefix")
    (n,) = _unpack(_I32, data, pos, "content length")
    start = pos + 4
    end = start + n
    if n < 0 or end > len(data):
        raise _Truncated(start, f"message content of {n} bytes")
    return LogicalMessage(bool(flags & 1), lsn, prefix, data[start:end]), end


_DECODERS: Final[dict[int, Callable[[bytes], tuple[PgOutputMessage, int]]]] = {
    ord("B"): _begin,
    ord("C"): _commit,
    ord("O"): _origin,
    ord("Y"): _type,
    ord("R"): _relation,
    ord("I"): _insert,
    ord("U"): _update,
    ord("D"): _delete,
    ord("T"): _truncate,
    ord("M"): _message,
}
