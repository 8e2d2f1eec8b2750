"""The websocket frames of the replication streams, as pure functions (RFC 6455 §5).

What the server writes, all of it (app/server/transport.py writes no frame built
elsewhere): ``{"id":N,…}`` envelopes (wire.md §1.1, §5.3) in unmasked FIN text
frames (a large message, ``Pieces``, in fragments: :func:`fragment_frames`).
:func:`msg_envelope` and :func:`envelope_texts` are the one place an envelope is
spelled (v6: a ``msg`` frame per message; v7: ``batch`` frames of up to
``per_frame`` messages, a lone message as ``msg``; a large message as ``msg``);
:func:`encode_envelopes` is the same frames with their headers, as one ``bytes`` to
write, and :func:`encode_text_frames` any texts so.

What the server reads: :func:`ack_ids` takes a socket read made only of whole,
masked ``{"ack":N}`` frames (N canonical: digits, no leading zero) to their ids in
one call, every v6 subscriber answering every message with one; :func:`client_texts`
takes a read made only of whole, masked FIN text frames to their texts. Both
return None for anything else (control frames, fragments, partial frames, bad
UTF-8, oversize), which the websocket library then handles with its own errors.

``app/protocol/_wsfast.c`` does ``msg_frames`` (the v6 case of ``encode_envelopes``)
and ``ack_ids`` in C (``app.speedups``); the ``_py`` functions here are the fallback
and what the tests compare them against.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Final, overload

from app import speedups
from app.protocol.pieces import Pieces, Text

__all__ = [
    "ack_ids",
    "client_texts",
    "encode_envelopes",
    "encode_text_frames",
    "envelope_texts",
    "fragment_frames",
    "frame_count",
    "frame_header",
    "msg_envelope",
    "unmask",
]

_FIN: Final = 0x80
_OP_TEXT: Final = 0x1
_OP_CONTINUATION: Final = 0x0
_FIN_TEXT: Final = _FIN | _OP_TEXT
_MASKED: Final = 0x80
_HEADER_16: Final = struct.Struct("!BBH")
_HEADER_64: Final = struct.Struct("!BBQ")


def _header(first: int, n: int) -> bytes:
    """A server (unmasked) frame header: ``first`` (FIN and opcode), the length of
    an ``n``-byte payload."""
    if n < 126:
        return bytes((first, n))
    if n < 1 << 16:
        return _HEADER_16.pack(first, 126, n)
    return _HEADER_64.pack(first, 127, n)


def frame_header(n: int) -> bytes:
    """A server (unmasked) FIN text frame header for an ``n``-byte payload."""
    return _header(_FIN_TEXT, n)


def fragment_frames(parts: Sequence[str]) -> Iterator[bytes]:
    """One text message in fragments (RFC 6455 §5.4), one frame per part, each made
    only when the next is asked for: a text frame without FIN, continuation frames,
    the last one with FIN. For a message too large to write in one call."""
    last = len(parts) - 1
    for i, part in enumerate(parts):
        payload = part.encode()
        opcode = _OP_TEXT if i == 0 else _OP_CONTINUATION
        yield _header((_FIN if i == last else 0) | opcode, len(payload)) + payload


def encode_text_frames(texts: Sequence[str]) -> bytes:
    """Server FIN text frames for ``texts``, back to back."""
    parts: list[bytes] = []
    for text in texts:
        payload = text.encode()
        parts.append(frame_header(len(payload)))
        parts.append(payload)
    return b"".join(parts)


@overload
def msg_envelope(frame_id: int, message: str) -> str: ...
@overload
def msg_envelope(frame_id: int, message: Pieces) -> Pieces: ...


def msg_envelope(frame_id: int, message: Text) -> Text:
    """``{"id":N,"msg":m}``: one message in a frame (a large one, ``Pieces``, too)."""
    return '{"id":' + str(frame_id) + ',"msg":' + message + "}"


def envelope_texts(first_id: int, messages: Sequence[str], per_frame: int = 1) -> list[str]:
    """The envelopes of ``messages`` with ids from ``first_id``: ``{"id":N,"msg":m}``,
    or ``{"id":N,"batch":[…]}`` for up to ``per_frame`` messages together."""
    if per_frame == 1:
        return [msg_envelope(first_id + i, m) for i, m in enumerate(messages)]
    texts = []
    for n, start in enumerate(range(0, len(messages), per_frame)):
        chunk = messages[start : start + per_frame]
        if len(chunk) == 1:
            texts.append(msg_envelope(first_id + n, chunk[0]))
        else:
            texts.append('{"id":' + str(first_id + n) + ',"batch":[' + ",".join(chunk) + "]}")
    return texts


def frame_count(messages: int, per_frame: int) -> int:
    """How many envelopes ``envelope_texts`` makes of ``messages`` messages."""
    return -(-messages // per_frame)


def _msg_frames_py(first_id: int, messages: Sequence[str]) -> bytes:
    """v6 frames with their headers: ``encode_envelopes`` with one message a frame."""
    return encode_text_frames(envelope_texts(first_id, messages))


def encode_envelopes(first_id: int, messages: Sequence[str], per_frame: int = 1) -> bytes:
    """``envelope_texts`` as frames to write, in one ``bytes``."""
    if per_frame == 1:
        return msg_frames(first_id, list(messages))
    return encode_text_frames(envelope_texts(first_id, messages, per_frame))


def unmask(payload: bytes, mask: bytes) -> bytes:
    """RFC 6455 §5.3: ``payload`` XOR the repeated 4-byte ``mask`` (as one big int)."""
    n = len(payload)
    if n == 0:
        return b""
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")


# A masked FIN text frame of {"ack":N} is 6 header bytes and 9-24 payload bytes.
_ACK_PREFIX: Final = b'{"ack":'
_MIN_ACK, _MAX_ACK = 9, 24


def _ack_ids_py(data: bytes) -> list[int] | None:
    """The ids if ``data`` is only whole, masked ``{"ack":N}`` frames; else None."""
    ids: list[int] = []
    pos = 0
    end = len(data)
    while pos < end:
        if data[pos] != _FIN_TEXT or end - pos < 2:
            return None
        length = data[pos + 1] ^ _MASKED  # also rejects an unmasked frame
        if not _MIN_ACK <= length <= _MAX_ACK:
            return None
        start = pos + 6
        pos = start + length
        if pos > end:
            return None
        payload = unmask(data[start:pos], data[start - 4 : start])
        if payload[:7] != _ACK_PREFIX or payload[-1] != 0x7D:  # "}"
            return None
        digits = payload[7:-1]
        if not digits.isdigit() or (digits[0] == 0x30 and len(digits) > 1):  # no leading 0
            return None
        ids.append(int(digits))
    return ids


def client_texts(data: bytes, max_size: int) -> list[str] | None:
    """The texts of ``data`` if it is only whole, masked FIN text frames; else None."""
    texts: list[str] = []
    pos = 0
    end = len(data)
    while pos < end:
        if end - pos < 6 or data[pos] != _FIN_TEXT:
            return None
        second = data[pos + 1]
        if not second & _MASKED:
            return None  # a client must mask; the library closes with 1002
        length = second & 0x7F
        pos += 2
        if length == 126:
            if end - pos < 2:
                return None
            length = (data[pos] << 8) | data[pos + 1]
            pos += 2
        elif length == 127:
            return None  # a 64-bit length: rare and large, leave it to the library
        if length > max_size or end - pos < 4 + length:
            return None
        payload = unmask(data[pos + 4 : pos + 4 + length], data[pos : pos + 4])
        pos += 4 + length
        try:
            texts.append(payload.decode())
        except UnicodeDecodeError:
            return None  # the library closes with 1007
    return texts


ack_ids: Callable[[bytes], list[int] | None]
msg_frames: Callable[[int, list[str]], bytes]
_wsfast = speedups.module("wsfast")
if _wsfast is None:  # not built here, or CHANGESTREAMER_SPEEDUPS=0: same answers, slower
    ack_ids, msg_frames = _ack_ids_py, _msg_frames_py
else:
    ack_ids, msg_frames = _wsfast.ack_ids, _wsfast.msg_frames
