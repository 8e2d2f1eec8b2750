"""Row changes too large to handle whole: decoded from the frame's chunks.

A replication frame over ``connection.CHUNK_BYTES`` arrives as the chunks it came
off the socket in (``FramePieces``), never joined (decision 46). When it holds a
row change (Insert, Update, Delete) this module decodes it straight from the
chunks: the small fields and values are read across chunk edges as usual, and a
value over ``LARGE_VALUE_BYTES`` stays a list of views of the chunks
(``LargeValue``). ``materialize`` then turns each large value of a text column
into its JSON string text in pieces (``JsonPieces``: UTF-8 decoded and escaped a
chunk at a time, the event loop free between chunks), which the row's change
text splices in (``canonical_json.dumps_text``). A large value of any other type
(an array, a number) is joined and parsed as usual: no such column holds
hundreds of MB in practice, and parsing it in pieces would need a parser per
type. Any other message in a large frame (a huge DDL message) is joined too.
"""

from __future__ import annotations

import asyncio
import codecs
import struct
from collections.abc import Sequence
from typing import Final, NamedTuple

from app.protocol.canonical_json import JsonPieces, json_string_piece
from app.protocol.pieces import PIECE_CHARS, Pieces
from app.sources.postgres.pgoutput import UNCHANGED_TOAST, OldKind, PgOutputError, TupleValue

__all__ = [
    "LARGE_VALUE_BYTES",
    "LargeRow",
    "LargeValue",
    "decode_row_chunks",
    "json_string_pieces",
]

# A text value over this many bytes in a large frame becomes pieces; smaller ones
# are decoded whole, which costs well under a millisecond.
LARGE_VALUE_BYTES: Final = 64 * 1024

_I16: Final = struct.Struct("!h")
_I32: Final = struct.Struct("!i")
_U32: Final = struct.Struct("!I")


class LargeValue:
    """A text column's value as views of the frame's chunks, in order."""

    __slots__ = ("chunks", "size")

    def __init__(self, chunks: list[memoryview], size: int) -> None:
        self.chunks = chunks
        self.size = size

    def join(self) -> str:
        """The value decoded whole (for a column that is not text)."""
        return b"".join(self.chunks).decode("utf-8", "replace")


Values = tuple[TupleValue | LargeValue, ...]


class LargeRow(NamedTuple):
    """A row change as ``decode_message`` gives it (``Insert``: no old tuple;
    ``Delete``: no new one), with ``LargeValue``s among its values."""

    kind: str  # "I", "U" or "D"
    relation_oid: int
    old_kind: OldKind | None
    old: Values | None
    new: Values | None


class _Cursor:
    """Sequential reads over chunks, across their edges."""

    def __init__(self, chunks: Sequence[bytes], offset: int) -> None:
        self._chunks = chunks
        self._i = 0
        self._p = 0
        self.offset = 0  # from the start of the frame, for error messages
        self._size = sum(map(len, chunks))
        self.take(offset, "frame header")

    @property
    def at_end(self) -> bool:
        return self.offset == self._size

    def views(self, n: int, what: str) -> list[memoryview]:
        """The next ``n`` bytes as views of the chunks (no copy)."""
        if n < 0 or self.offset + n > self._size:
            raise PgOutputError(
                f"pgoutput row message truncated: {what} at offset {self.offset} runs "
                f"past the end ({self._size} bytes)"
            )
        out: list[memoryview] = []
        while n:
            chunk = self._chunks[self._i]
            k = min(n, len(chunk) - self._p)
            if k:
                out.append(memoryview(chunk)[self._p : self._p + k])
            self._p += k
            n -= k
            self.offset += k
            if self._p == len(chunk):
                self._i, self._p = self._i + 1, 0
        return out

    def take(self, n: int, what: str) -> bytes:
        """The next ``n`` bytes, joined (for small fields)."""
        views = self.views(n, what)
        return bytes(views[0]) if len(views) == 1 else b"".join(views)

    def byte(self, what: str) -> int:
        return self.take(1, what)[0]


def decode_row_chunks(
    chunks: Sequence[bytes], offset: int, *, large_over: int | None = None
) -> LargeRow | None:
    """The row change at ``offset`` of the frame made of ``chunks``, its text values
    over ``large_over`` bytes as ``LargeValue``; None if the message there is not a
    row change (``large_over``: ``LARGE_VALUE_BYTES``). Raises ``PgOutputError``
    on a malformed message."""
    if large_over is None:
        large_over = LARGE_VALUE_BYTES
    cur = _Cursor(chunks, offset)
    kind = cur.byte("message type")
    if kind not in b"IUD":
        return None
    (oid,) = _U32.unpack(cur.take(4, "relation OID"))
    old_kind: OldKind | None = None
    old: Values | None = None
    new: Values | None = None
    if kind == ord("I"):
        _expect(cur, b"N")
        new = _tuple(cur, large_over)
    else:
        marker = _expect(cur, b"KON" if kind == ord("U") else b"KO")
        if marker != ord("N"):
            old_kind = "K" if marker == ord("K") else "O"
            old = _tuple(cur, large_over)
            if kind == ord("U"):
                _expect(cur, b"N")
        if kind == ord("U"):
            new = _tuple(cur, large_over)
    if not cur.at_end:
        raise PgOutputError(
            f"pgoutput {chr(kind)!r} message has unexpected trailing bytes at offset {cur.offset}"
        )
    return LargeRow(chr(kind), oid, old_kind, old, new)


def _expect(cur: _Cursor, allowed: bytes) -> int:
    at = cur.offset
    byte = cur.byte("tuple marker")
    if byte not in allowed:
        raise PgOutputError(f"unexpected tuple marker {bytes([byte])!r} at offset {at}")
    return byte


def _tuple(cur: _Cursor, large_over: int) -> Values:
    (ncols,) = _I16.unpack(cur.take(2, "tuple column count"))
    values: list[TupleValue | LargeValue] = []
    for _ in range(ncols):
        at = cur.offset
        kind = cur.byte("tuple column kind")
        if kind == 0x74:  # t
            (n,) = _I32.unpack(cur.take(4, "column value length"))
            if n > large_over:
                values.append(LargeValue(cur.views(n, f"column value of {n} bytes"), n))
            else:
                values.append(cur.take(n, f"column value of {n} bytes").decode("utf-8", "replace"))
        elif kind == 0x6E:  # n
            values.append(None)
        elif kind == 0x75:  # u
            values.append(UNCHANGED_TOAST)
        elif kind == 0x62:  # b
            (n,) = _I32.unpack(cur.take(4, "column value length"))
            values.append(cur.take(n, f"column value of {n} bytes"))
        else:
            raise PgOutputError(f"unknown tuple column kind {bytes([kind])!r} at offset {at}")
    return tuple(values)


async def json_string_pieces(value: LargeValue) -> JsonPieces:
    """The JSON string text of a large text value, a chunk per turn of the loop:
    UTF-8 decoded as the small path does (invalid bytes replaced) and escaped as
    ``JSON.stringify`` escapes, in pieces of at most ``PIECE_CHARS``."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    parts = ['"']
    for chunk in value.chunks:
        text = decoder.decode(chunk)
        for i in range(0, len(text), PIECE_CHARS):
            parts.append(json_string_piece(text[i : i + PIECE_CHARS]))
        del text
        await asyncio.sleep(0)
    rest = decoder.decode(b"", final=True)
    if rest:
        parts.append(json_string_piece(rest))
    parts.append('"')
    return JsonPieces(Pieces(parts))
