"""Atheris: the C COPY row splitter (app/sources/postgres/_copyload.c) against
``copy_text.parse_copy_line``.

    .venv/bin/python fuzz/atheris_copyload.py -max_total_time=60 [libFuzzer options]

Each input is a COPY text line (raw bytes, or with its first byte odd, fields built
from escapes, UTF-8 and stray bytes) and a column count. Both must give the same
fields, or raise ``CopyFormatError`` with the same words. A disagreement raises, and
libFuzzer saves the input (under the temporary directory unless ``-artifact_prefix=``).
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
from pathlib import Path

import atheris  # type: ignore[import-untyped]
from _main import fuzz  # fuzz/, the script's own directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with atheris.instrument_imports():
    from app.sources.postgres import copy_load
    from app.sources.postgres.copy_text import CopyFormatError, parse_copy_line

try:
    from app.sources.postgres import _copyload
except ImportError:
    raise SystemExit("_copyload is not built") from None
if not copy_load.setup_helper(_copyload):
    raise SystemExit("_copyload cannot find libpq's and SQLite's functions here")

PIECES = [b"\\", b"\\N", b"\\\\", b"\\t", b"\\n", b"\\x4", b"\\x41", b"\\xg", b"\\101", b"\\7"]
PIECES += [b"\\303\\251", b"\\377", b"\\b\\f\\v\\r", b"\\\xc3\xa9", b"\t", b"\xc3\xa9", b"\xff"]
PIECES += [b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe0\x80", b"a", b"\n"]

_WORK = Path(tempfile.mkdtemp(prefix="fuzz-copyload-"))
LOADERS = []
for n in range(1, 5):
    path = _WORK / f"replica{n}.db"
    columns = [f"c{i}" for i in range(n)]
    with sqlite3.connect(path) as lite:
        lite.execute(f"CREATE TABLE t ({', '.join(columns)})")
    insert = f"INSERT INTO t VALUES ({', '.join('?' for _ in columns)})"
    LOADERS.append(_copyload.Loader(str(path), insert, (None,) * n, 1000))


def line_from(fdp: atheris.FuzzedDataProvider) -> bytes:
    out = b""
    for _ in range(fdp.ConsumeIntInRange(0, 12)):
        if fdp.ConsumeBool():
            out += fdp.PickValueInList(PIECES)
        else:
            out += fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 3))
    return out


def outcome(parse: object, line: bytes) -> object:
    try:
        return parse(line)  # type: ignore[operator]
    except CopyFormatError as e:
        return f"CopyFormatError: {e}"


def test_one_input(data: bytes) -> None:
    if not data:
        return
    n = data[0] % 4 + 1
    line = line_from(atheris.FuzzedDataProvider(data[1:])) if data[0] & 4 else data[1:]
    expected = outcome(lambda b: parse_copy_line(b, n), line)
    got = outcome(LOADERS[n - 1].parse_line, line)
    if got != expected:
        raise AssertionError(f"parse_line({line!r}, {n}): C {got!r}, Python {expected!r}")


if __name__ == "__main__":
    fuzz("copyload", test_one_input)
