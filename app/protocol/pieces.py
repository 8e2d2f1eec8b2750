"""Text too large to hold whole: a JSON text kept as the pieces it arrived in.

A change with a 100 MB value must go from the upstream to every subscriber and
into the change log without the event loop ever touching the whole value in one
call: a single C call over 100 MB (a copy, an encode, an escape) holds the GIL
for 25-160 ms, and every other subscriber's pings and frames wait that long
(decision 44). So a large text travels as ``Pieces``: the same characters, in
order, cut into strings of at most ``PIECE_CHARS``. Each stage handles one piece
per call — the websocket sends it as one fragment of the message, the change DB
writer appends it — and may yield to the loop between pieces.

``Pieces`` stands wherever a message's JSON text does (``Change.json``, a stored
row's change text), beside plain ``str``: ``len`` is the number of characters
(the byte accounting of every bound uses it, as for ``str``), and the few
operations the change path applies to message text are here, each costing
O(pieces) rather than O(characters). There is deliberately no ``__str__``: the
one way to a whole string is ``join()``, which belongs only where a stall does
not matter (a child process, a test).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator
from typing import Final

__all__ = [
    "LARGE_TEXT_CHARS",
    "PIECE_CHARS",
    "Pieces",
    "Text",
    "decode_pieces",
    "join_text",
    "text_pieces",
]

# At most this many characters a piece: at most 1 MiB of UTF-8, copied or
# escaped in well under a millisecond here.
PIECE_CHARS: Final = 256 * 1024
# A text longer than this is kept (or read back) as pieces; shorter ones stay
# plain strings, so the common path never sees a ``Pieces``.
LARGE_TEXT_CHARS: Final = 4 * PIECE_CHARS


class Pieces:
    """A text as an ordered tuple of non-empty strings (``parts``)."""

    __slots__ = ("_length", "parts")

    def __init__(self, parts: Iterable[str]) -> None:
        kept = tuple(p for p in parts if p)
        if not kept:
            raise ValueError("Pieces needs at least one non-empty piece")
        self.parts: tuple[str, ...] = kept
        self._length = sum(map(len, kept))

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        head = self.parts[0][:24]
        return f"Pieces({len(self.parts)} pieces, {self._length} chars, {head!r}...)"

    def __eq__(self, other: object) -> bool:
        # By content, whatever the cut: a test may compare a stream's text with
        # what the log gives back. O(characters); not for the hot path.
        if isinstance(other, Pieces):
            return self._length == other._length and self.join() == other.join()
        return NotImplemented

    def __hash__(self) -> int:
        raise TypeError("Pieces are not hashable")

    def __add__(self, other: str) -> Pieces:
        if not isinstance(other, str):
            return NotImplemented
        return Pieces((*self.parts[:-1], self.parts[-1] + other)) if other else self

    def __radd__(self, other: str) -> Pieces:
        if not isinstance(other, str):
            return NotImplemented
        return Pieces((other + self.parts[0], *self.parts[1:])) if other else self

    def head(self, n: int) -> str:
        """The first ``n`` characters (at most), for tag and prefix checks."""
        out: list[str] = []
        for part in self.parts:
            if n <= 0:
                break
            out.append(part[:n])
            n -= len(part)
        return "".join(out)

    def tail(self, n: int) -> str:
        """The last ``n`` characters (at most)."""
        out: list[str] = []
        for part in reversed(self.parts):
            if n <= 0:
                break
            out.append(part[-n:])
            n -= len(part)
        return "".join(reversed(out))

    def trim(self, start: int, end: int) -> Pieces | str:
        """The text without its first ``start`` and last ``end`` characters (both
        within a few pieces of the ends): what ``text[start:-end]`` is for a str."""
        if start < 0 or end < 0 or start + end > self._length:
            raise ValueError(f"cannot trim {start} + {end} characters off {self._length}")
        parts = list(self.parts)
        while start and parts:
            first = parts[0]
            if len(first) <= start:
                start -= len(first)
                parts.pop(0)
            else:
                parts[0], start = first[start:], 0
        while end and parts:
            last = parts[-1]
            if len(last) <= end:
                end -= len(last)
                parts.pop()
            else:
                parts[-1], end = last[: len(last) - end], 0
        parts = [p for p in parts if p]
        if not parts:
            return ""
        return parts[0] if len(parts) == 1 else Pieces(parts)

    def join(self) -> str:
        """The whole text in one string: O(characters), holding the GIL throughout."""
        return "".join(self.parts)

    def utf8(self) -> Iterator[bytes]:
        """The text's UTF-8 encoding, a piece at a time."""
        for part in self.parts:
            yield part.encode()

    def utf8_length(self) -> int:
        """Bytes of the text's UTF-8 encoding (one pass over each piece)."""
        return sum(len(p) if p.isascii() else len(p.encode()) for p in self.parts)


Text = str | Pieces
"""A message's or a stored change's JSON text: whole, or in pieces."""


def text_pieces(text: str, size: int = PIECE_CHARS) -> Pieces | str:
    """``text`` cut into pieces of ``size`` characters if it is longer than
    ``LARGE_TEXT_CHARS``; otherwise ``text`` itself. (The cut is one O(n) pass:
    for texts that are already whole, e.g. in tests and child processes.)"""
    if len(text) <= LARGE_TEXT_CHARS:
        return text
    return Pieces(text[i : i + size] for i in range(0, len(text), size))


def decode_pieces(chunks: Iterable[bytes | memoryview]) -> Pieces | str:
    """UTF-8 ``chunks`` (cut anywhere, even inside a character) as text: one
    decoded piece per chunk, so each chunk should be at most ``PIECE_CHARS``
    bytes. Raises ``UnicodeDecodeError`` on invalid UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    parts = [decoder.decode(chunk) for chunk in chunks]
    parts.append(decoder.decode(b"", final=True))
    parts = [p for p in parts if p]
    if not parts:
        return ""
    return parts[0] if len(parts) == 1 else Pieces(parts)


def join_text(text: Text) -> str:
    """``text`` as one string (see ``Pieces.join``: not on the event loop for a
    large text)."""
    return text if isinstance(text, str) else text.join()
