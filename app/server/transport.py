"""Streams a subscriber's channel over a websocket (spec/wire.md §1, §5.3).

Outbound, messages become text frames ``{"id":N,"msg":<json>}`` with ids 1, 2,
3… per connection, sent as soon as they are ready (pipelined: acks are not
awaited before sending more). With batching (v7 clients only: ``/subscribe``,
or ``/changes?wsBatched=true``) the messages already queued go out together as
``{"id":N,"batch":[…]}``, at most 64 per frame; a sender never waits to fill a
frame. Inbound, acks are strict ``{"ack":N}`` and in order: the k-th ack names
frame k. An ack consumes every message of its frame (``Downstream.ack_next``),
which advances the subscriber's acked watermark and releases flow control.
Anything else — a binary frame, extra keys, an ack out of order or for an
unsent frame — ends this stream with a protocol-error close; no other
connection is affected.

Frames are written straight to the socket by our websocket protocol's
``DirectSocket`` (app/server/ws_protocol.py), which these streams require: a
connection without it is refused with an error, never served another way. Waiting
for the socket to be writable before each write is the back pressure (the wait ends
when the connection does), so one sender task per connection and no task per
message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterable, Set
from functools import partial
from typing import Any, cast

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from app.protocol.envelope import AckError, parse_ack
from app.protocol.pieces import Pieces, Text
from app.protocol.wsframes import (
    encode_envelopes,
    encode_text_frames,
    fragment_frames,
    frame_count,
    msg_envelope,
)
from app.server.ws_protocol import DIRECT, DirectSocket
from app.streamer.downstream import Downstream, DownstreamClosed
from app.timeouts import within

log = logging.getLogger(__name__)

PROTOCOL_ERROR = 1002
NORMAL_CLOSURE = 1000
MAX_REASON_BYTES = 123
MAX_BATCH = 64
# Messages already queued go out in one socket write, up to this many (v6: a
# frame each; v7: in frames of MAX_BATCH).
MAX_COALESCED = 256
SENDER_GRACE_S = 1.0
# A client's frame is at most this long: clients send acks and v7's control messages
# (well under 1 KiB each), nothing more. Parsing a 16 MiB frame of messages held the
# event loop for seconds; one this long takes well under a millisecond. uvicorn
# refuses a longer one at its header (``ws_max_size``).
MAX_CLIENT_FRAME_BYTES = 64 * 1024
# A client id or task id is at most this long (UTF-8 bytes): each goes into every log
# line of its connection and into the subscriber table. zero's are short.
MAX_CLIENT_ID_BYTES = 256
# The close handshake waits for the socket to be writable; a client that stopped
# reading would hold it (and every byte queued for it) forever: after this long the
# connection is aborted instead.
CLOSE_TIMEOUT_S = 5.0


def id_problem(value: str, name: str) -> str | None:
    """Why ``value`` cannot be a client's ``name`` (an ``id``, a ``taskID``), or None."""
    size = len(value.encode(errors="surrogatepass"))
    if size > MAX_CLIENT_ID_BYTES:
        return f"{name} is {size} bytes long; at most {MAX_CLIENT_ID_BYTES} are accepted"
    return None


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


