"""Atheris: the C row decoder (app/sources/postgres/_pgrows.c) against the Python path.

    .venv/bin/python fuzz/atheris_pgrows.py -max_total_time=60 [libFuzzer options]

Each input is a pgoutput payload: raw bytes, or (first byte odd) an Insert, Update
or Delete of a relation with a column of each kind the decoder converts or calls a
parser for, built from the input. ``decode_message`` may raise only
``PgOutputError`` and ``ChangeMapper.map`` only ``MappingError``; ``map_common`` gives
None or exactly the Python path's one Data. A disagreement raises, and libFuzzer
saves the input (under the temporary directory unless ``-artifact_prefix=``).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

import atheris  # type: ignore[import-untyped]
from _main import fuzz  # fuzz/, the script's own directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with atheris.instrument_imports():
    from app.sources.postgres import mapper as mapper_module
    from app.sources.postgres.mapper import ChangeMapper, MappingError, ShardId
    from app.sources.postgres.pgoutput import PgOutputError, decode_message
    from app.sources.postgres.values import TypeRegistry

if mapper_module._pgrows is None:  # map_common would always defer: nothing to compare
    raise SystemExit("_pgrows is not built, or CHANGESTREAMER_SPEEDUPS=0")

REL_OID = 0x80000010
# int8, int4, bool, text, float8, jsonb, numeric, timestamptz, date, time, text[], int8[]
COLUMNS = [
    ("id", 20, True),
    ("n", 23, True),
    ("flag", 16, False),
    ("title", 25, False),
    ("x", 701, False),
    ("j", 3802, False),
    ("amount", 1700, False),
    ("at", 1184, False),
    ("day", 1082, False),
    ("t", 1083, False),
    ("tags", 1009, False),
    ("ids", 1016, False),
]
SAMPLES = [b"1", b"-7", b"t", b"f", b"1.5", b"NaN", b'{"a":1}', b"2024-01-02 03:04:05+00"]
SAMPLES += [b"2024-01-02", b"03:04:05", b"{a,NULL}", b"{1,2}", b"99999999999999999999", b""]


def relation() -> bytes:
    out = b"R" + struct.pack(">I", REL_OID) + b"public\x00items\x00d" + struct.pack(">h", 12)
    for name, oid, key in COLUMNS:
        out += bytes([key]) + name.encode() + b"\x00" + struct.pack(">Ii", oid, -1)
    return out


def tuple_data(fdp: atheris.FuzzedDataProvider) -> bytes:
    n = fdp.ConsumeIntInRange(0, len(COLUMNS) + 1)
    out = struct.pack(">h", n if fdp.ConsumeProbability() < 0.95 else -n)
    for _ in range(n):
        kind = fdp.PickValueInList([b"t", b"t", b"t", b"n", b"u", b"b", b"x"])
        out += kind
        if kind in (b"t", b"b"):
            value = (
                fdp.PickValueInList(SAMPLES)
                if fdp.ConsumeBool()
                else fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 12))
            )
            length = len(value) if fdp.ConsumeProbability() < 0.95 else fdp.ConsumeInt(4)
            out += struct.pack(">i", length) + value
    return out


def row_change(fdp: atheris.FuzzedDataProvider) -> bytes:
    kind: bytes = fdp.PickValueInList([b"I", b"U", b"D"])
    marker: bytes = fdp.PickValueInList([b"N", b"K", b"O"])
    out = kind + struct.pack(">I", REL_OID if fdp.ConsumeProbability() < 0.95 else 7) + marker
    out += tuple_data(fdp)
    if kind == b"U" and marker != b"N":
        out += b"N" + tuple_data(fdp)
    return out + bytes(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 1)))


def python_path(mapper: ChangeMapper, payload: bytes) -> list[Any] | None:
    try:
        message = decode_message(payload)
    except PgOutputError:
        return None
    try:
        return mapper.map(message)
    except MappingError:
        return None


MAPPER = ChangeMapper(ShardId("app", 0), TypeRegistry())
MAPPER.map(decode_message(relation()))


def test_one_input(data: bytes) -> None:
    payload = data
    if data[:1] and data[0] & 1:
        payload = row_change(atheris.FuzzedDataProvider(data[1:]))
    expected = python_path(MAPPER, payload)
    got = MAPPER.map_common(b"w" + payload, 1)
    if got is not None and [got] != expected:
        raise AssertionError(f"map_common({payload!r}): C {got!r}, Python {expected!r}")


if __name__ == "__main__":
    fuzz("pgrows", test_one_input)
