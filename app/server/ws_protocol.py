"""uvicorn's websocket protocol, with zero's liveness rule and a fast path for text frames.

Liveness. The server pings every interval; uvicorn drops a peer whose pong does not
come back within the timeout. Zero's rule is more forgiving (spec/wire.md §1.3): a
peer is alive if *either* a pong *or* any other frame (an ack, say) arrived, because
a replicator busy applying a large transaction may answer pings late while its acks
still flow. So any inbound data here counts as the pong that uvicorn waits for.

Direct frames. A subscriber gets one text frame per change and answers each with an
ack frame, so per-frame overhead is the server's cost per subscriber. Through
uvicorn's sans-I/O layer a send costs ~16 µs (ASGI dispatch, the websockets frame
machinery) and a received ack ~15 µs (a generator-based parser). So the replication
streams write their data frames themselves (``DirectSocket``, frames built by
``app.protocol.wsframes``), never through ASGI ``websocket.send``: the socket is their
only data writer. No extension is ever negotiated (the frames go out as they are,
uncompressed). Inbound, while the connection is plainly open (handshake done, no close
in progress, nothing half-read in the websockets parser, no fragmented message), a
chunk made only of whole, masked, FIN text frames is unmasked and queued directly.
Anything else — control frames, fragments, partial frames, oversized or invalid UTF-8
payloads — goes to uvicorn's path untouched, so every protocol rule and error on the
way in is still the library's.

Control frames are bounded like data: a client gets a burst of pings and pongs and a
rate (``CONTROL_BURST``, ``CONTROL_PER_S``); past it, it is closed with 1008, or, if a
close is already under way (or the handshake is not done), its connection is aborted:
a flooder is parsed no further in any state. Below it, a read's pings get one pong (the
latest), and none while the socket's write buffer is over its high-water mark, so a
peer that pings without reading queues nothing.

A frame whose header announces more than ``ws_max_size`` is refused at the header
(websockets raises there): the connection reads nothing more, the rest of that read
is dropped, and the close frame (1009) goes out only if the socket takes it at once.

This leans on uvicorn's sans-I/O implementation's attributes (``conn``, ``queue``,
``read_paused``, ``pending_ping_payload``, ``pong_timer``, ``schedule_ping``,
``disconnected``, ``frames``...), all there from uvicorn 0.52.1 on, and on three of
websockets' own protocol internals, which its public API has no equivalent for (each
named where it is read: ``conn.reader.buffer``, ``conn.events`` with ``conn.writes``,
``conn.parser``), as they are in websockets 17. Both are checked at import, here and
nowhere else: another uvicorn or websockets fails with a message saying what is needed,
and tests pin the behaviour.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import re
from asyncio import BaseTransport, Transport
from collections.abc import Callable
from typing import Any, Final, cast

from uvicorn._types import ASGISendEvent
from uvicorn.config import Config
from uvicorn.server import ServerState
from websockets.frames import Opcode
from websockets.http11 import Request
from websockets.protocol import State
from websockets.server import ServerProtocol

from app.protocol.envelope import ack_frame, quick_ack
from app.protocol.wsframes import ack_ids, client_texts

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


# The websockets major version whose protocol internals this module reads (see
# ``_plainly_open``, ``handle_events``, ``connection_lost``); pyproject.toml pins it.
WEBSOCKETS_MAJOR: Final = 17


def check_websockets(version: str) -> None:
    """Raises ImportError, saying what is needed, for a websockets other than the major
    version whose internals this module reads."""
    major = re.match(r"(\d+)", version)
    if major is None or int(major.group(1)) != WEBSOCKETS_MAJOR:
        raise ImportError(
            f"websockets {version} is not supported by app/server/ws_protocol.py: it reads "
            f"websockets {WEBSOCKETS_MAJOR}.x protocol internals (the parser's buffer, its "
            "parsed events and queued writes, the parser generator); install the range "
            "pyproject.toml pins"
        )


check_uvicorn(importlib.metadata.version("uvicorn"))
check_websockets(importlib.metadata.version("websockets"))

from uvicorn.protocols.websockets.websockets_sansio_impl import (  # noqa: E402
    WebSocketsSansIOProtocol,
)

__all__ = ["DIRECT", "DirectSocket", "LivenessProtocol"]

log = logging.getLogger(__name__)

# ASGI scope extension: ``scope["extensions"][DIRECT]["socket"]`` is this connection's
# DirectSocket, for an app that wants to skip the ASGI message layer per frame.
DIRECT: Final = "changestreamer.direct"


class DirectSocket:
    """Per-frame shortcuts past ASGI, for the replication streams' hot path.

    The streams' only way to write data: ``can_write`` says whether the connection
    takes frames now (False: ``wait_writable`` first); ``write`` then writes whole
    frames (``app.protocol.wsframes``) at once. ``on_acks``, when set, gets the ids
    of the leading ``{"ack":N}`` frames of each read and returns how many of them,
    from the first, it matched; those never reach the ASGI receive queue, the rest
    (and any other frame) are queued as usual — so an invalid frame still reaches
    the app's receive loop with its error.
    """

    def __init__(self, protocol: LivenessProtocol) -> None:
        self._protocol = protocol
        self.on_acks: Callable[[list[int]], int] | None = None

    def can_write(self) -> bool:
        return self._protocol.can_write_frames()

    def write(self, frames: bytes) -> None:
        self._protocol.transport.write(frames)

    async def wait_writable(self) -> bool:
        """Waits until ``can_write``; False if the connection will not take frames
        any more (closing, closed: a lost connection sets ``writable``, so the wait
        ends on disconnect). Otherwise unbounded, like a send: a client that stops
        reading is dropped by its channel's bounds, which end the sender."""
        protocol = self._protocol
        while not protocol.can_write_frames():
            if protocol.writable.is_set():
                return False  # open for writing, but not for our frames: closing
            await protocol.writable.wait()
        return True

    def abort(self) -> None:
        """Closes the connection now, dropping unsent bytes (a client not reading)."""
        self._protocol.transport.abort()

    def close_without_status(self) -> bool:
        """Starts the close handshake with a close frame that has no status code
        (ASGI cannot send one); False if the connection is not open for it."""
        return self._protocol.close_without_status()


