"""Streams a subscriber's channel over a websocket (spec/wire.md §1).

Outbound, every message becomes a text frame ``{"id":N,"msg":<json>}`` with ids
1, 2, 3… per connection, sent as soon as it is ready (pipelined: acks are not
awaited before sending more). Inbound, the client may only send acks, strictly
``{"ack":N}`` and in order: the k-th ack must name message k. An ack consumes
that message (``Downstream.ack_next``), which is what advances the subscriber's
acked watermark and releases flow control. Anything else — a binary frame,
extra keys, an ack out of order or for an unsent id — ends this stream with a
protocol-error close; no other connection is affected.

``await websocket.send_text`` is the back pressure: uvicorn's websocket protocols
wait while the transport's write buffer is full, so one sender task per
connection and no task per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from app.protocol.envelope import AckError, msg_tail, parse_ack
from app.streamer.downstream import Downstream, DownstreamClosed

log = logging.getLogger(__name__)

PROTOCOL_ERROR = 1002
NORMAL_CLOSURE = 1000
MAX_REASON_BYTES = 123


def close_reason(message: str) -> str:
    """A websocket close reason: at most 123 UTF-8 bytes, elided with '...'."""
    encoded = message.encode()
    if len(encoded) <= MAX_REASON_BYTES:
        return message
    cut = encoded[: MAX_REASON_BYTES - 3].decode(errors="ignore")
    return cut + "..."


async def reject(websocket: WebSocket, message: str) -> None:
    """A setup error: complete the upgrade, then close 1002 with ``Error: <message>``.

    Failing the HTTP handshake instead would look like a hang to zero's clients.
    """
    await websocket.accept()
    await websocket.close(PROTOCOL_ERROR, close_reason(f"Error: {message}"))


class ProtocolViolation(Exception):
    """The client broke the framing rules; its stream is closed."""


async def stream_downstream(websocket: WebSocket, downstream: Downstream, *, name: str) -> None:
    """Sends ``downstream`` and matches acks until either side ends the stream."""
    sender = asyncio.create_task(_send(websocket, downstream), name=f"send-{name}")
    receiver = asyncio.create_task(_receive(websocket, downstream), name=f"recv-{name}")
    violation: ProtocolViolation | None = None
    try:
        done, _ = await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            error = task.exception()
            if isinstance(error, ProtocolViolation):
                violation = error
            elif error is not None and not isinstance(
                error, (WebSocketDisconnect, DownstreamClosed, OSError)
            ):
                log.warning("stream %s ended with an error: %r", name, error)
    finally:
        downstream.close("connection ended")
        for task in (sender, receiver):
            task.cancel()
        for task in (sender, receiver):
            with contextlib.suppress(BaseException):
                await task
        await _close(websocket, violation)


async def _send(websocket: WebSocket, downstream: Downstream) -> None:
    next_id = 1
    while True:
        try:
            message = await downstream.get()
        except DownstreamClosed:
            return
        await websocket.send_text('{"id":' + str(next_id) + msg_tail(message))
        next_id += 1


async def _receive(websocket: WebSocket, downstream: Downstream) -> None:
    expected = 1
    while True:
        event = await websocket.receive()
        if event["type"] == "websocket.disconnect":
            return
        data = event.get("text")
        if data is None:
            data = event.get("bytes") or b""
        try:
            ack = parse_ack(data)
        except AckError as e:
            raise ProtocolViolation(f"error parsing ack: {e}") from None
        if ack != expected:
            raise ProtocolViolation(f"unexpected ack {ack}: expected ack {expected}")
        if downstream.sent_unacked == 0:
            raise ProtocolViolation(f"ack {ack} for a message that was not sent")
        downstream.ack_next()
        expected += 1


async def _close(websocket: WebSocket, violation: ProtocolViolation | None) -> None:
    if websocket.client_state != WebSocketState.CONNECTED:
        return
    with contextlib.suppress(Exception):
        if violation is not None:
            log.info("closing stream: %s", violation)
            await websocket.close(PROTOCOL_ERROR, close_reason(f"Error: {violation}"))
        else:
            # ASGI cannot send a close frame without a code (which peers of the
            # reference see as 1005); 1000 means the same to them: reconnect.
            await websocket.close(NORMAL_CLOSURE)
