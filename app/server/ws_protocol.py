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
``read_paused``, ``pending_ping_payload``, ``pong_timer``, ``schedule_ping``...); tests
pin the behaviour, so an uvicorn or websockets upgrade that renames them fails loudly.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

from uvicorn._types import ASGISendEvent
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.http11 import Request
from websockets.protocol import State
from websockets.utils import apply_mask

__all__ = ["DIRECT", "DirectSocket", "LivenessProtocol"]

# ASGI scope extension: ``scope["extensions"][DIRECT]["socket"]`` is this connection's
# DirectSocket, for an app that wants to skip the ASGI message layer per frame.
DIRECT: Final = "changestreamer.direct"


class DirectSocket:
    """Per-frame shortcuts past ASGI, for the replication streams' hot path.

    ``try_send`` writes a text frame now if the connection is plainly open (False:
    use the ASGI send). ``on_texts``, when set, sees the inbound text frames of each
    read first and returns how many of them, from the first, it handled (acks);
    those never reach the ASGI receive queue, the rest are queued as usual — so an
    invalid frame still reaches the app's receive loop with its error.
    """

    def __init__(self, protocol: LivenessProtocol) -> None:
        self._protocol = protocol
        self.on_texts: Callable[[list[str]], int] | None = None

    def try_send(self, text: str) -> bool:
        return self._protocol.send_now(text)

    def try_send_many(self, texts: list[str]) -> bool:
        """Like ``try_send`` for several frames, written with one call."""
        return self._protocol.send_many_now(texts)


_FIN_TEXT: Final = 0x81
_MASKED: Final = 0x80
_HEADER_16: Final = struct.Struct("!BBH")
_HEADER_64: Final = struct.Struct("!BBQ")


class LivenessProtocol(WebSocketsSansIOProtocol):
    def data_received(self, data: bytes) -> None:
        texts = _text_frames(data, self._max_message_size()) if self._plainly_open() else None
        if texts is None:
            super().data_received(data)
        elif texts:
            self._deliver_texts(texts)
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
        # Sending needs less than reading: the parser's state does not matter.
        if not (
            self._open_for_frames()
            and self.writable.is_set()
            and not self.disconnected
            and self.initial_response is None
        ):
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
        if not (
            self._open_for_frames()
            and self.writable.is_set()
            and not self.disconnected
            and self.initial_response is None
        ):
            return False
        self.transport.write(_text_frames_bytes(texts))
        return True

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

    def _deliver_texts(self, texts: list[str]) -> None:
        """What uvicorn does with complete text messages (send_receive_event_to_app)."""
        if self.close_sent:
            return
        direct = getattr(self, "direct", None)
        handled = 0
        # Only while nothing waits in the queue: frames are seen in arrival order.
        if direct is not None and direct.on_texts is not None and self.queue.empty():
            handled = direct.on_texts(texts)
        for text in texts[handled:]:
            self.queue.put_nowait({"type": "websocket.receive", "text": text})
        if handled < len(texts) and not self.read_paused:
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