# asyncio's Transport.close() first flushes what is buffered, so a peer that stopped
# reading keeps a "closed" connection, and every byte queued for it, forever: uvicorn
# closes that way after the app returns, on a keepalive timeout and when its close
# handshake times out. Past this long the connection is aborted.
CLOSE_FLUSH_S: Final = 5.0


class _BoundedClose:
    """The connection's transport, except that ``close`` ends in an abort if the
    buffered bytes have not drained within ``CLOSE_FLUSH_S``."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self.write = transport.write  # the hot call, without a Python hop
        self._deadline: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._transport.close()
        if self._deadline is None and self._transport.get_write_buffer_size():
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(CLOSE_FLUSH_S, self._transport.abort)

    def abort(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._transport.abort()


# Inbound control frames (pings, pongs) a client may send: a burst of this many, then
# this many a second. A view-syncer pings every few seconds at most; a client past
# these is flooding (each ping asks us for a pong, which costs memory and loop time
# that healthy subscribers need) and is closed with 1008. Generous enough that no
# well-behaved client meets it, small enough that a flood ends within one read.
CONTROL_BURST: Final = 100
CONTROL_PER_S: Final = 10.0

# A server's pong frame: FIN + opcode 0xA, unmasked (how websockets serializes it).
_PONG_FIRST_BYTE: Final = 0x80 | Opcode.PONG.value


class LivenessProtocol(WebSocketsSansIOProtocol):
    """uvicorn's protocol with the liveness rule, the control-frame bounds and the
    ``DIRECT`` extension (``DirectSocket``), which the replication streams require."""

    direct: DirectSocket | None = None  # set at the handshake
    # Control-frame allowance (a token bucket, refilled at CONTROL_PER_S).
    _control_tokens: float = float(CONTROL_BURST)
    _control_at: float | None = None
    # Sending waits while more than this is buffered for the socket (a subclass per
    # server sets it: ``with_queue_limit``); None keeps asyncio's default.
    max_queued_bytes: int | None = None

    @classmethod
    def with_queue_limit(cls, max_queued_bytes: int) -> type[LivenessProtocol]:
        """This protocol with sending paused above ``max_queued_bytes`` buffered."""
        return type(cls.__name__, (cls,), {"max_queued_bytes": max_queued_bytes})

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        # Without extensions, whatever ``ws_per_message_deflate`` says: the streams
        # write their frames uncompressed (``DirectSocket``), which an extension such as
        # per-message deflate would have to transform. Otherwise uvicorn's arguments.
        self.conn = ServerProtocol(
            max_size=config.ws_max_size, logger=logging.getLogger("uvicorn.error")
        )

    def connection_made(self, transport: BaseTransport) -> None:
        bounded = _BoundedClose(cast(Transport, transport))
        if self.max_queued_bytes is not None:
            bounded.set_write_buffer_limits(high=self.max_queued_bytes)
        super().connection_made(bounded)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        match = self._ack_matcher()
        if not self._plainly_open():
            super().data_received(data)
        elif match is not None and (acks := ack_ids(data)) is not None:
            # Only acks: the transport matches what it can; the rest (out of order,
            # for a frame not sent) go to the receive loop, which names the error.
            handled = match(acks)
            self._queue_texts([ack_frame(ack) for ack in acks[handled:]])
        # ``ws_max_size``: the message size limit uvicorn gives websockets.
        elif (texts := client_texts(data, self.config.ws_max_size)) is None:
            super().data_received(data)
        else:
            self._deliver_texts(texts, match)
        if not self.handshake_initiated and self.conn.handshake_exc is not None:
            self._send_handshake_rejection()
            return
        if self.pending_ping_payload is not None and self.pong_timer is not None:
            # As good as a pong: the peer is reading and writing.
            self.pending_ping_payload = None
            self.pong_timer.cancel()
            self.pong_timer = None
            self.schedule_ping()

    def handle_events(self) -> None:
        """Bounds what a client's control frames cost us before uvicorn handles them.

        websockets queues a pong for every ping as it parses, so a chunk of pings is
        already a list of pongs in ``conn.writes``; uvicorn writes them all, past the
        socket's write-buffer bound that data respects. Here: a client over its
        control allowance is ended (``_end_flooder``); otherwise only the last pong of the
        chunk is sent (RFC 6455 §5.5.3 allows answering only the latest ping), and
        none while the socket's buffer is over its high-water mark (a peer that does
        not read gets no pong queued for it)."""
        conn = self.conn
        # websockets internals (``conn.events``, ``conn.writes``): what the parser made
        # of this read and the pongs it queued, before uvicorn acts on them; the public
        # ``events_received``/``data_to_send`` would take them from uvicorn's handling.
        control = sum(
            1
            for event in conn.events
            if getattr(event, "opcode", None) in (Opcode.PING, Opcode.PONG)
        )
        if control:
            pongs = [w for w in conn.writes if w[:1] and w[0] == _PONG_FIRST_BYTE]
            if pongs:
                keep = pongs[-1] if self.writable.is_set() else None
                conn.writes = [w for w in conn.writes if not (w[:1] and w[0] == _PONG_FIRST_BYTE)]
                if keep is not None:
                    conn.writes.insert(0, keep)
            if not self._charge_control(control):
                self._end_flooder()
                return
        super().handle_events()

    def _charge_control(self, frames: int) -> bool:
        """Takes ``frames`` from the allowance; False once the client is over it."""
        now = self.loop.time()
        if self._control_at is not None:
            elapsed = now - self._control_at
            self._control_tokens = min(
                float(CONTROL_BURST), self._control_tokens + elapsed * CONTROL_PER_S
            )
        self._control_at = now
        self._control_tokens -= frames
        return self._control_tokens >= 0

    def _end_flooder(self) -> None:
        """Ends a control-frame flooder's connection, reading nothing more from it;
        what it sent is dropped (its events never reach the app). Open: closed with
        1008, the close frame flushed if the socket takes it, else (the flooder does
        not read either) aborted with what was buffered for it. Closing already (the
        close frame was sent; its close timer would keep the socket read for
        seconds) or still in the handshake: aborted."""
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        conn = self.conn
        is_open = conn.state is State.OPEN
        log.info(
            "%s a websocket from %s: more than %d control frames (pings, pongs) "
            "at once or %g a second",
            "closing" if is_open else "aborting",
            client,
            CONTROL_BURST,
            CONTROL_PER_S,
        )
        conn.events_received()  # dropped
        conn.data_to_send()  # dropped
        self.stop_keepalive()
        if is_open:
            conn.fail(1008, "too many control frames")
            self.queue.put_nowait(
                {"type": "websocket.disconnect", "code": 1008, "reason": "too many control frames"}
            )
            self.transport.write(b"".join(conn.data_to_send()))
        self.close_sent = True
        if is_open and self.writable.is_set():
            self.transport.close()  # stops the reads at once; _BoundedClose bounds the flush
        else:
            self.transport.abort()

    def handle_parser_exception(self) -> None:
        """websockets stopped parsing this client's data (a frame over ``ws_max_size``,
        refused at its header, or another protocol error), queued its close frame if
        the state let it, and drops the rest of the read. uvicorn writes that frame
        and closes, which stops the reads; here a socket that takes no frames now is
        aborted instead, and so is one still in the handshake, with no close frame to
        send (uvicorn asserted there was one: a traceback at ERROR for each)."""
        if self.conn.state is State.CONNECTING:
            self.close_sent = True
            self.transport.abort()  # the app hears of it from connection_lost
            return
        super().handle_parser_exception()
        if not self.writable.is_set():
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        # Nothing arrives any more: break the reference cycles that would keep the
        # connection's objects (parser, queues, buffers, handshake) until a full
        # collector pass, rare with app/runtime/gc_tuning.py's thresholds (issue 25:
        # a flood's connections stayed after they closed).
        # - websockets' parser is a generator that never returns (it stops at a
        #   last yield) and holds its connection: ``conn.parser`` (an internal; no
        #   public call ends it) is closed;
        # - the protocol, its scope and its DirectSocket refer to each other, and
        #   the app's sender reaches the socket through ``on_acks``. The scope keeps
        #   the extension, without its socket: the app sees a lost connection, not a
        #   server without the extension.
        self.conn.parser.close()
        direct, self.direct = self.direct, None
        if direct is not None:
            direct.on_acks = None
            scope = getattr(self, "scope", None)
            extension = (scope.get("extensions") or {}).get(DIRECT) if scope else None
            if extension is not None:
                extension["socket"] = None

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
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and self.close_sent:
            # The upgrade was answered with an HTTP response (a refusal), which ends
            # the handshake; uvicorn leaves the flag unset and so logged "ASGI
            # callable returned without completing handshake" at ERROR for each one.
            self.handshake_complete = True

    def send_receive_event_to_app(self) -> None:
        # A text message that is not UTF-8 is the client's protocol error (1007), as
        # in uvicorn, but logged as one line, not as a server traceback at ERROR.
        if self.curr_msg_data_type == "text" and not self.close_sent:
            try:
                b"".join(self.frames).decode()
            except UnicodeDecodeError as e:
                self.frames = []
                client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
                log.info("closing a websocket from %s: a text frame is not UTF-8 (%s)", client, e)
                if self.conn.state is not State.OPEN:
                    # The peer's close came in the same read and websockets already
                    # echoed it: no second close may be sent; its handler ends this.
                    return
                self.conn.send_close(1007, "invalid UTF-8")
                self.handle_parser_exception()
                return
        super().send_receive_event_to_app()

    def _send_handshake_rejection(self) -> None:
        """websockets refused the upgrade request itself (a request line or header
        over its limits: 414 or 431, or no valid HTTP) and queued its answer, which
        uvicorn never writes, so the client waited for its own timeout. Send it."""
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.info("refused a websocket upgrade from %s: %s", client, self.conn.handshake_exc)
        self.handshake_initiated = self.handshake_complete = self.close_sent = True
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.transport.close()

    def close_without_status(self) -> bool:
        """What uvicorn does for an ASGI ``websocket.close``, minus the status code:
        the app's receive ends, the peer's echo (or the close timeout) ends the
        connection."""
        if not self.handshake_complete or self.close_sent or self.transport.is_closing():
            return False
        self.queue.put_nowait({"type": "websocket.disconnect", "code": 1005, "reason": ""})
        self.conn.send_close()
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        self.close_timer = self.loop.call_later(self.close_timeout, self.transport.close)
        return True

    def can_write_frames(self) -> bool:
        """Whole frames may be written to the transport now. Sending needs less than
        reading: the parser's state does not matter, and no outgoing fragment of
        websockets' can be open (the streams' data goes only through ``DirectSocket``,
        whose fragments are written under the stream's send lock)."""
        return (
            self._open_for_frames()
            and self.writable.is_set()
            and not self.disconnected
            and self.initial_response is None
        )

    def _open_for_frames(self) -> bool:
        """Handshake done, no close begun."""
        return self.handshake_complete and not self.close_sent and self.conn.state is State.OPEN

    def _plainly_open(self) -> bool:
        """Open for frames, and nothing half-read: no fragmented message begun (uvicorn
        collects its fragments in ``frames``), no partial frame in websockets' parser.
        The latter is ``conn.reader.buffer``, an internal: the public API says nothing
        of bytes received but not yet parsed, and a read that continues a frame must
        not be parsed from its start."""
        return self._open_for_frames() and not self.frames and not self.conn.reader.buffer

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
