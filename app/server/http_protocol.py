"""uvicorn's httptools protocol, with bounds on requests that have not arrived yet.

A connection is *pending* from its first byte (or its opening) until its request's
headers are complete, and again from the first byte of each later request on it.
uvicorn bounds neither how many connections may be pending nor for how long, nor
(for upgrades, which websockets parses again) quite how large a request head may
grow before the client hears why it was refused. Here:

* at most ``max_pending`` connections are pending at once: one more is answered
  ``503`` and closed at once, so a flood of slow handshakes cannot starve the
  subscribers already streaming (their connections are not pending);
* a pending connection whose headers have not arrived within ``timeout_s`` is
  answered ``408`` and closed (slow-header clients);
* a request line longer than ``MAX_REQUEST_LINE_BYTES`` is answered ``414`` and a
  request head larger than ``MAX_REQUEST_HEAD_BYTES`` ``431``, before the parser
  or the websocket handshake sees it, and the client receives the answer (uvicorn
  logged a 414 that the websocket path never sent: the client hung);
* websocket handshakes proceed at most ``handshakes_per_s`` a second, in arrival
  order (``admission.py``); one held longer than ``timeout_s``, or beyond
  ``max_pending`` held at once, is answered ``503``.
* at shutdown ``PendingLimits.draining`` is set: responses that stream until their
  client leaves (``/dashboard/events``) end then, instead of holding shutdown for
  uvicorn's whole grace period.

Refusals are logged at INFO with the client's address: the first of each status
at once, the rest as one summary line per ``REFUSAL_LOG_INTERVAL_S`` (a flood of
refused connections must not become a flood of log lines). Like
``ws_protocol.py``, this subclasses an uvicorn implementation class; the
pinned uvicorn range is tested.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.server.admission import HandshakeAdmission
from app.server.log_lines import RefusalLog

__all__ = [
    "MAX_REQUEST_HEAD_BYTES",
    "MAX_REQUEST_LINE_BYTES",
    "GuardedHttpProtocol",
    "PendingLimits",
]

log = logging.getLogger(__name__)

# websockets refuses request lines over 8 KiB in the handshake; plain requests get
# the same limit here, and a whole head of at most 16 KiB.
MAX_REQUEST_LINE_BYTES: Final = 8 * 1024
MAX_REQUEST_HEAD_BYTES: Final = 16 * 1024

_REASONS: Final = {
    408: b"Request Timeout",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


REFUSAL_LOG_INTERVAL_S: Final = 10.0


@dataclass
class PendingLimits:
    """The bounds, and the count of pending connections they share (one per server)."""

    max_pending: int
    timeout_s: float
    admission: HandshakeAdmission
    pending: int = 0
    refusals: RefusalLog = field(
        default_factory=lambda: RefusalLog("connection", log, REFUSAL_LOG_INTERVAL_S)
    )
    # By status, since start; every status this module answers with is there from the
    # start at 0, so a rate() over /metrics sees the first refusal too.
    refused: Counter[int] = field(default_factory=lambda: Counter(dict.fromkeys(_REASONS, 0)))
    # Set when the server starts shutting down: uvicorn then waits (up to its grace
    # period) for responses in progress, so those that stream until their client
    # leaves (the dashboard's events) end when this is set.
    draining: asyncio.Event = field(default_factory=asyncio.Event)


class GuardedHttpProtocol(HttpToolsProtocol):
    limits: PendingLimits  # set per server by ``with_limits``

    @classmethod
    def with_limits(
        cls, max_pending: int, timeout_s: float, handshakes_per_s: float
    ) -> type[GuardedHttpProtocol]:
        """This protocol with its own count of pending connections, and its own
        admission of websocket handshakes (bursts of one second's worth)."""
        admission = HandshakeAdmission(
            handshakes_per_s, max(1.0, handshakes_per_s), max_waiting=max_pending
        )
        limits = PendingLimits(max_pending, timeout_s, admission)
        return type(cls.__name__, (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending = False
        self._answered = False
        self._head_bytes = 0
        self._line_done = False
        self._deadline: asyncio.TimerHandle | None = None
        self._held = False  # a websocket handshake waiting for its turn
        self._hold_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.limits.pending >= self.limits.max_pending:
            self._refuse(503, f"more than {self.limits.max_pending} connections are opening")
            return
        self._begin_pending()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_pending()
        self._end_hold()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        self.limits.draining.set()
        super().shutdown()

    def data_received(self, data: bytes) -> None:
        if self._answered:
            return
        if not self._pending and self.cycle is not None and self.cycle.response_complete:
            self._begin_pending()  # the first bytes of the next request on this connection
        if self._pending:
            if not self._line_done:
                end = data.find(b"\n")
                self._line_done = end >= 0
                line_bytes = self._head_bytes + (end if self._line_done else len(data))
                if line_bytes > MAX_REQUEST_LINE_BYTES:
                    self._refuse(414, f"request line over {MAX_REQUEST_LINE_BYTES} bytes")
                    return
            self._head_bytes += len(data)
            if self._head_bytes > MAX_REQUEST_HEAD_BYTES:
                self._refuse(431, f"request head over {MAX_REQUEST_HEAD_BYTES} bytes")
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._end_pending()
        super().on_headers_complete()

    def handle_websocket_upgrade(self) -> None:
        """The handshake proceeds when admission lets it (at once, within the rate)."""
        admission = self.limits.admission
        self._held = True
        if not admission.offer(self):
            self._held = False
            self._refuse(503, f"more than {admission.max_waiting} websocket handshakes are waiting")
            return
        if self._held:  # not admitted at once: read nothing until its turn
            self.transport.pause_reading()
            self._hold_deadline = self.loop.call_later(self.limits.timeout_s, self._held_too_long)

    # -- admission.Waiter ---------------------------------------------------

    @property
    def waiting(self) -> bool:
        return self._held

    def admitted(self) -> None:
        paused = self._hold_deadline is not None
        self._end_hold()
        if self.transport.is_closing():
            return
        if paused:
            self.transport.resume_reading()
        super().handle_websocket_upgrade()
        # The websocket protocol has the connection now and this one hears nothing
        # more (uvicorn drops its parser only in connection_lost, which goes to the
        # new protocol): the parser refers back to this protocol, and the cycle
        # would wait for a full collector pass.
        self.parser = None  # type: ignore[assignment]

    # -- internals ----------------------------------------------------------

    def _begin_pending(self) -> None:
        if self._pending:
            return
        self._pending = True
        self._head_bytes = 0
        self._line_done = False
        self.limits.pending += 1
        self._deadline = self.loop.call_later(self.limits.timeout_s, self._timed_out)

    def _end_pending(self) -> None:
        if not self._pending:
            return
        self._pending = False
        self.limits.pending -= 1
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _end_hold(self) -> None:
        self._held = False
        if self._hold_deadline is not None:
            self._hold_deadline.cancel()
            self._hold_deadline = None

    def _held_too_long(self) -> None:
        self._hold_deadline = None
        if self._held:
            self._end_hold()
            self._refuse(503, f"no websocket handshake slot within {self.limits.timeout_s:g} s")

    def _timed_out(self) -> None:
        self._deadline = None
        if self._pending and not self._answered:
            self._refuse(408, f"no complete request within {self.limits.timeout_s:g} s")

    def _refuse(self, status: int, why: str) -> None:
        """Answers ``status`` and closes; the connection reads nothing more."""
        self._answered = True
        self._end_pending()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        self.limits.refused[status] += 1
        self.limits.refusals.refused(status, client, why)
        body = why.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, _REASONS[status], len(body), body)
        )
        self.transport.close()
