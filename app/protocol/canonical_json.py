"""The project's one JSON codec: byte-for-byte what zero-cache (Node) reads and writes.

zero-cache serializes with ``JSON.stringify`` plus a BigInt extension, so the
canonical text of a value is:

* compact (no whitespace), object keys in insertion order, tuples as arrays;
* integers of any size as bare digits (JS: BigInt outside +-(2^53-1));
* floats as JS ``String(x)`` writes them (``1.0`` -> ``1``, ``1e21`` -> ``1e+21``,
  see :mod:`app.protocol.js_number`); NaN and Infinity are rejected, not nulled;
* strings with non-ASCII characters raw (UTF-8), ``"`` and ``\\`` escaped,
  ``\\b \\f \\n \\r \\t``, other C0 controls as ``\\u00xx`` (lower-case hex), DEL and
  U+2028/U+2029 raw, lone surrogates as ``\\udxxx`` (JS's well-formed stringify).

Parsing mirrors zero's number rule: integer lexemes become exact Python ints of any
size, everything else (``1.0``, ``1e3``) a float.  A float that is integral prints
like an int, so ``dumps(loads("1.0")) == "1"`` exactly as in JS.

Known difference from JS (kept on purpose): JS objects hoist "array index" keys
(``"0"``..``"4294967294"``) to the front in numeric order, so ``JSON.stringify``
of ``{"b":1,"1":2}`` gives ``{"1":2,"b":1}``.  We keep insertion order: key order
has no meaning to any peer, and detecting such keys would cost every message.

Speed (this is on the hot path: every change is serialized once).  The fast path is
``orjson.dumps`` plus cheap scans of its output for what orjson writes differently
from JS: integral floats (``1.0``), exponent floats (``1e+16``, ``1e-6``), and
``null`` (orjson writes NaN/Infinity as null, so a null triggers a C-speed
pre-check, then if needed a walk, looking for non-finite floats).  Floats that
orjson formats differently are replaced by pre-formatted ``orjson.Fragment``s and
orjson runs again; big ints and lone surrogates take a pure-Python encoder.
``loads`` is orjson unless the text holds a run of 19+ digits (orjson silently
turns integers outside the 64-bit range into floats) or orjson rejects it (lone
surrogate escapes, deep nesting); then the stdlib parser, exact for big ints, runs.

The fast path costs about 1.8 us for a ~220-byte insert, a Fragment pass about five
times that, the pure-Python encoder about six (docs/benchmarks.md, "canonical_json").
Producers that know a value is integral should pass an ``int``: same output, fast path.
"""

from __future__ import annotations

import json
import marshal
import math
import re
from collections.abc import Callable
from json.encoder import encode_basestring  # the C implementation when available
from typing import Any, Final

import orjson

from app import speedups
from app.protocol.js_number import format_js_number
from app.protocol.pieces import Pieces, Text

__all__ = ["JsonPieces", "dumps", "dumps_text", "encode_fast", "json_string_piece", "loads"]

# datetime and dataclass values are not JSON; without these flags orjson would
# quietly serialize them on the fast path while the slow path rejects them.
_ORJSON_OPTIONS: Final = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS

# orjson writes integral floats as "1.0" and switches to exponent notation at
# other thresholds than JS ("1e+16", "1e-6").  Every other float token it writes
# (non-integral, plain notation) is already JS's text: same shortest digits, same
# layout.  Inside a container a number token always ends at , ] or }, which keeps
# look-alikes inside strings (the "1e-6" in a UUID such as "..3f1e-6a7d..") out.
# A string that does contain e.g. "v1.0," merely takes the slow path.
_ORJSON_INTEGRAL_FLOAT: Final = re.compile(rb"\.0[,\]}]")
_ORJSON_EXPONENT_FLOAT: Final = re.compile(rb"e[+-]\d+[,\]}]")

# What scanning orjson's output tells (flags or-ed): a float it writes
# differently from JS, or a null (which may be a NaN or an Infinity).
_SCAN_INTEGRAL_FLOAT: Final = 1
_SCAN_EXPONENT_FLOAT: Final = 2
_SCAN_FLOATS: Final = _SCAN_INTEGRAL_FLOAT | _SCAN_EXPONENT_FLOAT
_SCAN_NULL: Final = 4


