"""Postgres ``COPY … TO STDOUT`` text format: one row per line, fields split by tabs.

The initial sync copies tables in text format because every field then is exactly the
text pgoutput sends for the same value (the type's output function), so one set of
value parsers (:mod:`app.sources.postgres.values`) serves both the copy and the stream.

Format (PostgreSQL docs, "COPY", text format): ``\\N`` is NULL; a backslash escapes
``\\b \\f \\n \\r \\t \\v \\\\``, an octal byte ``\\ooo`` or a hex byte ``\\xhh``; any other
escaped character stands for itself. Escaped bytes are decoded as UTF-8 with the rest
of the field.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["CopyFormatError", "parse_copy_line"]

_SIMPLE: Final = {
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
}
_ESCAPE: Final = re.compile(r"\\(?:([0-7]{1,3})|x([0-9A-Fa-f]{1,2})|(.))", re.DOTALL)


class CopyFormatError(ValueError):
    """A line that is not COPY text format."""


def parse_copy_line(line: bytes | bytearray | memoryview, n_columns: int) -> list[str | None]:
    """One row: ``None`` for NULL, the unescaped text otherwise."""
    try:
        text = str(line, "utf-8")  # no copy of the bytes first (memoryview or bytes)
    except UnicodeDecodeError as e:
        shown = str(line, "utf-8", "replace").removesuffix("\n")[:200]
        raise CopyFormatError(f"COPY row is not UTF-8: {shown!r}") from e
    if text.endswith("\n"):
        text = text[:-1]
    fields: list[str | None] = list(text.split("\t"))
    if len(fields) != n_columns:
        raise CopyFormatError(
            f"COPY row has {len(fields)} fields, expected {n_columns}: {text[:200]!r}"
        )
    if "\\" not in text:
        return fields  # no NULL and no escape anywhere: the common row
    for i, f in enumerate(fields):
        assert f is not None
        if "\\" in f:
            fields[i] = None if f == "\\N" else _unescape(f)
    return fields


def _unescape(field: str) -> str:
    # Octal/hex escapes are bytes: rebuild the field as bytes, then decode once.
    out = bytearray()
    pos = 0
    for m in _ESCAPE.finditer(field):
        out += field[pos : m.start()].encode()
        if m.group(1) is not None:
            out.append(int(m.group(1), 8) & 0xFF)
        elif m.group(2) is not None:
            out.append(int(m.group(2), 16))
        else:
            out += _SIMPLE.get(m.group(3), m.group(3)).encode()
        pos = m.end()
    out += field[pos:].encode()
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CopyFormatError(f"COPY field is not UTF-8 after unescaping: {field[:200]!r}") from e
