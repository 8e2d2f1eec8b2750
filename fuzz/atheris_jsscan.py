"""Atheris: canonical JSON's C fast path (app/protocol/_jsscan.c) against its Python twin.

    .venv/bin/python fuzz/atheris_jsscan.py -max_total_time=60 [libFuzzer options]

Each input is JSON text (or any bytes), or (first byte odd) a Python value built
from it, NaN, big ints and lone surrogates included. On text, ``scan`` in C must give
what ``scan_py`` gives, and ``loads`` may raise only ``ValueError``; on a value (read
or built), C ``encode`` must give what ``_encode_fast_py`` gives, ``dumps`` what the
pure-Python encoder gives (the same text or the same error), and ``loads`` must
read that text back to the same text. A disagreement raises,
and libFuzzer saves the input (under the temporary directory unless
``-artifact_prefix=`` says where).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import atheris  # type: ignore[import-untyped]
from _main import fuzz  # fuzz/, the script's own directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with atheris.instrument_imports():
    import orjson

    from app import speedups
    from app.protocol import canonical_json
    from app.protocol.canonical_json import _dumps_slow, _encode_fast_py, dumps, loads, scan_py

try:
    _jsscan = importlib.import_module("app.protocol._jsscan")
except ImportError:
    raise SystemExit("app/protocol/_jsscan.c is not built") from None
if not speedups.ENABLED:  # canonical_json set it up only if it uses it
    _jsscan.setup(orjson.dumps, canonical_json._ORJSON_OPTIONS, canonical_json._may_hold_non_finite)


def outcome(f: Any, value: Any) -> Any:
    try:
        return f(value)
    except Exception as e:
        return type(e)


def built(fdp: atheris.FuzzedDataProvider, depth: int = 0) -> Any:
    # One deep run at most (at the top): loads reads about a thousand levels only.
    kind = fdp.ConsumeIntInRange(0, 8 if depth == 0 else 7 if depth < 6 else 4)
    if kind == 0:
        return None if fdp.ConsumeBool() else fdp.ConsumeBool()
    if kind == 1:
        return fdp.ConsumeInt(9)  # up to 72 bits: past orjson's 64
    if kind == 2:
        return fdp.ConsumeFloat()  # NaN and the infinities too
    if kind in (3, 4):
        return fdp.ConsumeUnicode(6)  # lone surrogates too
    items = [built(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    if kind == 5:
        return items
    if kind == 6:
        return tuple(items)
    if kind == 7:
        return {fdp.ConsumeUnicode(3): item for item in items}
    value = items
    for _ in range(fdp.ConsumeIntInRange(250, 260)):  # around orjson's depth limit
        value = [value]
    return value


def test_one_input(data: bytes) -> None:
    if data[:1] and data[0] & 1:
        check_value(built(atheris.FuzzedDataProvider(data[1:])))
        return
    if _jsscan.scan(data) != scan_py(data):
        raise AssertionError(f"scan({data!r}): C {_jsscan.scan(data)}, Python {scan_py(data)}")
    try:
        value = loads(data)
    except ValueError:
        return
    check_value(value)


def check_value(value: Any) -> None:
    for v in (value, [value], {"k": value}):
        c, py = outcome(_jsscan.encode, v), outcome(_encode_fast_py, v)
        if c != py:
            raise AssertionError(f"encode({v!r}): C {c!r}, Python {py!r}")
    text, slow = outcome(dumps, value), outcome(_dumps_slow, value)
    if text != slow:
        raise AssertionError(f"dumps({value!r}) = {text!r}, the Python encoder {slow!r}")
    if isinstance(text, str) and dumps(loads(text)) != text:
        raise AssertionError(f"{text!r} does not read back to itself")


if __name__ == "__main__":
    fuzz("jsscan", test_one_input)