class Outbound:
    """The server's side of one socket: frame ids, sending, and matching acks.

    Frames come from a ``Downstream`` (whose messages an ack consumes) or are
    control frames with nothing to consume (v7 ``reserved``). Sends are
    serialized by a lock so that ids go out in order.

    Ids run 1, 2, 3… and acks must name them in that order, so matching is a
    counter; what an ack consumes is kept per run of frames (``_runs``: the run's
    last id, its channel, messages per frame), not per frame.
    """

    def __init__(self, websocket: WebSocket) -> None:
        self._websocket = websocket
        self._next_id = 1
        self._acked_id = 0
        self._runs: deque[tuple[int, Downstream | None, int]] = deque()
        self._lock = asyncio.Lock()
        # None: the connection is already lost (every send raises WebSocketDisconnect).
        self._direct = _direct(websocket)
        if self._direct is not None:
            self._direct.on_acks = self.match

    def match(self, acks: list[int]) -> int:
        """Matches acks in order: how many of ``acks``, from the first, name the next
        frames sent; their messages are consumed. The socket's fast path calls this
        with the acks of a whole read (the rest go to the receive loop, whose ``ack``
        raises the precise error)."""
        expected = self._acked_id + 1
        last_sent = self._next_id - 1
        n = len(acks)
        if n and expected + n - 1 <= last_sent and acks == list(range(expected, expected + n)):
            matched = n
        else:
            matched = 0
            for ack in acks:
                if ack != expected + matched or ack > last_sent:
                    break
                matched += 1
        if matched:
            self._consume_through(expected + matched - 1)
        return matched

    def ack(self, ack: int) -> None:
        """One ack; raises ``ProtocolViolation`` unless it names the next frame sent."""
        if self.match([ack]):
            return
        expected = self._acked_id + 1
        if expected >= self._next_id:
            raise ProtocolViolation(f"ack {ack} for a frame that was not sent")
        raise ProtocolViolation(f"unexpected ack {ack}: expected ack {expected}")

    def acked(self, data: str | bytes) -> None:
        """Matches a client ack frame; raises ``ProtocolViolation`` if it is wrong."""
        try:
            ack = parse_ack(data)
        except AckError as e:
            raise ProtocolViolation(f"error parsing ack: {e}") from None
        self.ack(ack)

    async def send(
        self, messages: list[Text], downstream: Downstream | None, *, per_frame: int = 1
    ) -> None:
        """Sends ``messages`` in envelopes with the next ids — one message a frame
        (v6), or batch frames of up to ``per_frame`` (v7) — written together when the
        socket allows: over loopback a write costs the sender the whole TCP path, so
        four frames in one write cost about one. An ack of a frame consumes its
        messages from ``downstream`` (None: control frames, nothing to consume)."""
        if not messages:
            return
        async with self._lock:
            if Pieces not in map(type, messages):
                await self._send_whole(messages, downstream, per_frame)
                return
            start = 0
            for i, message in enumerate(messages):
                if isinstance(message, Pieces):
                    if i > start:
                        await self._send_whole(messages[start:i], downstream, per_frame)
                    await self._send_pieces(message, downstream)
                    start = i + 1
            if start < len(messages):
                await self._send_whole(messages[start:], downstream, per_frame)

    async def _send_whole(
        self, messages: list[Text], downstream: Downstream | None, per_frame: int
    ) -> None:
        """``send`` of messages that are all ``str`` (under the lock)."""
        texts = cast(list[str], messages)
        first = self._next_id
        self._next_id += frame_count(len(messages), per_frame)
        if downstream is None:
            self._runs.append((self._next_id - 1, None, 0))
        else:
            whole, rest = divmod(len(messages), per_frame)
            if whole:
                self._runs.append((first + whole - 1, downstream, per_frame))
            if rest:
                self._runs.append((first + whole, downstream, rest))
        await self._write(encode_envelopes(first, texts, per_frame))

    async def _send_pieces(self, message: Pieces, downstream: Downstream | None) -> None:
        """A large message in a frame of its own (``msg``, in v7 too), written a
        piece at a time as fragments of one websocket message, the loop free
        between them (under the lock, so no other data frame comes between)."""
        frame_id = self._next_id
        self._next_id += 1
        self._runs.append((frame_id, downstream, 0 if downstream is None else 1))
        envelope = msg_envelope(frame_id, message)
        for frame in fragment_frames(envelope.parts):
            await self._write(frame)
            await asyncio.sleep(0)  # one fragment per turn of the loop

    async def send_raw(self, text: str) -> None:
        """A frame outside the id sequence (an ack of a client frame)."""
        async with self._lock:
            await self._write(encode_text_frames([text]))

    async def _write(self, frames: bytes) -> None:
        """Writes whole frames once the socket takes them; raises WebSocketDisconnect
        if it will not any more (closing, closed: the wait ends with the connection)."""
        direct = self._direct
        if direct is None or (not direct.can_write() and not await direct.wait_writable()):
            raise WebSocketDisconnect(1006, "connection closed while sending")
        direct.write(frames)

    def _consume_through(self, acked_id: int) -> None:
        """Frames up to ``acked_id`` were acked: consume their messages."""
        done = self._acked_id
        self._acked_id = acked_id
        runs = self._runs
        while runs and done < acked_id:
            last, downstream, count = runs[0]
            through = min(last, acked_id)
            if downstream is not None and count and not downstream.closed:
                downstream.ack_many((through - done) * count)
            done = through
            if last <= acked_id:
                runs.popleft()

    async def pump(self, downstream: Downstream, *, batched: bool) -> None:
        """Sends ``downstream`` until it closes."""
        per_frame = MAX_BATCH if batched else 1
        while True:
            try:
                first = await downstream.get()
            except DownstreamClosed:
                return
            messages = [first, *downstream.take(MAX_COALESCED - 1)]
            await self.send(messages, downstream, per_frame=per_frame)
            del first, messages  # not held while the next ones are awaited


async def stream_downstream(
    websocket: WebSocket, downstream: Downstream, *, name: str, batched: bool = False
) -> None:
    """Sends ``downstream`` and matches acks until either side ends the stream."""
    try:
        outbound = Outbound(websocket)
    except BaseException:
        downstream.close("connection ended")
        raise
    sender = asyncio.create_task(outbound.pump(downstream, batched=batched), name=f"send-{name}")
    receiver = asyncio.create_task(_receive_acks(websocket, outbound), name=f"recv-{name}")
    # The channel closed by the server (the subscriber was dropped) ends the stream
    # even while the sender waits on a socket its client does not read.
    closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    downstream.on_close(partial(_resolve, closed))
    await run_until_done(
        websocket,
        {sender, receiver, closed},
        on_end=downstream.close,
        name=name,
        plain_close=True,
        readers={receiver},
    )


