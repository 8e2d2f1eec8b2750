"""The websocket fast path (app/server/ws_protocol.py, app/protocol/wsframes.py): frames
exactly as RFC 6455 says.

Client frames are built, and server frames read back, with the websockets library's
own codec, so the fast path is checked against an independent implementation.
"""

from __future__ import annotations

import random
import re
import tomllib
from collections.abc import Callable, Generator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.types import Message
from starlette.websockets import WebSocket
from websockets.frames import Frame, Opcode
from websockets.streams import StreamReader
from websockets.utils import apply_mask

from app import speedups
from app.protocol import wsframes
from app.protocol.envelope import quick_ack
from app.protocol.wsframes import _ack_ids_py, _msg_frames_py
from app.protocol.wsframes import client_texts as _text_frames
from app.protocol.wsframes import encode_text_frames as _text_frames_bytes
from app.protocol.wsframes import frame_header as _frame_header
from app.server import ws_protocol
from app.server.transport import stream_downstream
from app.streamer.downstream import Downstream
from tests.c_helpers import built, needs

_wsfast = built("app.protocol._wsfast")
needs_c = needs(_wsfast, "app/protocol/_wsfast.c")

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


def frame_text(frame: Frame) -> str:
    """A parsed frame's payload as text (``Frame.parse`` gives bytes or a bytearray)."""
    assert isinstance(frame.data, (bytes, bytearray))
    return frame.data.decode()


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
    assert [frame_text(f) for f in frames] == texts
    assert all(f.opcode is Opcode.TEXT and f.fin for f in frames)


MSG_FRAMES = pytest.mark.parametrize(
    "msg_frames",
    [
        pytest.param(_wsfast and _wsfast.msg_frames, id="c", marks=needs_c),
        pytest.param(_msg_frames_py, id="py"),
    ],
)


def test_the_c_frame_builder_is_used_when_built_unless_speedups_are_off() -> None:
    if speedups.ENABLED and _wsfast is not None:
        assert wsframes.msg_frames is _wsfast.msg_frames
    else:
        assert wsframes.msg_frames is _msg_frames_py


@MSG_FRAMES
def test_v6_frames_built_together_parse_back_with_their_ids(
    msg_frames: Callable[[int, list[str]], bytes],
) -> None:
    # Payload sizes around both header-size boundaries (125/126, 65535/65536 bytes
    # with the 16-byte {"id":9,"msg":…} envelope), non-ASCII text, ids gaining digits.
    messages = ['["begin"]', "", "é" * 200, "x" * 109, "x" * 110, "y" * 65_519, "y" * 65_520]
    frames = read_server_frames(msg_frames(9, messages))
    assert [frame_text(f) for f in frames] == [
        f'{{"id":{9 + i},"msg":{m}}}' for i, m in enumerate(messages)
    ]
    assert all(f.opcode is Opcode.TEXT and f.fin for f in frames)
    assert msg_frames(1, []) == b""


@pytest.mark.parametrize("per_frame", [1, 2, 64])
def test_envelopes_of_either_protocol_parse_back_as_the_wire_format(per_frame: int) -> None:
    """``encode_envelopes`` is ``envelope_texts`` with headers: v6 a message a frame
    (the C builder when built), v7 batches, a lone message as ``msg``."""
    messages = [
        '["begin",{"tag":"begin"},{"commitWatermark":"02"}]',
        '["data",{}]',
        '"' + "é" * 300 + '"',
    ]
    frames = read_server_frames(wsframes.encode_envelopes(5, messages, per_frame))
    texts = [frame_text(f) for f in frames]
    assert texts == wsframes.envelope_texts(5, messages, per_frame)
    assert len(texts) == wsframes.frame_count(len(messages), per_frame)
    if per_frame == 2:
        assert texts == [
            '{"id":5,"batch":[' + messages[0] + "," + messages[1] + "]}",
            '{"id":6,"msg":' + messages[2] + "}",
        ]


def test_unmasking_is_the_libraries() -> None:
    rng = random.Random(7)
    for n in (0, 1, 3, 4, 5, 125, 4097):
        payload = bytes(rng.randrange(256) for _ in range(n))
        mask = bytes(rng.randrange(256) for _ in range(4))
        assert wsframes.unmask(payload, mask) == apply_mask(payload, mask)


@needs_c
@settings(max_examples=500, deadline=None)
@given(
    st.integers(min_value=1, max_value=2**62),
    st.lists(
        st.text(max_size=300).filter(lambda t: not any("\ud800" <= c <= "\udfff" for c in t)),
        max_size=8,
    ),
)
def test_the_c_and_python_frame_builders_agree(first_id: int, messages: list[str]) -> None:
    assert _wsfast is not None  # needs_c
    assert _wsfast.msg_frames(first_id, messages) == _msg_frames_py(first_id, messages)


@needs_c
def test_the_c_frame_builder_takes_only_strings() -> None:
    assert _wsfast is not None  # needs_c
    with pytest.raises(TypeError, match="messages must be str, not bytes"):
        _wsfast.msg_frames(1, ["ok", b"no"])
    with pytest.raises(UnicodeEncodeError):
        _wsfast.msg_frames(1, ["\ud800"])  # as str.encode() would


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


AckParser = Callable[[bytes], "list[int] | None"]
# The C parser (app/protocol/_wsfast.c) runs; the Python one is its fallback and reference.
PARSERS = pytest.mark.parametrize(
    "parse_acks",
    [
        pytest.param(_wsfast and _wsfast.ack_ids, id="c", marks=needs_c),
        pytest.param(_ack_ids_py, id="py"),
    ],
)


