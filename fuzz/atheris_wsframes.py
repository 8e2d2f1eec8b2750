"""Atheris: the C ack parser (app/protocol/_wsfast.c) against its Python twin.

    .venv/bin/python fuzz/atheris_wsframes.py -max_total_time=60 [libFuzzer options]

Each input is a socket read: raw bytes, or (first byte odd) frames built from the
input so that most are masked ack frames, some of them broken. ``ack_ids`` in C
must give what ``_ack_ids_py`` gives; ``client_texts`` must not raise, and the ids
must be the acks of its texts. A disagreement raises, and libFuzzer saves the
input (under the temporary directory unless ``-artifact_prefix=`` says where).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import atheris  # type: ignore[import-untyped]
from _main import fuzz  # fuzz/, the script's own directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with atheris.instrument_imports():
    from app.protocol.envelope import quick_ack
    from app.protocol.wsframes import _ack_ids_py, client_texts, unmask

try:
    _wsfast = importlib.import_module("app.protocol._wsfast")
except ImportError:
    raise SystemExit("app/protocol/_wsfast.c is not built") from None


def frames(fdp: atheris.FuzzedDataProvider) -> bytes:
    out = b""
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        first = fdp.PickValueInList([0x81, 0x81, 0x81, 0x01, 0x82, 0x89])
        mask = fdp.ConsumeBytes(4).ljust(4, b"\x00")
        if fdp.ConsumeBool():
            payload = ('{"ack":' + str(fdp.ConsumeIntInRange(0, 10**17)) + "}").encode()
        else:
            payload = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 30))
        length = len(payload) if fdp.ConsumeProbability() < 0.9 else fdp.ConsumeIntInRange(0, 255)
        out += bytes((first, (0x80 | length) & 0xFF)) + mask + unmask(payload, mask)
    return out + bytes(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 2)))


def test_one_input(data: bytes) -> None:
    if data[:1] and data[0] & 1:
        data = frames(atheris.FuzzedDataProvider(data[1:]))
    expected = _ack_ids_py(data)
    got = _wsfast.ack_ids(data)
    if got != expected:
        raise AssertionError(f"ack_ids({data!r}): C {got!r}, Python {expected!r}")
    texts = client_texts(data, 1 << 20)
    if expected is not None and (texts is None or [quick_ack(t) for t in texts] != expected):
        raise AssertionError(f"ack_ids({data!r}) = {expected!r} but client_texts = {texts!r}")


if __name__ == "__main__":
    fuzz("wsframes", test_one_input)