async def run_until_done(
    websocket: WebSocket,
    tasks: set[asyncio.Future[None]],
    *,
    on_end: Callable[[str], None],
    name: str,
    plain_close: bool = False,
    readers: Set[asyncio.Future[Any]] = frozenset(),
) -> None:
    """Runs a connection's tasks until one ends; then stops the rest and closes
    (within ``CLOSE_TIMEOUT_S``, else the connection is aborted).

    ``readers`` (tasks that only wait for the client's frames) are cancelled at
    once; the others get ``SENDER_GRACE_S`` to finish the frame they write. Waiting
    out the grace on a reader, which ends only when the client sends, held every
    close a second (a handoff's: its view-syncers reconnected that much later).

    ``plain_close``: end with a close frame without a status code, also after a
    protocol violation (spec/wire.md §1.4: once streaming began the reference
    closes so, peers see 1005; the reason goes to our log). Otherwise 1000, or
    1002 with the violation as the reason."""
    violation: ProtocolViolation | None = None
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            error = task.exception()
            if isinstance(error, ProtocolViolation):
                violation = error
            elif error is not None and not isinstance(
                error, (WebSocketDisconnect, DownstreamClosed, OSError)
            ):
                log.warning("stream %s ended with an error: %r", name, error)
    finally:
        on_end("connection ended")
        # Let a sender finish the frame it is writing (closing its channel makes
        # it stop after that): cancelling a send half way leaves the server's
        # side of the close handshake hanging until the client times out.
        for task in readers:
            task.cancel()
        pending = {t for t in tasks if not t.done() and t not in readers}
        if pending:
            _, pending = await asyncio.wait(pending, timeout=SENDER_GRACE_S)
        for task in pending:
            task.cancel()
        await settle(tasks)
        try:
            await within(close(websocket, violation, plain_close), CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.info("stream %s: the client does not read; aborting the connection", name)
            abort(websocket)


async def settle(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Waits until ``tasks`` are done and takes their outcomes, without raising them.

    Not ``await task`` under ``suppress``: a task's exception raised again here
    gets this frame in its traceback while the task keeps it, and the frame's
    locals (the tasks, the socket, the channel) then form a cycle that only a full
    collector pass frees, rare in ``serve`` (app/runtime/gc_tuning.py): every
    connection that ended with an error stayed in memory with its buffers. A
    cancellation of the caller meanwhile ends the wait, as ``suppress`` did."""
    pending = [t for t in tasks if not t.done()]
    if pending:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait(pending)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: not logged as never retrieved


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def abort(websocket: WebSocket) -> None:
    """Drops the connection at once, discarding what is queued for it (nothing to
    do once it is lost)."""
    direct = _direct(websocket)
    if direct is not None:
        direct.abort()


async def _receive_acks(websocket: WebSocket, outbound: Outbound) -> None:
    while True:
        data = await receive_frame(websocket)
        if data is None:
            return
        outbound.acked(data)


async def receive_frame(websocket: WebSocket) -> str | bytes | None:
    """The next frame's payload, or None once the client disconnected."""
    event = await websocket.receive()
    if event["type"] == "websocket.disconnect":
        return None
    text = event.get("text")
    if text is not None:
        return str(text)
    return bytes(event.get("bytes") or b"")


async def close(
    websocket: WebSocket, violation: ProtocolViolation | None, plain: bool = False
) -> None:
    if websocket.client_state != WebSocketState.CONNECTED:
        return
    if violation is not None:
        log.info("closing stream: %s", violation)
    direct = _direct(websocket)
    if direct is None:
        return  # lost: nothing to close
    if plain:
        # ASGI cannot send a close frame without a code (peers of the reference see
        # 1005); False only if a close is already under way, or the socket closing.
        direct.close_without_status()
        return
    with contextlib.suppress(Exception):
        if violation is not None:
            await websocket.close(PROTOCOL_ERROR, close_reason(f"Error: {violation}"))
        else:
            await websocket.close(NORMAL_CLOSURE)


def _direct(websocket: WebSocket) -> DirectSocket | None:
    """This connection's ``DirectSocket``; None once the connection is lost.

    Raises RuntimeError under a server without our websocket protocol: the streams
    write their frames only through it."""
    extension = (websocket.scope.get("extensions") or {}).get(DIRECT)
    if extension is None:
        raise RuntimeError(
            "the replication streams need uvicorn with app.server.ws_protocol.LivenessProtocol "
            "(uvicorn.Config(ws=LivenessProtocol...), as `changestreamer serve` runs it): "
            f"this connection has no {DIRECT!r} extension"
        )
    socket: DirectSocket | None = extension.get("socket")
    return socket
