"""One change-streamer websocket as the client sees it (wire.md §1).

A :class:`Channel` receives ``{"id":N,"msg":…}`` envelopes, sends ``{"ack":N}``
frames, and watches liveness: the server pings at least every 30 s, so if
neither a ping nor any other frame arrived for ``liveness_timeout`` seconds
(33 s, like zero's client) the TCP connection is aborted without a close
handshake. The client never sends pings of its own; websockets answers the
server's pings automatically.

When the socket ends, :meth:`Channel.receive` raises :class:`ChannelEnded`
holding what the end means to a caller (:func:`classify_close`):

* close 1000, 1001 or 1005 (no status) → a clean end (``error is None``);
* close 1002 → :class:`ProtocolError` with the server's reason;
* a frame over ``max_message_bytes`` → :class:`InvalidMessageError`, at the frame's
  header: the connection is aborted there, its payload never read;
* anything else (1006 / no close frame, 1011, …) → :class:`ConnectionLostError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
    PayloadTooBig,
)
from websockets.protocol import Event

from app.client.errors import (
    ClientError,
    ConnectFailedError,
    ConnectionLostError,
    InvalidMessageError,
    ProtocolError,
    UnauthorizedError,
)
from app.client.urls import without_userinfo
from app.protocol.envelope import Envelope, EnvelopeError, ack_frame, parse_envelope

__all__ = [
    "DEFAULT_LIVENESS_TIMEOUT_S",
    "MAX_MESSAGE_BYTES",
    "Channel",
    "ChannelEnded",
    "ChannelOptions",
    "classify_close",
]

log = logging.getLogger(__name__)

# The server pings every 30 s; zero's client allows 3 s on top.
DEFAULT_LIVENESS_TIMEOUT_S: Final = 33.0
# Access refusals: a retry gets the same answer (UnauthorizedError is final).
_REFUSED_STATUSES: Final = frozenset({401, 403})
# The Node ws client's default maximum message size.
MAX_MESSAGE_BYTES: Final = 100 * 1024 * 1024

_CLEAN_CODES: Final = frozenset({1000, 1001, 1005})


class ChannelOptions:
    """Connection settings shared by every socket a client opens."""

    def __init__(
        self,
        *,
        liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
        open_timeout_s: float = 10.0,
        close_timeout_s: float = 5.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        if liveness_timeout_s <= 0:
            raise ValueError("liveness_timeout_s must be positive")
        self.liveness_timeout_s = liveness_timeout_s
        self.open_timeout_s = open_timeout_s
        self.close_timeout_s = close_timeout_s
        self.max_message_bytes = max_message_bytes


class ChannelEnded(Exception):
    """The socket is gone; ``error`` is None for a clean end, else what to raise."""

    def __init__(self, error: ClientError | None) -> None:
        self.error = error
        super().__init__(str(error) if error is not None else "connection closed")


class _Connection(ClientConnection):
    """A client connection that records when the last frame of any kind arrived,
    and ends at the header of a frame over ``max_size``."""

    last_activity: float

    def process_event(self, event: Event) -> None:
        self.last_activity = self.loop.time()
        super().process_event(event)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # websockets refuses a frame over max_size at its header and sends 1009, but a
        # client then waits for the server to close the TCP connection, reading (and
        # discarding) what comes: a server streaming a 150 MiB frame kept us reading
        # it, then waiting for the liveness timeout. Aborting reads nothing past this
        # read. ``protocol.parser_exc`` is a websockets internal (what stopped its
        # parser; ``ConnectionClosed`` chains it only once closed), as in websockets
        # 17, which pyproject.toml pins.
        if isinstance(self.protocol.parser_exc, PayloadTooBig):
            self.transport.abort()


def classify_close(exc: ConnectionClosed, *, liveness_expired: float | None = None) -> ChannelEnded:
    """What a closed connection means to the caller (see the module docstring)."""
    if liveness_expired is not None:
        return ChannelEnded(
            ConnectionLostError(
                f"no ping or message from the change-streamer for {liveness_expired:g} s"
            )
        )
    if isinstance(exc.__cause__, PayloadTooBig):  # what stopped websockets' parser
        return ChannelEnded(
            InvalidMessageError(f"refused a frame from the change-streamer: {exc.__cause__}")
        )
    rcvd = exc.rcvd
    if rcvd is None:
        return ChannelEnded(ConnectionLostError(f"connection lost ({exc})"))
    if rcvd.code == 1002:
        return ChannelEnded(ProtocolError(rcvd.reason))
    if rcvd.code in _CLEAN_CODES:
        return ChannelEnded(None)
    detail = f"{rcvd.code} {rcvd.reason}".rstrip()
    return ChannelEnded(
        ConnectionLostError(f"connection closed: {detail}", code=rcvd.code, reason=rcvd.reason)
    )


class Channel:
    """An open websocket to a change-streamer endpoint; see the module docstring."""

    def __init__(self, ws: _Connection, url: str, options: ChannelOptions) -> None:
        self.url = url
        self._ws = ws
        self._options = options
        self._closing = False
        self._liveness_expired: float | None = None
        ws.last_activity = ws.loop.time()
        self._watchdog = asyncio.create_task(self._watch(), name=f"liveness {url}")

    @classmethod
    async def open(cls, url: str, options: ChannelOptions) -> Channel:
        """Connects; raises :class:`UnauthorizedError` if the upgrade is answered 401
        or 403, :class:`ConnectFailedError` if connecting fails otherwise."""
        try:
            ws = await connect(
                url,
                open_timeout=options.open_timeout_s,
                close_timeout=options.close_timeout_s,
                ping_interval=None,  # the server pings; the client only answers
                ping_timeout=None,
                max_size=options.max_message_bytes,
                proxy=None,
                create_connection=_Connection,
            )
        except InvalidStatus as e:
            status = e.response.status_code
            if status in _REFUSED_STATUSES:
                raise UnauthorizedError(without_userinfo(url), status) from e
            raise ConnectFailedError(f"cannot connect to {without_userinfo(url)}: {e}") from e
        except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as e:
            raise ConnectFailedError(f"cannot connect to {without_userinfo(url)}: {e}") from e
        assert isinstance(ws, _Connection)
        return cls(ws, url, options)

    @property
    def closing(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closing

    async def receive_frame(self) -> str | bytes:
        """The next frame as received (no parsing); :class:`ChannelEnded` when gone."""
        try:
            return await self._ws.recv()
        except ConnectionClosed as e:
            raise classify_close(e, liveness_expired=self._liveness_expired) from None

    async def receive(self) -> Envelope:
        """The next v6 envelope; :class:`ChannelEnded` when the socket is gone.

        A frame that is not a valid envelope (or is a batch) closes the socket
        and ends the channel with :class:`InvalidMessageError`.
        """
        data = await self.receive_frame()
        try:
            envelope = parse_envelope(data)
        except EnvelopeError as e:
            await self.close()
            raise ChannelEnded(InvalidMessageError(f"invalid frame from the server: {e}")) from e
        if envelope.batch:
            await self.close()
            raise ChannelEnded(
                InvalidMessageError("batch frames are not part of protocol v6 and below")
            )
        return envelope

    async def ack(self, id: int) -> bool:
        """Sends ``{"ack":id}``; False if the socket is already closed."""
        return await self.send_text(ack_frame(id))

    async def send_text(self, text: str) -> bool:
        """Sends one text frame; False if the socket is already closed."""
        try:
            await self._ws.send(text)
        except ConnectionClosed:
            return False
        return True

    async def close(self) -> None:
        """Closes with 1000 (idempotent); waits at most ``close_timeout_s``."""
        self._closing = True
        self._watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watchdog
        await self._ws.close()

    async def wait_closed(self) -> None:
        await self._ws.wait_closed()

    async def _watch(self) -> None:
        timeout = self._options.liveness_timeout_s
        ws = self._ws
        while True:
            remaining = ws.last_activity + timeout - ws.loop.time()
            if remaining <= 0:
                break
            try:
                async with asyncio.timeout(remaining):
                    await ws.wait_closed()
            except TimeoutError:
                continue
            return  # the socket closed by itself: nothing left to watch
        log.warning("%s: no ping or message for %g s; terminating", self.url, timeout)
        self._liveness_expired = timeout
        ws.transport.abort()
