"""uvicorn's websocket protocol, with zero's liveness rule and a fast path for text frames.

Liveness. The server pings every interval; uvicorn drops a peer whose pong does not
come back within the timeout. Zero's rule is more forgiving (spec/wire.md §1.3): a
peer is alive if *either* a pong *or* any other frame (an ack, say) arrived, because
a replicator busy applying a large transaction may answer pings late while its acks
still flow. So any inbound data here counts as the pong that uvicorn waits for.

Fast path. A subscriber gets one text frame per change and answers each with an ack
frame, so per-frame overhead is the server's cost per subscriber. Through uvicorn's
sans-I/O layer a send costs ~16 µs (ASGI dispatch, the websockets frame machinery)
and a received ack ~15 µs (a generator-based parser). Here, while the connection is
plainly open (handshake done, no close in progress, no extensions, nothing half-read
in the websockets parser, no fragmented message), an outgoing text message is written
as one unmasked FIN frame directly, and an inbound chunk made only of whole, masked,
FIN text frames is unmasked and queued directly. Anything else — control frames,
fragments, partial frames, oversized or invalid UTF-8 payloads — goes to uvicorn's
path untouched, so every protocol rule and error is still the library's.

This leans on uvicorn's sans-I/O implementation's attributes (``conn``, ``queue``,
``read_paused``, ``pending_ping_payload``, ``pong_timer``, ``schedule_ping``,
``disconnected``...), all there from uvicorn 0.52.1 on: an older uvicorn fails at import
with a message saying so, and tests pin the behaviour, so an uvicorn or websockets
upgrade that renames them fails loudly.
"""

from __future__ import annotations

import importlib.metadata
import re
import struct
from collections.abc import Callable
from typing import Final

from uvicorn._types import ASGISendEvent
from websockets.http11 import Request
from websockets.protocol import State

from app import speedups
from app.protocol.envelope import ack_frame, quick_ack

# The oldest uvicorn whose sans-I/O protocol has every attribute used here (0.52.1
# added ``disconnected`` and the closing handshake; 0.44 the ping timers; 0.35 the
# module itself). pyproject.toml pins the range tested.
UVICORN_MINIMUM: Final = (0, 52, 1)


def check_uvicorn(version: str) -> None:
    """Raises ImportError, saying what is needed, for an uvicorn older than the minimum."""
    parts = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    found = tuple(int(p or 0) for p in parts.groups()) if parts else (0, 0, 0)
    if found < UVICORN_MINIMUM:
        raise ImportError(
            f"uvicorn {version} is too old for app/server/ws_protocol.py: it needs uvicorn >= "
            f"{'.'.join(map(str, UVICORN_MINIMUM))} (the sans-I/O websockets protocol and "
            "the attributes this module reads); install the range pyproject.toml pins"
        )


check_uvicorn(importlib.metadata.version("uvicorn"))

from uvicorn.protocols.websockets.websockets_sansio_impl import (  # noqa: E402
    WebSocketsSansIOProtocol,
)

try:  # the C implementation, as websockets.frames picks it
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - websockets built without its extension
    from websockets.utils import apply_mask

__all__ = ["DIRECT", "DirectSocket", "LivenessProtocol"]

# ASGI scope extension: ``scope["extensions"][DIRECT]["socket"]`` is this connection's
# DirectSocket, for an app that wants to skip the ASGI message layer per frame.
DIRECT: Final = "changestreamer.direct"