def scan_py(out: bytes) -> int:
    """The scan in Python: three passes (~1.2 us on a ~220-byte change)."""
    flags = 0
    if _ORJSON_INTEGRAL_FLOAT.search(out):
        flags |= _SCAN_INTEGRAL_FLOAT
    if _ORJSON_EXPONENT_FLOAT.search(out):
        flags |= _SCAN_EXPONENT_FLOAT
    if b"null" in out:
        flags |= _SCAN_NULL
    return flags


def _encode_fast_py(value: Any) -> str | None:
    """orjson's text of ``value`` when it is already canonical, else None.

    None sends ``dumps`` down its full path: orjson failed, wrote a float JS writes
    differently, or wrote a null that may be a NaN or an Infinity.
    """
    if type(value) not in _FAST_TYPES:
        return None
    try:
        out = orjson.dumps(value, option=_ORJSON_OPTIONS)
    except orjson.JSONEncodeError:
        return None
    flags = _scan(out)
    if flags & _SCAN_FLOATS or (flags & _SCAN_NULL and _may_hold_non_finite(value)):
        return None
    return out.decode()


_FAST_TYPES: Final = frozenset({dict, list, tuple})

# The same scan, and the whole fast path, in C (app/protocol/_jsscan.c, an optional
# extension of the package build; app/speedups.py picks): one pass, and no Python
# frame between orjson and the str.
_scan: Callable[[bytes], int]
encode_fast: Callable[[Any], str | None]
_jsscan = speedups.module("jsscan")
if _jsscan is None:  # not built here, or CHANGESTREAMER_SPEEDUPS=0: same answers, slower
    _scan = scan_py
    encode_fast = _encode_fast_py
else:
    _scan = _jsscan.scan
    encode_fast = _jsscan.encode

_PLAIN_LEAVES: Final = frozenset({str, int, bool, type(None)})
# Tuples, not X | Y unions: isinstance is several times faster with a tuple.
_CONTAINERS: Final = (dict, list, tuple)
_SEQUENCES: Final = (list, tuple)

_MARSHAL_NON_FINITE_FLOAT: Final = re.compile(rb"g.{6}[\xf0-\xff][\x7f\xff]", re.DOTALL)

_SURROGATE: Final = re.compile("[\ud800-\udbff][\udc00-\udfff]|[\ud800-\udfff]")

# Integers outside i64/u64 have at least 19 digits; orjson parses them as floats.
_DIGITS_TO_ZERO: Final = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGIT_RUN: Final = b"0" * 19


def dumps(value: Any) -> str:
    """Serialize ``value`` to its canonical JSON text (see module docstring)."""
    text = encode_fast(value)
    if text is not None:
        return text
    t = type(value)
    if t is list or t is dict or t is tuple:
        try:
            out = orjson.dumps(value, option=_ORJSON_OPTIONS)
        except orjson.JSONEncodeError:
            # Big ints, lone surrogates, nesting deeper than orjson's limit, or a
            # type that is not JSON: the slow path handles or reports each.
            return _dumps_slow(value)
        flags = _scan(out)
        if flags & _SCAN_FLOATS:
            # Let orjson write everything but the floats, which we format as JS does.
            try:
                return orjson.dumps(_with_js_floats(value)).decode()
            except orjson.JSONEncodeError:
                # At orjson's depth limit: the copy has lists where value had tuples,
                # which orjson lets nest one level deeper.
                return _dumps_slow(value)
        if flags & _SCAN_NULL and _may_hold_non_finite(value):
            _reject_non_finite(value)
        return out.decode()
    return _dumps_slow(value)


class JsonPieces:
    """A value whose canonical JSON text is already written, in pieces: a large
    string's quoted, escaped text (``json_string_piece`` per piece), made by the
    source a piece at a time. ``dumps_text`` splices it into its row's text
    without touching its characters; ``dumps`` refuses it, as any non-JSON type."""

    __slots__ = ("text",)

    def __init__(self, text: Pieces) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"JsonPieces({self.text!r})"


