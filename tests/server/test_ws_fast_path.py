"""The websocket fast path (app/server/ws_protocol.py): frames exactly as RFC 6455 says.

Client frames are built, and server frames read back, with the websockets library's
own codec, so the fast path is checked against an independent implementation.
"""

from __future__ import annotations

import random
from collections.abc import Generator

import pytest
from websockets.frames import Frame, Opcode
from websockets.streams import StreamReader

from app.protocol.envelope import quick_ack
from app.server.ws_protocol import _ack_ids, _frame_header, _text_frames, _text_frames_bytes

MAX = 1 << 20


def client_frame(text: str | bytes, *, fin: bool = True, opcode: Opcode = Opcode.TEXT) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return Frame(opcode, data, fin=fin).serialize(mask=True, extensions=[])


def read_server_frames(raw: bytes) -> list[Frame]:
    """Every frame of ``raw``; fails if anything is left over or incomplete."""
    reader = StreamReader()
    reader.feed_data(raw)
    reader.feed_eof()
    frames = []
    while reader.buffer:
        parser: Generator[None, None, Frame] = Frame.parse(
            reader.read_exact, mask=False, max_size=None, extensions=[]
        )
        try:
            next(parser)
        except StopIteration as done:
            frames.append(done.value)
            continue
        raise AssertionError("a frame was incomplete")
    return frames


def read_server_frame(raw: bytes) -> Frame:
    (frame,) = read_server_frames(raw)
    return frame


@pytest.mark.parametrize("size", [0, 1, 125, 126, 127, 65535, 65536, 200_000])
def test_server_frames_parse_as_one_fin_text_frame(size: int) -> None:
    payload = ("é" * size).encode()[:size]
    frame = read_server_frame(_frame_header(len(payload)) + payload)
    assert frame.opcode is Opcode.TEXT
    assert frame.fin
    assert frame.data == payload


def test_several_server_frames_written_together_parse_back_in_order() -> None:
    texts = ['{"id":1,"msg":["begin"]}', "", "é" * 200, "x" * 70_000, '{"id":5}']
    frames = read_server_frames(_text_frames_bytes(texts))
    assert [f.data.decode() for f in frames] == texts
    assert all(f.opcode is Opcode.TEXT and f.fin for f in frames)


@pytest.mark.parametrize("size", [0, 1, 125, 126, 65535, 65536 - 1])
def test_masked_client_text_frames_are_unmasked(size: int) -> None:
    text = ("a" * size)[:size]
    assert _text_frames(client_frame(text), MAX) == [text]


def test_several_acks_in_one_chunk_are_all_delivered_in_order() -> None:
    acks = [f'{{"ack":{i}}}' for i in range(1, 50)]
    chunk = b"".join(client_frame(a) for a in acks)
    assert _text_frames(chunk, MAX) == acks


def test_non_ascii_text_survives() -> None:
    assert _text_frames(client_frame("naïve ✓ 😀"), MAX) == ["naïve ✓ 😀"]


@pytest.mark.parametrize(
    "chunk",
    [
        pytest.param(client_frame('{"ack":1}')[:-1], id="partial frame"),
        pytest.param(client_frame('{"ack":1}') + client_frame('{"ack":2}')[:3], id="trailing part"),
        pytest.param(client_frame(b"ping", opcode=Opcode.PING), id="ping"),
        pytest.param(client_frame(b"\x03\xe8", opcode=Opcode.CLOSE), id="close"),
        pytest.param(client_frame("part", fin=False), id="fragment"),
        pytest.param(client_frame(b"bin", opcode=Opcode.BINARY), id="binary"),
        pytest.param(client_frame(b"\xff\xfe"), id="invalid utf-8"),
        pytest.param(Frame(Opcode.TEXT, b"x").serialize(mask=False, extensions=[]), id="unmasked"),
        pytest.param(client_frame("x" * 70_000), id="64-bit length"),
    ],
)
def test_anything_but_whole_masked_text_frames_goes_to_the_library(chunk: bytes) -> None:
    assert _text_frames(chunk, MAX) is None


def test_a_frame_over_the_size_limit_goes_to_the_library() -> None:
    assert _text_frames(client_frame("x" * 100), 99) is None
    assert _text_frames(client_frame("x" * 99), 99) == ["x" * 99]


def test_chunks_of_canonical_acks_parse_straight_to_ids() -> None:
    ids = [0, 1, 9, 10, 12345, 10**16 - 1]
    chunk = b"".join(client_frame(f'{{"ack":{i}}}') for i in ids)
    assert _ack_ids(chunk) == ids


@pytest.mark.parametrize(
    "frames",
    [
        [client_frame('{"ack":01}')],  # leading zero: not the canonical form
        [client_frame('{"ack": 1}')],
        [client_frame('{"ack":1,"x":2}')],
        [client_frame('{"ack":-1}')],
        [client_frame('{"ack":1.0}')],
        [client_frame('{"ack":}')],
        [client_frame('{"ack":1}'), client_frame('{"nack":1}')],
        [client_frame('{"ack":1}'), client_frame('{"ack":2}')[:-1]],  # partial
        [client_frame('{"ack":1}', fin=False)],
        [client_frame(b'{"ack":1}', opcode=Opcode.BINARY)],
        [Frame(Opcode.TEXT, b'{"ack":1}').serialize(mask=False, extensions=[])],
        [client_frame('{"ack":' + "1" * 17 + "}")],  # longer than any id we send
    ],
)
def test_anything_but_canonical_acks_is_left_to_the_general_path(frames: list[bytes]) -> None:
    assert _ack_ids(b"".join(frames)) is None


def test_ack_ids_agree_with_the_general_path_on_mixed_chunks() -> None:
    rng = random.Random(7)
    texts = ['{"ack":5}', '{"ack":05}', '{"ack": 5}', '{"ack":123}', "hello", '{"ack":0}']
    for _ in range(300):
        chunk_texts = [rng.choice(texts) for _ in range(rng.randint(1, 6))]
        chunk = b"".join(client_frame(t) for t in chunk_texts)
        expected = [quick_ack(t) for t in chunk_texts]
        general = _text_frames(chunk, MAX)
        assert general == chunk_texts
        if None in expected:
            assert _ack_ids(chunk) is None
        else:
            assert _ack_ids(chunk) == expected