class DirectSocket:
    """Per-frame shortcuts past ASGI, for the replication streams' hot path.

    ``try_send`` writes a text frame now if the connection is plainly open (False:
    use the ASGI send). ``on_acks``, when set, gets the ids of the leading
    ``{"ack":N}`` frames of each read and returns how many of them, from the first,
    it matched; those never reach the ASGI receive queue, the rest (and any other
    frame) are queued as usual — so an invalid frame still reaches the app's
    receive loop with its error.
    """

    def __init__(self, protocol: LivenessProtocol) -> None:
        self._protocol = protocol
        self.on_acks: Callable[[list[int]], int] | None = None

    def try_send(self, text: str) -> bool:
        return self._protocol.send_now(text)

    def try_send_many(self, texts: list[str]) -> bool:
        """Like ``try_send`` for several frames, written with one call."""
        return self._protocol.send_many_now(texts)

    def try_send_msgs(self, first_id: int, messages: list[str]) -> bool:
        """v6 frames ``{"id":first_id+i,"msg":messages[i]}``, written with one call."""
        return self._protocol.send_msgs_now(first_id, messages)


_FIN_TEXT: Final = 0x81
_MASKED: Final = 0x80
_HEADER_16: Final = struct.Struct("!BBH")
_HEADER_64: Final = struct.Struct("!BBQ")


class LivenessProtocol(WebSocketsSansIOProtocol):
    direct: DirectSocket | None = None  # set at the handshake

    def data_received(self, data: bytes) -> None:
        match = self._ack_matcher()
        if not self._plainly_open():
            super().data_received(data)
        elif match is not None and (acks := _ack_ids(data)) is not None:
            # Only acks: the transport matches what it can, the rest is queued.
            handled = match(acks)
            self._queue_texts([ack_frame(ack) for ack in acks[handled:]])
        elif (texts := _text_frames(data, self._max_message_size())) is None:
            super().data_received(data)
        else:
            self._deliver_texts(texts, match)
        if self.pending_ping_payload is not None and self.pong_timer is not None:
            # As good as a pong: the peer is reading and writing.
            self.pending_ping_payload = None
            self.pong_timer.cancel()
            self.pong_timer = None
            self.schedule_ping()

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None and not self.handshake_complete:
            self.direct = DirectSocket(self)
            extensions = scope.get("extensions")
            if extensions is None:
                extensions = scope["extensions"] = {}
            extensions[DIRECT] = {"socket": self.direct}

    async def send(self, message: ASGISendEvent) -> None:
        if message["type"] == "websocket.send":
            text = message.get("text")
            if text is not None and self.send_now(text):
                return
        await super().send(message)

    def send_now(self, text: str) -> bool:
        """Writes one text frame if the connection is plainly open; False otherwise."""
        if not self._can_write_frames():
            return False
        payload = text.encode()
        self.transport.write(_frame_header(len(payload)) + payload)
        return True

    def send_many_now(self, texts: list[str]) -> bool:
        """Writes text frames in one transport write if plainly open; False otherwise.

        One write per batch instead of per frame: at K subscribers every change
        costs K writes, and the write (a syscall on an idle socket) was the
        largest single cost of a forwarded frame.
        """
        if not self._can_write_frames():
            return False
        self.transport.write(_text_frames_bytes(texts))
        return True

    def send_msgs_now(self, first_id: int, messages: list[str]) -> bool:
        """``send_many_now`` for v6 frames, built in one call (see ``_msg_frames``)."""
        if not self._can_write_frames():
            return False
        self.transport.write(_msg_frames(first_id, messages))
        return True

    def _can_write_frames(self) -> bool:
        # Sending needs less than reading: the parser's state does not matter.
        return (
            self._open_for_frames()
            and self.writable.is_set()
            and not self.disconnected
            and self.initial_response is None
        )

    def _open_for_frames(self) -> bool:
        """Handshake done, no close begun, no extensions, no outgoing fragment."""
        conn = self.conn
        return (
            self.handshake_complete
            and not self.close_sent
            and conn.state is State.OPEN
            and not conn.extensions
            and not conn.expect_continuation_frame
        )

    def _plainly_open(self) -> bool:
        """Open for frames, and nothing half-read in the library's parser."""
        conn = self.conn
        return self._open_for_frames() and not conn.reader.buffer and conn.current_size is None

    def _max_message_size(self) -> int:
        size = self.conn.max_message_size
        return size if size is not None else 1 << 62

    def _ack_matcher(self) -> Callable[[list[int]], int] | None:
        """The transport's ack matcher, if acks may go to it now: not closing, and
        nothing waiting in the receive queue (frames are seen in arrival order)."""
        direct = self.direct
        if direct is None or self.close_sent or not self.queue.empty():
            return None
        return direct.on_acks

    def _deliver_texts(self, texts: list[str], match: Callable[[list[int]], int] | None) -> None:
        """What uvicorn does with complete text messages (send_receive_event_to_app),
        after ``match`` took the leading acks."""
        if self.close_sent:
            return
        handled = 0
        if match is not None:
            acks = []
            for text in texts:
                ack = quick_ack(text)
                if ack is None:
                    break
                acks.append(ack)
            if acks:
                handled = match(acks)
        self._queue_texts(texts[handled:])

    def _queue_texts(self, texts: list[str]) -> None:
        for text in texts:
            self.queue.put_nowait({"type": "websocket.receive", "text": text})
        if texts and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()