def json_string_piece(piece: str) -> str:
    """The escaped characters of ``piece`` as they stand inside a JSON string (no
    quotes), byte for byte as ``JSON.stringify`` writes them. Escaping is per
    character, so the pieces of a string escape to the pieces of its text; a
    piece must not end between the two halves of a surrogate pair (text decoded
    from UTF-8 has none). orjson writes a string exactly as JS does and is 10-25
    times faster than ``encode_basestring`` here (0.05 against 0.5-1.3 ms for
    256 Ki characters); it refuses lone surrogates, which the slow path writes."""
    try:
        return orjson.dumps(piece)[1:-1].decode()
    except orjson.JSONEncodeError:
        return _dumps_slow(piece)[1:-1]


def dumps_text(value: Any) -> Text:
    """``dumps``, except that ``value`` may hold ``JsonPieces``: its text is then
    ``Pieces``, built in O(pieces) from the pre-written texts (the rest of the
    value is written by the pure-Python encoder, which is slower per value but
    only rows with a large value come this way)."""
    text = encode_fast(value)
    if text is not None:
        return text
    try:
        return dumps(value)
    except TypeError:
        pass  # a JsonPieces, or a value that is not JSON (which _encode reports)
    parts: list[str | JsonPieces] = []
    _encode(value, parts, pieces=True)
    out: list[str] = []
    run: list[str] = []
    for part in parts:
        if isinstance(part, JsonPieces):
            if run:
                out.append(_fix_surrogates("".join(run)))
                run = []
            out.extend(part.text.parts)
        else:
            run.append(part)
    if run:
        out.append(_fix_surrogates("".join(run)))
    return Pieces(out)


