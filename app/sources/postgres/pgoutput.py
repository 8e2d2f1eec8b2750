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

One decoder reads every message, over a frame's chunks (:func:`decode_chunks`): a
frame of one chunk is the common case, and a frame too large to join
(``connection.FramePieces``) is read across its chunk edges the same way, a large
text value left in the chunks (:class:`LargeValue`). Row changes take
``_pgrows.c`` first (``ChangeMapper.map_common``), its exact twin for a one-chunk
frame; what it does not handle comes here. Reads are slices checked by one
comparison, fields precompiled ``struct.unpack_from``, strings found with
``bytes.find``; the only per-item loop is one iteration per column.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Sequence
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
    "LargeValue",
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
    "decode_chunks",
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


class LargeValue:
    """A text column's value over ``large_over`` bytes in a frame too large to join:
    views of the frame's chunks, in order (``large_values`` makes it JSON text)."""

    __slots__ = ("chunks", "size")

    def __init__(self, chunks: list[memoryview], size: int) -> None:
        self.chunks = chunks
        self.size = size

    def join(self) -> str:
        """The value decoded whole (for a column that is not text)."""
        return b"".join(self.chunks).decode("utf-8", "replace")


# LargeValue: from decode_chunks with ``large_over``; JsonPieces: a LargeValue of a
# text column made its JSON text (large_values.py), never by the decoder here.
TupleValue: TypeAlias = str | UnchangedToast | bytes | LargeValue | JsonPieces | None
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


class _Reader:
    """Sequential reads of one message laid over a frame's chunks.

    A frame of one chunk is the common case: each read is a slice of it, checked by
    one comparison. A frame too large to join (``connection.FramePieces``) is read
    across its chunk edges the same way, and :meth:`views` hands out a large value
    as views of the chunks, uncopied. Offsets in errors count from the message's
    first byte.
    """

    __slots__ = ("_base", "_chunks", "_data", "_i", "_p", "size")

    def __init__(self, chunks: Sequence[bytes], offset: int) -> None:
        self._chunks = chunks
        self._i = 0
        self._data = chunks[0]
        self._p = offset
        self._base = -offset  # the message offset of the current chunk's first byte
        self.size = (len(self._data) if len(chunks) == 1 else sum(map(len, chunks))) - offset
        while self._p >= len(self._data) and self._i < len(chunks) - 1:  # a short chunk 0
            carry = self._p - len(self._data)
            self._next_chunk()
            self._p = carry

    @property
    def pos(self) -> int:
        """Offset of the next byte, from the message's first byte."""
        return self._base + self._p

    def take(self, n: int, what: str) -> bytes:
        p = self._p
        end = p + n
        if n >= 0 and end <= len(self._data):
            self._p = end
            return self._data[p:end]
        return b"".join(self.views(n, what))

    def byte(self, what: str) -> int:
        p = self._p
        if p < len(self._data):
            self._p = p + 1
            return self._data[p]
        return self.take(1, what)[0]

    def unpack(self, s: struct.Struct, what: str) -> tuple[int, ...]:
        p = self._p
        if p + s.size <= len(self._data):
            self._p = p + s.size
            return s.unpack_from(self._data, p)
        return s.unpack(self.take(s.size, what))

    def cstring(self, what: str) -> str:
        at = self.pos
        parts: list[bytes] = []
        while (end := self._data.find(b"\0", self._p)) < 0:
            parts.append(self._data[self._p :])
            if not self._next_chunk():
                raise _Truncated(at, f"{what} (no NUL terminator)")
        parts.append(self._data[self._p : end])
        self._p = end + 1
        text = parts[0] if len(parts) == 1 else b"".join(parts)
        return text.decode("utf-8", "replace")

    def views(self, n: int, what: str) -> list[memoryview]:
        """The next ``n`` bytes as views of the chunks (no copy). ``what`` names
        them in an error, ``{n}`` in it their count (formatted only then)."""
        if n < 0 or self.pos + n > self.size:
            raise _Truncated(self.pos, what.format(n=n))
        out: list[memoryview] = []
        while n:
            if self._p == len(self._data):
                self._next_chunk()
            k = min(n, len(self._data) - self._p)
            out.append(memoryview(self._data)[self._p : self._p + k])
            self._p += k
            n -= k
        return out

    def _next_chunk(self) -> bool:
        if self._i == len(self._chunks) - 1:
            return False
        self._base += len(self._data)
        self._i += 1
        self._data = self._chunks[self._i]
        self._p = 0
        return True


_U8: Final = struct.Struct(">B")
_I16: Final = struct.Struct(">h")
_I32: Final = struct.Struct(">i")
_U32: Final = struct.Struct(">I")
_BEGIN: Final = struct.Struct(">Qqi")
_COMMIT: Final = struct.Struct(">BQQq")
_ORIGIN_LSN: Final = struct.Struct(">Q")
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
    return decode_chunks((payload if type(payload) is bytes else bytes(payload),), 0)


def decode_chunks(
    chunks: Sequence[bytes], offset: int, *, large_over: int | None = None
) -> PgOutputMessage:
    """Decode the pgoutput message at ``offset`` of the frame made of ``chunks`` (one
    chunk, or the pieces of a frame too large to join). With ``large_over``, a text
    value over that many bytes is a :class:`LargeValue` instead of a ``str``."""
    r = _Reader(chunks, offset)
    if r.size <= 0:
        raise PgOutputError("empty pgoutput message")
    kind = r.byte("message type")
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise PgOutputError(f"unknown pgoutput message type {bytes([kind])!r} at offset 0")
    try:
        message = decoder(r, large_over)
    except _Truncated as e:
        raise PgOutputError(
            f"pgoutput {chr(kind)!r} message truncated: {e.what} at offset {e.offset} "
            f"runs past the end ({r.size} bytes)"
        ) from None
    end = r._base + r._p  # r.pos, inline: this runs for every message
    if end != r.size:
        raise PgOutputError(
            f"pgoutput {chr(kind)!r} message has {r.size - end} unexpected trailing "
            f"byte(s) at offset {end}"
        )
    return message