def test_the_c_ack_parser_is_used_when_built_unless_speedups_are_off() -> None:
    if speedups.ENABLED and _wsfast is not None:
        assert wsframes.ack_ids is _wsfast.ack_ids
    else:
        assert wsframes.ack_ids is _ack_ids_py


@PARSERS
def test_chunks_of_canonical_acks_parse_straight_to_ids(parse_acks: AckParser) -> None:
    ids = [0, 1, 9, 10, 12345, 10**16 - 1]
    chunk = b"".join(client_frame(f'{{"ack":{i}}}') for i in ids)
    assert parse_acks(chunk) == ids


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
@PARSERS
def test_anything_but_canonical_acks_is_left_to_the_general_path(
    frames: list[bytes], parse_acks: AckParser
) -> None:
    assert parse_acks(b"".join(frames)) is None


@PARSERS
def test_ack_ids_agree_with_the_general_path_on_mixed_chunks(parse_acks: AckParser) -> None:
    rng = random.Random(7)
    texts = ['{"ack":5}', '{"ack":05}', '{"ack": 5}', '{"ack":123}', "hello", '{"ack":0}']
    for _ in range(300):
        chunk_texts = [rng.choice(texts) for _ in range(rng.randint(1, 6))]
        chunk = b"".join(client_frame(t) for t in chunk_texts)
        expected = [quick_ack(t) for t in chunk_texts]
        general = _text_frames(chunk, MAX)
        assert general == chunk_texts
        if None in expected:
            assert parse_acks(chunk) is None
        else:
            assert parse_acks(chunk) == expected


@needs_c
@settings(max_examples=2000, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.integers(min_value=0, max_value=10**17).map(lambda i: f'{{"ack":{i}}}'),
            st.text(alphabet='{}"ack:0123456789 -.', max_size=26),
        ),
        min_size=1,
        max_size=5,
    ),
    st.integers(min_value=0, max_value=3),
    st.data(),
)
def test_the_c_and_python_ack_parsers_agree(
    texts: list[str], cut: int, data: st.DataObject
) -> None:
    assert _wsfast is not None  # needs_c
    chunk = b"".join(client_frame(t) for t in texts)
    if cut:  # sometimes a partial frame at the end, sometimes a corrupted byte
        where = data.draw(st.integers(min_value=0, max_value=len(chunk) - 1))
        chunk = (
            chunk[:where]
            if cut == 1
            else chunk[:where] + bytes([chunk[where] ^ 0x40]) + chunk[where + 1 :]
        )
    assert _wsfast.ack_ids(chunk) == _ack_ids_py(chunk)


@needs_c
def test_the_c_ack_parser_takes_only_bytes() -> None:
    assert _wsfast is not None  # needs_c
    with pytest.raises(TypeError):
        _wsfast.ack_ids('{"ack":1}')


@pytest.mark.parametrize("version", ["0.30.6", "0.45.0", "0.52.0"])
def test_an_uvicorn_without_the_attributes_used_fails_at_import_saying_so(version: str) -> None:
    with pytest.raises(
        ImportError, match=rf"uvicorn {re.escape(version)} is too old .*>= 0\.52\.1"
    ):
        ws_protocol.check_uvicorn(version)


def test_the_range_pyproject_pins_starts_where_the_attributes_exist() -> None:
    for version in ("0.52.1", "0.54.0", "0.60", "1.0.0rc1"):
        ws_protocol.check_uvicorn(version)
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("uvicorn")]
    minimum = ".".join(map(str, ws_protocol.UVICORN_MINIMUM))
    assert pin == f"uvicorn[standard]>={minimum},<0.55"


@pytest.mark.parametrize("version", ["16.0", "18.0", "18.0rc1", "9.1", "unknown"])
def test_a_websockets_other_than_the_one_whose_internals_are_read_fails_at_import(
    version: str,
) -> None:
    with pytest.raises(
        ImportError, match=rf"websockets {re.escape(version)} is not supported .* 17\.x"
    ):
        ws_protocol.check_websockets(version)


def test_the_websockets_pyproject_pins_is_the_major_version_whose_internals_are_read() -> None:
    for version in ("17.0", "17.4", "17.10.1"):
        ws_protocol.check_websockets(version)
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("websockets")]
    major = ws_protocol.WEBSOCKETS_MAJOR
    assert pin == f"websockets>={major},<{major + 1}"


@pytest.mark.parametrize("sizes", [[1], [3, 200], [125, 126, 65535, 65536], [0, 70000, 5]])
def test_a_message_in_fragments_parses_back_as_one_text_message(sizes: list[int]) -> None:
    parts = ["é" * (n // 2) + "x" * (n % 2) for n in sizes]
    frames = read_server_frames(b"".join(wsframes.fragment_frames(parts)))
    assert [f.opcode for f in frames] == [Opcode.TEXT] + [Opcode.CONT] * (len(parts) - 1)
    assert [f.fin for f in frames] == [False] * (len(parts) - 1) + [True]
    assert b"".join(f.data for f in frames).decode() == "".join(parts)


async def _no_receive() -> Message:
    raise AssertionError("nothing is received")


async def _no_send(message: Message) -> None:
    raise AssertionError(f"nothing is sent: {message}")


async def test_a_stream_under_a_server_without_the_direct_socket_fails_saying_so() -> None:
    # Starlette's TestClient, or uvicorn's own websocket protocols: no DIRECT extension.
    scope = {"type": "websocket", "path": "/", "headers": [], "extensions": {}}
    websocket = WebSocket(scope, _no_receive, _no_send)
    downstream = Downstream()
    with pytest.raises(RuntimeError, match=r"need uvicorn with .*LivenessProtocol"):
        await stream_downstream(websocket, downstream, name="no-direct")
    assert downstream.closed  # the subscriber is not left behind