def loads(text: str | bytes) -> Any:
    """Parse JSON text; integer lexemes become exact ints of any size."""
    if isinstance(text, str):
        try:
            raw = text.encode()
        except UnicodeEncodeError:  # raw lone surrogates in a Python str
            return _loads_slow(text)
    elif isinstance(text, (bytes, bytearray)):
        raw = bytes(text)
    else:
        raise TypeError(f"JSON text must be str or bytes, not {type(text).__name__}")
    if _LONG_DIGIT_RUN in raw.translate(_DIGITS_TO_ZERO):
        return _loads_slow(raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        # Either invalid JSON (the stdlib parser reports it) or valid JSON orjson
        # refuses: lone surrogate escapes such as "\ud800", very deep nesting.
        return _loads_slow(raw)


# --- slow paths -------------------------------------------------------------------


def _dumps_slow(value: Any) -> str:
    parts: list[str] = []
    _encode(value, parts)
    return _fix_surrogates("".join(parts))


def _fix_surrogates(text: str) -> str:
    if not text.isascii() and _SURROGATE.search(text):
        text = _SURROGATE.sub(_surrogate_replacement, text)
    return text


def _surrogate_replacement(m: re.Match[str]) -> str:
    s = m.group()
    if len(s) == 2:
        # A high+low pair is one astral character in JS (a Python str can hold the
        # two halves separately, e.g. after parsing "\ud83d\ude00" piecewise).
        return chr(0x10000 + ((ord(s[0]) - 0xD800) << 10) + (ord(s[1]) - 0xDC00))
    return f"\\u{ord(s):04x}"


def _encode(value: Any, parts: list[Any], *, pieces: bool = False) -> None:
    """The pure-Python encoder: iterative, so nesting depth is limited only by memory.
    With ``pieces`` (``dumps_text``) a ``JsonPieces`` is appended as it is;
    otherwise it is not JSON, like any other type."""
    append = parts.append
    # One entry per open container: [iterator, is_object, has_written_an_item].
    stack: list[list[Any]] = []
    v = value
    while True:
        t = type(v)
        if t is str:
            append(encode_basestring(v))
        elif t is int:
            append(int.__repr__(v))
        elif t is float:
            append(format_js_number(v))
        elif v is None:
            append("null")
        elif v is True:
            append("true")
        elif v is False:
            append("false")
        elif isinstance(v, dict):
            if v:
                append("{")
                stack.append([iter(v.items()), True, False])
            else:
                append("{}")
        elif isinstance(v, _SEQUENCES):
            if v:
                append("[")
                stack.append([iter(v), False, False])
            else:
                append("[]")
        # Subclasses (IntEnum, str enums, ...) are written as their JSON base type.
        elif isinstance(v, str):
            append(encode_basestring(str.__str__(v)))
        elif isinstance(v, int):
            append(int.__repr__(v))
        elif isinstance(v, float):
            append(format_js_number(float(v)))
        elif pieces and t is JsonPieces:
            append(v)
        else:
            raise TypeError(f"Object of type {type(v).__name__} is not JSON serializable")

        # Move to the next value to write, closing finished containers.
        while stack:
            top = stack[-1]
            item: Any = next(top[0], _END)
            if item is _END:
                append("}" if top[1] else "]")
                stack.pop()
                continue
            if top[2]:
                append(",")
            else:
                top[2] = True
            if top[1]:
                key, item = item
                if not isinstance(key, str):
                    raise TypeError(f"JSON object keys must be str, got {type(key).__name__}")
                append(encode_basestring(str.__str__(key)))
                append(":")
            v = item
            break
        else:
            return


_END: Final = object()


def _may_hold_non_finite(value: Any) -> bool:
    """Cheap pre-check for the walk below; False means certainly no NaN/Infinity.

    orjson writes NaN and Infinity as null, so a null in its output may hide one.
    marshal (format 2) serializes exactly the JSON types in C and writes every float
    as ``g`` + 8 little-endian IEEE bytes; a non-finite double has all exponent bits
    set, i.e. its last two bytes are ``[f0-ff] [7f|ff]``.  This costs a fraction of a
    Python-level walk.  A match may be a false positive (the walk then decides).
    """
    try:
        packed = marshal.dumps(value, 2)
    except ValueError:  # subclasses of the JSON types are not marshallable
        return True
    return _MARSHAL_NON_FINITE_FLOAT.search(packed) is not None


def _reject_non_finite(value: Any) -> None:
    # orjson writes NaN/Infinity as null; find them before that reaches the wire.
    stack = [value]
    while stack:
        container = stack.pop()
        items = container.values() if isinstance(container, dict) else container
        # set(map(type, ...)) runs in C: most containers hold only plain leaves.
        if set(map(type, items)) <= _PLAIN_LEAVES:
            continue
        for item in items:
            if isinstance(item, float):
                if not math.isfinite(item):
                    format_js_number(item)  # raises the one error for non-finite numbers
            elif isinstance(item, _CONTAINERS):
                stack.append(item)


def _with_js_floats(value: Any) -> Any:
    """``value`` with every float replaced by a pre-formatted ``orjson.Fragment``.

    Only containers on the way to a float are copied; the rest is shared.
    """
    is_dict = isinstance(value, dict)
    items = value.values() if is_dict else value
    if set(map(type, items)) <= _PLAIN_LEAVES:
        return value
    replaced: dict[Any, Any] = {}
    for key, item in value.items() if is_dict else enumerate(value):
        if isinstance(item, float):
            replaced[key] = orjson.Fragment(format_js_number(item))
        elif isinstance(item, _CONTAINERS):
            new = _with_js_floats(item)
            if new is not item:
                replaced[key] = new
    if not replaced:
        return value
    copy = dict(value) if is_dict else list(value)
    for key, new in replaced.items():
        copy[key] = new
    return copy


def _loads_slow(text: str | bytes) -> Any:
    if isinstance(text, bytes):
        text = text.decode("utf-8")  # strict: UnicodeDecodeError is a ValueError
    try:
        return json.loads(text, parse_float=_parse_float, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("JSON text is nested too deeply") from None


def _parse_float(lexeme: str) -> float:
    x = float(lexeme)
    if not math.isfinite(x):
        # JS would read Infinity and later write null; refusing keeps data intact.
        raise ValueError(f"JSON number {lexeme} is outside the range of a double")
    return x


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


if _jsscan is not None:
    # The C fast path calls these; they are defined above.
    _jsscan.setup(orjson.dumps, _ORJSON_OPTIONS, _may_hold_non_finite)
