"""Postgres array literals (``array_out`` text) → nested Python lists.

The grammar, as Postgres writes it (and, leniently, as it reads it):

* an optional dimension decoration ``[lo:hi][lo:hi]...=`` when a lower bound is not 1
  (ignored: JSON arrays have no bounds);
* ``{`` elements separated by the element type's delimiter ``}`` (``,`` for almost
  every type, ``;`` for ``box``), nested one level of braces per dimension;
* an element is either **quoted** (``"..."`` with ``\\"`` and ``\\\\`` escapes; a
  quoted ``"NULL"`` is the string) or **unquoted** (may carry backslash escapes, is
  trimmed of surrounding whitespace, and the bare word ``NULL`` in any case is SQL NULL).

SQL NULL elements become ``None`` for every element type; other elements go through
the element parser.  One-dimensional arrays without quotes, escapes or whitespace (the
common ``{1,2,3}``) take a fast path of one ``str.split``; everything else is tokenized
with one compiled regular expression per delimiter, never character by character.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any, Final

__all__ = ["ArrayLiteralError", "parse_array"]


class ArrayLiteralError(ValueError):
    """Text that is not a well-formed Postgres array literal."""


_DIMENSIONS: Final = re.compile(r"\s*(?:\[\s*-?\d+\s*:\s*-?\d+\s*\]\s*)+=\s*")
_UNESCAPE: Final = re.compile(r"\\(.)", re.DOTALL)


@lru_cache(maxsize=8)
def _patterns(delimiter: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    d = re.escape(delimiter)
    # Characters that end an unquoted element (besides whitespace at its end).
    plain = rf'[^{{}}"\\{d}\s]|\\.'
    token = re.compile(
        r"\s*(?:"
        r"(?P<open>\{)|(?P<close>\})"
        rf"|(?P<delim>{d})"
        r'|"(?P<quoted>(?:[^"\\]|\\.)*)"'
        rf"|(?P<plain>(?:{plain})+(?:\s+(?:{plain})+)*)"
        r")",
        re.DOTALL,
    )
    # Anything that rules out the split fast path.
    slow = re.compile(r'["\\{}\s]')
    return token, slow


def parse_array(text: str, element: Callable[[str], Any], delimiter: str = ",") -> list[Any]:
    """Parse an array literal, converting each non-NULL element with ``element``."""
    token, slow = _patterns(delimiter)
    start = 0
    if text[:1] != "{":
        start = len(text) - len(text.lstrip())
        m = _DIMENSIONS.match(text, start)
        if m is not None:
            start = m.end()
        if text[start : start + 1] != "{":
            raise ArrayLiteralError(f"array literal {text!r}: expected '{{' at {start}")
    end = len(text)
    if end - start >= 2 and text[end - 1] == "}" and slow.search(text, start + 1, end - 1) is None:
        if end - start == 2:
            return []
        items = text[start + 1 : end - 1].split(delimiter)
        if "" not in items:  # an empty unquoted element is an error: the slow path says so
            return [None if item.upper() == "NULL" else element(item) for item in items]
    return _parse_slow(text, start, element, token)


def _parse_slow(
    text: str, pos: int, element: Callable[[str], Any], token: re.Pattern[str]
) -> list[Any]:
    root: list[Any] = []
    stack: list[list[Any]] = []
    current = root
    # What may come next: "open" only at the start, then an element/"{"/"}" after an
    # opening brace, a delimiter/"}" after an item, an element/"{" after a delimiter.
    expect_item = True
    just_opened = False
    size = len(text)
    m = token.match(text, pos)
    if m is None or m.lastgroup != "open":
        raise ArrayLiteralError(f"array literal {text!r}: expected '{{' at {pos}")
    pos = m.end()
    just_opened = True
    while True:
        m = token.match(text, pos)
        if m is None:
            rest = text[pos:].strip()
            where = f"unexpected {rest[:1]!r}" if rest else "unexpected end"
            raise ArrayLiteralError(f"array literal {text!r}: {where} at {pos}")
        kind = m.lastgroup
        if kind == "close":
            if expect_item and not just_opened:
                raise ArrayLiteralError(
                    f"array literal {text!r}: missing element before '}}' at {m.start()}"
                )
            if not stack:
                pos = m.end()
                break
            current = stack.pop()
            expect_item = False
            just_opened = False
        elif kind == "delim":
            if expect_item:
                raise ArrayLiteralError(
                    f"array literal {text!r}: missing element before delimiter at {m.start()}"
                )
            expect_item = True
            just_opened = False
        else:
            if not expect_item:
                raise ArrayLiteralError(
                    f"array literal {text!r}: missing delimiter before {m.start()}"
                )
            if kind == "open":
                child: list[Any] = []
                current.append(child)
                stack.append(current)
                current = child
                just_opened = True
                expect_item = True
            else:
                if kind == "quoted":
                    raw = m.group("quoted")
                    current.append(element(_UNESCAPE.sub(r"\1", raw) if "\\" in raw else raw))
                else:
                    raw = m.group("plain")
                    if "\\" in raw:
                        current.append(element(_UNESCAPE.sub(r"\1", raw)))
                    elif raw.upper() == "NULL":
                        current.append(None)
                    else:
                        current.append(element(raw))
                expect_item = False
                just_opened = False
        pos = m.end()
    if text[pos:size].strip():
        raise ArrayLiteralError(f"array literal {text!r}: unexpected text after '}}' at {pos}")
    return root