def _frame_header(n: int) -> bytes:
    """A server (unmasked) FIN text frame header for an ``n``-byte payload."""
    if n < 126:
        return bytes((_FIN_TEXT, n))
    if n < 1 << 16:
        return _HEADER_16.pack(_FIN_TEXT, 126, n)
    return _HEADER_64.pack(_FIN_TEXT, 127, n)


def _text_frames_bytes(texts: list[str]) -> bytes:
    """Server FIN text frames for ``texts``, back to back."""
    parts: list[bytes] = []
    for text in texts:
        payload = text.encode()
        parts.append(_frame_header(len(payload)))
        parts.append(payload)
    return b"".join(parts)


def _msg_frames_py(first_id: int, messages: list[str]) -> bytes:
    """v6 frames ``{"id":N,"msg":…}`` with ids from ``first_id``, back to back.

    app/server/_wsfast.c does the same in one call (this costs ~1 µs a frame, and
    every message costs a frame per subscriber); this is its fallback and the
    reference the tests compare it against.
    """
    return _text_frames_bytes(
        ['{"id":' + str(first_id + i) + ',"msg":' + m + "}" for i, m in enumerate(messages)]
    )


# A masked FIN text frame of {"ack":N} is 6 header bytes and 9-24 payload bytes.
_ACK_PREFIX: Final = b'{"ack":'
_MIN_ACK, _MAX_ACK = 9, 24


def _ack_ids_py(data: bytes) -> list[int] | None:
    """The ids if ``data`` is only whole, masked ``{"ack":N}`` frames (N canonical);
    else None, and the general path takes it.

    Every subscriber answers every message with one of these, so this is the
    hottest inbound path: no decode, no text, one unmask per frame. The same
    contract in C (app/server/_wsfast.c; app/speedups.py) is what runs;
    this is its fallback and the reference the tests compare it against.
    """
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
        payload = apply_mask(data[start:pos], data[start - 4 : start])
        if payload[:7] != _ACK_PREFIX or payload[-1] != 0x7D:  # "}"
            return None
        digits = payload[7:-1]
        if not digits.isdigit() or (digits[0] == 0x30 and len(digits) > 1):  # no leading 0
            return None
        ids.append(int(digits))
    return ids


_ack_ids: Callable[[bytes], list[int] | None]
_msg_frames: Callable[[int, list[str]], bytes]
_wsfast = speedups.module("wsfast")
if _wsfast is None:  # not built here, or CHANGESTREAMER_SPEEDUPS=0: same answers, slower
    _ack_ids, _msg_frames = _ack_ids_py, _msg_frames_py
else:
    _ack_ids, _msg_frames = _wsfast.ack_ids, _wsfast.msg_frames


def _text_frames(data: bytes, max_size: int) -> list[str] | None:
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
        mask = data[pos : pos + 4]
        payload = apply_mask(data[pos + 4 : pos + 4 + length], mask)
        pos += 4 + length
        try:
            texts.append(payload.decode())
        except UnicodeDecodeError:
            return None  # the library closes with 1007
    return texts