def _begin(r: _Reader, _: int | None) -> Begin:
    lsn, time, xid = r.unpack(_BEGIN, "Begin fields")
    return Begin(lsn, time + PG_EPOCH_OFFSET_US, xid)


def _commit(r: _Reader, _: int | None) -> Commit:
    flags, lsn, end_lsn, time = r.unpack(_COMMIT, "Commit fields")
    return Commit(flags, lsn, end_lsn, time + PG_EPOCH_OFFSET_US)


def _origin(r: _Reader, _: int | None) -> Origin:
    (lsn,) = r.unpack(_ORIGIN_LSN, "origin commit LSN")
    return Origin(lsn, r.cstring("origin name"))


def _type(r: _Reader, _: int | None) -> TypeMessage:
    (oid,) = r.unpack(_U32, "type OID")
    return TypeMessage(oid, r.cstring("type namespace"), r.cstring("type name"))


def _relation(r: _Reader, _: int | None) -> Relation:
    (oid,) = r.unpack(_U32, "relation OID")
    namespace = r.cstring("relation namespace")
    name = r.cstring("relation name")
    at = r.pos
    ident_byte = r.byte("replica identity")
    ident = _REPLICA_IDENTITIES.get(ident_byte)
    if ident is None:
        raise PgOutputError(
            f"pgoutput 'R' message: unknown replica identity {bytes([ident_byte])!r} at offset {at}"
        )
    (ncols,) = r.unpack(_I16, "column count")
    columns: list[RelationColumn] = []
    for _ in range(ncols):
        flags = r.byte("column flags")
        col_name = r.cstring("column name")
        type_oid, typmod = r.unpack(_COLUMN_TYPE, "column type")
        columns.append(RelationColumn(col_name, type_oid, typmod, bool(flags & 1)))
    return Relation(oid, namespace, name, ident, tuple(columns))


_VALUE: Final = "column value of {n} bytes"


def _tuple(r: _Reader, large_over: int | None) -> TupleData:
    """Read TupleData: the hot loop of the decoder, one iteration per column."""
    (ncols,) = r.unpack(_I16, "tuple column count")
    values: list[TupleValue] = []
    append = values.append
    byte, unpack, take = r.byte, r.unpack, r.take
    for _ in range(ncols):
        kind = byte("tuple column kind")
        if kind == 0x74:  # t
            (n,) = unpack(_I32, "column value length")
            if large_over is not None and n > large_over:
                append(LargeValue(r.views(n, _VALUE), n))
                continue
            chunk = take(n, _VALUE)
            try:
                append(chunk.decode())  # strict UTF-8 without arguments is the fast call
            except UnicodeDecodeError:
                append(chunk.decode("utf-8", "replace"))
        elif kind == 0x6E:  # n
            append(None)
        elif kind == 0x75:  # u
            append(UNCHANGED_TOAST)
        elif kind == 0x62:  # b
            (n,) = unpack(_I32, "column value length")
            append(take(n, _VALUE))
        else:
            at = r.pos - 1
            raise PgOutputError(f"unknown tuple column kind {bytes([kind])!r} at offset {at}")
    return tuple(values)


def _expect(r: _Reader, kind: str, allowed: bytes, what: str) -> int:
    at = r.pos
    byte = r.byte(what)
    if byte not in allowed:
        raise PgOutputError(
            f"pgoutput {kind!r} message: expected {what} "
            f"({' or '.join(repr(chr(b)) for b in allowed)}), got {bytes([byte])!r} at offset {at}"
        )
    return byte


def _insert(r: _Reader, large_over: int | None) -> Insert:
    (oid,) = r.unpack(_U32, "relation OID")
    _expect(r, "I", b"N", "new tuple marker")
    return Insert(oid, _tuple(r, large_over))


def _update(r: _Reader, large_over: int | None) -> Update:
    (oid,) = r.unpack(_U32, "relation OID")
    marker = _expect(r, "U", b"KON", "tuple marker")
    if marker == 0x4E:  # N: no old tuple
        return Update(oid, None, None, _tuple(r, large_over))
    old = _tuple(r, large_over)
    _expect(r, "U", b"N", "new tuple marker")
    return Update(oid, "K" if marker == 0x4B else "O", old, _tuple(r, large_over))


def _delete(r: _Reader, large_over: int | None) -> Delete:
    (oid,) = r.unpack(_U32, "relation OID")
    marker = _expect(r, "D", b"KO", "old tuple marker")
    return Delete(oid, "K" if marker == 0x4B else "O", _tuple(r, large_over))


def _truncate(r: _Reader, _: int | None) -> Truncate:
    count, options = r.unpack(_TRUNCATE_HEAD, "truncate header")
    if count < 0:
        raise PgOutputError(f"pgoutput 'T' message: negative relation count {count} at offset 1")
    oids = struct.unpack(f">{count}I", r.take(4 * count, f"{count} relation OIDs"))
    return Truncate(oids, bool(options & 1), bool(options & 2))


def _message(r: _Reader, _: int | None) -> LogicalMessage:
    flags, lsn = r.unpack(_MESSAGE_HEAD, "message header")
    prefix = r.cstring("message prefix")
    (n,) = r.unpack(_I32, "content length")
    return LogicalMessage(bool(flags & 1), lsn, prefix, r.take(n, "message content of {n} bytes"))


_DECODERS: Final[dict[int, Callable[[_Reader, int | None], PgOutputMessage]]] = {
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
