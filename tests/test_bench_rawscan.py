"""The benchmark subscriber's frame loop in C (bench/_rawscan.c) against its Python twin.

bench.fanout's numbers depend on this client acking every frame it receives,
exactly as the Python scanner does; these tests hold the two to the same acks.
"""

from __future__ import annotations

import random

import pytest

from app import speedups
from bench import _build, pg_subscribers
from bench.pg_subscribers import RawSocket, ack_frame

if _build.build() is None:  # compiled on demand; says why on stderr
    pytest.skip("bench/_rawscan.c cannot be compiled here", allow_module_level=True)
_rawscan = pytest.importorskip("bench._rawscan")


def server_frame(opcode: int, payload: bytes, *, fin: bool = True) -> bytes:
    """An unmasked server frame, with the shortest length encoding."""
    head = bytes([(0x80 if fin else 0) | opcode])
    n = len(payload)
    if n < 126:
        head += bytes([n])
    elif n < 1 << 16:
        head += bytes([126]) + n.to_bytes(2, "big")
    else:
        head += bytes([127]) + n.to_bytes(8, "big")
    return head + payload


def message(msg_id: int, size: int) -> bytes:
    return b'{"id":%d,"msg":["data",{"x":"%s"}]}' % (msg_id, b"y" * size)


class _Sink:
    """Stands in for the socket's writer: collects what the client writes (pongs)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)


def client(buf: bytes) -> tuple[RawSocket, _Sink]:
    sink = _Sink()
    ws = RawSocket(None, sink)  # type: ignore[arg-type]  # scanning never reads the socket
    ws._buf = buf
    return ws, sink


def python_acks(buf: bytes) -> tuple[bytes, int, bytes, int, list[bytes]]:
    ws, sink = client(buf)
    ids: list[bytes] = []
    last = ws._scan(ids, ids_only=True)
    return b"".join(ack_frame(i) for i in ids), len(ids), last, ws._pos, sink.written


def test_the_c_loop_is_used_unless_speedups_are_off() -> None:
    if speedups.ENABLED:
        assert pg_subscribers.scan_acks is _rawscan.scan_acks
    else:
        assert pg_subscribers.scan_acks is None


def test_acks_every_message_as_the_python_loop_does() -> None:
    buf = b"".join(server_frame(1, message(i, i * 37 % 300)) for i in range(1, 200))
    buf += server_frame(1, message(200, 70_000))  # a 64-bit length
    pos, acks, count, start, end, stuck = _rawscan.scan_acks(buf, 0)
    assert (pos, count, stuck) == (len(buf), 200, False)
    assert acks == b"".join(ack_frame(b"%d" % i) for i in range(1, 201))
    assert buf[start:end] == message(200, 70_000)


def test_stops_at_an_incomplete_frame_and_at_a_frame_it_does_not_take() -> None:
    whole = server_frame(1, message(1, 10))
    half = server_frame(1, message(2, 10))[:7]
    pos, _, count, _, _, stuck = _rawscan.scan_acks(whole + half, 0)
    assert (pos, count, stuck) == (len(whole), 1, False)
    ping = server_frame(0x9, b"hi")
    pos, _, count, _, _, stuck = _rawscan.scan_acks(whole + ping + whole, 0)
    assert (pos, count, stuck) == (len(whole), 1, True)
    # The client takes the rest the Python way: the pong is written, the message after
    # it acked.
    ws, sink = client(whole + ping + server_frame(1, message(3, 5)))
    acks, count, last = ws.take_acks()
    assert count == 2
    assert acks == ack_frame(b"1") + ack_frame(b"3")
    assert last == message(3, 5)
    assert sink.written == [bytes([0x8A, 0x82, 0, 0, 0, 0]) + b"hi"]


@pytest.mark.parametrize("seed", range(20))
def test_c_and_python_agree_on_random_streams(seed: int) -> None:
    rng = random.Random(seed)
    frames = []
    for i in range(1, rng.randint(1, 60)):
        kind = rng.random()
        if kind < 0.85:
            frames.append(server_frame(1, message(i, rng.choice([0, 5, 120, 130, 70_000]))))
        elif kind < 0.9:
            frames.append(server_frame(0x9, b"p%d" % i))
        elif kind < 0.95:
            frames.append(server_frame(1, b'{"id":x%d,"msg":[]}' % i))  # not an id
        else:
            frames.append(server_frame(1, message(i, 3), fin=False) + server_frame(0, b"]"))
    buf = b"".join(frames)
    cut = rng.randint(0, len(buf))  # a read boundary anywhere
    buf = buf[:cut]
    ws, _ = client(buf)
    got = ws.take_acks()
    py_acks, py_count, py_last, py_pos, _ = python_acks(buf)
    assert got == (py_acks, py_count, py_last if py_count else b"")
    assert ws._pos == py_pos


def test_bad_arguments_are_errors() -> None:
    with pytest.raises(ValueError, match="pos out of range"):
        _rawscan.scan_acks(b"", 1)
    with pytest.raises(TypeError):
        _rawscan.scan_acks("text", 0)
