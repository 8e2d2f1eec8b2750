"""Protocol v7: one ``/replication/v7/subscribe`` socket for reserve, restore and subscribe.

wire.md §5. The socket carries frames both ways — ``{"id":N,"msg":…}`` or
``{"id":N,"batch":[…]}`` — with an id counter per direction, and each side acks
what it receives with ``{"ack":N}``. A frame is an ack if and only if it is a
JSON object whose only key is ``ack``.

Low level, :meth:`ChangeStreamerClient.connect` returns a :class:`V7Connection`
(zero's ``connect(taskID)``: an inbound stream plus an outbound sink):

* ``await conn.send(message)`` wraps ``message`` as ``{"id":N,"msg":message}``
  with the client's own counter (1, 2, …) and, by default, waits until the
  server acked frame N. The server acks a frame once it has acted on it, so
  that means the server has opened the reservation or registered the
  subscriber. Server acks must name the client's frames in order. Anything
  else is an invalid frame (:class:`~app.client.errors.InvalidMessageError`,
  the socket is closed).
* ``async for message in conn`` yields the server's messages, with batch frames
  flattened, as :data:`V7Message`: a :class:`~app.client.reservation.SnapshotStatus`
  for ``reserved``, or one of the v6 subscription messages. Frame N is acked
  when every message in it has been consumed, i.e. when the caller asks for
  the message after the last one of that frame (the same rule as
  :class:`~app.client.subscription.Subscription`; an empty batch is acked right
  away). An in-band ``error`` is acked, the socket is closed, and it is raised
  as a :class:`~app.client.errors.ChangeStreamerError` subclass. A 1002 close
  raises :class:`~app.client.errors.ProtocolError`, a clean close ends the
  iteration, and any other end raises
  :class:`~app.client.errors.ConnectionLostError`.
* ``await conn.close()`` closes with 1000. The server then cancels a
  reservation that no ``start-subscription`` has taken over yet.

A background task reads the socket, so acks of ``send`` arrive even while
nobody iterates. Inbound frames queue up until the caller asks for them. The
queue is bounded in practice by the server's flow control, because the server
waits for the acks, and the client only acks what the caller consumed.

High level, with ``ChangeStreamerClient(url, protocol_version=7)``:

* ``reserve_snapshot(task_id)`` sends ``reserve-snapshot``, waits for
  ``reserved`` and returns it with a :class:`V7ReservationFollowup`. The
  followup's ``subscribe(ctx)`` sends ``start-subscription`` **on the same
  socket** and returns a :class:`~app.client.subscription.Subscription`.
  ``cancel()`` closes the socket. ``closed`` is set when the socket ends.
* ``subscribe(ctx)`` connects and sends ``start-subscription`` directly (a
  replica that is still valid).

``start-subscription`` always carries a ``taskID`` because the server requires
one. It is ``ctx.task_id``, or ``ctx.id`` when the context has none. v7 has no
``initial`` parameter.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self

from app.client.channel import Channel, ChannelEnded
from app.client.errors import (
    ClientError,
    ConnectionLostError,
    InvalidMessageError,
    error_from_message,
)
from app.client.reservation import SnapshotStatus, snapshot_status_from_body
from app.client.subscription import Subscription, SubscriptionContext, SubscriptionMessage
from app.protocol.canonical_json import dumps, loads
from app.protocol.envelope import (
    AckError,
    Envelope,
    EnvelopeError,
    ack_from_value,
    envelope_from_value,
)
from app.protocol.messages import MessageValidationError
from app.protocol.subscription_messages import DownstreamError, parse_downstream_message
from app.protocol.wsframes import envelope_texts

__all__ = [
    "V7Connection",
    "V7Message",
    "V7ReservationFollowup",
    "parse_v7_message",
    "reserve_on",
    "start_subscription_message",
    "subscribe_on",
]

log = logging.getLogger(__name__)

V7Message = SnapshotStatus | SubscriptionMessage

EndCallback = Callable[[ClientError | None], None]


def parse_v7_message(value: Any) -> V7Message | DownstreamError:
    """A decoded server message: ``reserved`` or the v6 catalog (errors are returned)."""
    if isinstance(value, list) and value and value[0] == "reserved":
        if len(value) != 2:
            raise InvalidMessageError(f"reserved: expected 2 elements, got {len(value)}")
        return snapshot_status_from_body(value[1], "reserved")
    try:
        return parse_downstream_message(value)
    except MessageValidationError as e:
        raise InvalidMessageError(f"invalid message from the server: {e}") from e


def start_subscription_message(ctx: SubscriptionContext) -> list[Any]:
    """``["start-subscription", {…}]`` for ``ctx`` (see the module docstring on taskID)."""
    return [
        "start-subscription",
        {
            "taskID": ctx.task_id or ctx.id,
            "id": ctx.id,
            "mode": ctx.mode,
            "replicaVersion": ctx.replica_version,
            "watermark": ctx.watermark,
        },
    ]


class V7Connection:
    """One ``/subscribe`` socket, both directions. See the module docstring."""

    def __init__(self, channel: Channel, task_id: str | None = None) -> None:
        self.task_id = task_id
        self.closed = asyncio.Event()  # set once the socket is gone, for whatever reason
        self._channel = channel
        self._next_id = 1
        self._acked = 0  # the last of our frames the server acked
        self._waiting: dict[int, asyncio.Future[bool]] = {}
        self._send_lock = asyncio.Lock()
        self._frames: asyncio.Queue[Envelope | None] = asyncio.Queue()  # None: the end
        self._current: Envelope | None = None  # the frame being handed out
        self._index = 0  # the next message of _current to hand out
        self._handed_out: list[int] = []  # frames handed out whole by next_messages, unacked
        self._frames_received = 0
        self._end: ChannelEnded | None = None
        self._iteration_done = False
        self._closed_by_caller = False
        self._end_callbacks: list[EndCallback] = []
        self._reader = asyncio.create_task(self._read(), name=f"v7 {channel.url}")

    @property
    def url(self) -> str:
        return self._channel.url

    @property
    def last_sent(self) -> int:
        """The id of the last frame this client sent (0 before the first)."""
        return self._next_id - 1

    @property
    def last_acked(self) -> int:
        """The id of the last of this client's frames that the server acked."""
        return self._acked

    @property
    def frames_received(self) -> int:
        """How many ``{"id":N,…}`` frames (not acks) the server has sent so far."""
        return self._frames_received

    @property
    def end_error(self) -> ClientError | None:
        """Why the socket ended, once ``closed`` is set (None for a clean end)."""
        return self._end.error if self._end is not None else None

    def add_end_callback(self, callback: EndCallback) -> None:
        """Calls ``callback(end_error)`` when the socket ends (now if it already has)."""
        if self._end is not None:
            callback(self._end.error)
        else:
            self._end_callbacks.append(callback)

    # -- outbound ----------------------------------------------------------

    async def send(self, message: Any, *, wait_for_ack: bool = True) -> int:
        """Sends ``{"id":N,"msg":message}`` and returns N.

        With ``wait_for_ack``, returns only after the server acked N. Raises
        the reason the socket ended (for example :class:`ProtocolError` for
        1002) if it ends before that, or before the frame could be sent.
        """
        text = dumps(message)  # a value that cannot be serialized fails here
        async with self._send_lock:  # ids go out in order
            if self._end is not None or self._channel.closing:
                raise self._lost("the connection is closed")
            frame_id = self._next_id
            self._next_id += 1
            acked = asyncio.get_running_loop().create_future()
            self._waiting[frame_id] = acked
            sent = await self._channel.send_text(envelope_texts(frame_id, [text])[0])
        if not sent:
            await self.closed.wait()  # the reader records why
            raise self._lost(f"the connection closed before frame {frame_id} was sent")
        if wait_for_ack and not await acked:
            raise self._lost(f"the connection closed before the server acked frame {frame_id}")
        return frame_id

    def _lost(self, what: str) -> ClientError:
        error = self.end_error
        return error if error is not None else ConnectionLostError(what)

    # -- inbound -----------------------------------------------------------

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> V7Message:
        if self._iteration_done:
            raise StopAsyncIteration
        try:
            raw = await self.next_message()
        except ChannelEnded as ended:
            self._iteration_done = True
            closed_by_caller = self._closed_by_caller  # close() ran while we were waiting
            await self.close()
            if ended.error is None or closed_by_caller:
                raise StopAsyncIteration from None
            raise ended.error from None
        try:
            message = parse_v7_message(raw)
        except InvalidMessageError:
            self._iteration_done = True
            await self.close()
            raise
        if isinstance(message, DownstreamError):
            self._iteration_done = True
            await self.ack_received()  # the server waits for this ack before it closes
            await self.close()
            raise error_from_message(message)
        return message

    async def next_message(self) -> Any:
        """The next raw (decoded, unvalidated) message; batch frames are flattened.

        First acks the current frame if the caller has now consumed all of its
        messages. Raises :class:`ChannelEnded` once the socket is gone and
        every frame received before that was handed out.
        """
        if self._handed_out:
            await self._ack_handed_out()
        while True:
            current = self._current
            if current is not None:
                if self._index < len(current.messages):
                    message = current.messages[self._index]
                    self._index += 1
                    return message
                self._current = None
                await self._channel.ack(current.id)
            envelope = await self._frames.get()
            if envelope is None:
                self._frames.put_nowait(None)  # every later call ends too
                assert self._end is not None
                raise ChannelEnded(self._end.error)
            self._current = envelope
            self._index = 0

    async def next_messages(self, limit: int) -> list[Any]:
        """Every message received and not yet handed out, up to ``limit``; waits for one.

        A batch of :meth:`next_message`: frames are acked by the *next* call, once the
        caller has finished with all their messages, so acks never run ahead of it.
        """
        await self._ack_handed_out()
        out: list[Any] = []
        while len(out) < limit:
            current = self._current
            if current is not None and self._index < len(current.messages):
                taken = current.messages[self._index : self._index + limit - len(out)]
                out.extend(taken)
                self._index += len(taken)
                continue
            if out and self._frames.empty():
                break
            if current is not None:  # handed out whole: acked by the next call
                self._handed_out.append(current.id)
                self._current = None
            if out:
                envelope = self._frames.get_nowait()
            else:  # nothing handed out yet: empty frames skipped so far are done with
                await self._ack_handed_out()
                envelope = await self._frames.get()
            if envelope is None:
                self._frames.put_nowait(None)  # every later call ends too
                if out:
                    break
                assert self._end is not None
                raise ChannelEnded(self._end.error)
            self._current = envelope
            self._index = 0
        return out

    async def _ack_handed_out(self) -> None:
        """Acks, in order, the frames of earlier batches and a current frame handed out whole."""
        current = self._current
        if current is not None and self._index >= len(current.messages):
            self._handed_out.append(current.id)
            self._current = None
        handed, self._handed_out = self._handed_out, []
        for frame_id in handed:
            await self._channel.ack(frame_id)

    async def ack_consumed(self) -> None:
        """Acks the current frame now if all its messages were handed out.

        The next :meth:`next_message` would do the same. Use this when no next
        message is asked for soon, as after ``reserved``.
        """
        current = self._current
        if current is not None and self._index >= len(current.messages):
            self._current = None
            await self._channel.ack(current.id)

    async def ack_received(self) -> None:
        """Acks the frame of the last message handed out now, consumed or not (errors)."""
        handed, self._handed_out = self._handed_out, []
        for frame_id in handed:
            await self._channel.ack(frame_id)
        current, self._current = self._current, None
        if current is not None:
            await self._channel.ack(current.id)

    # -- life cycle ----------------------------------------------------------

    async def close(self) -> None:
        """Closes with 1000 (idempotent) and waits until the reader has finished."""
        self._closed_by_caller = True
        await self._channel.close()
        await asyncio.wait({self._reader})

    async def wait_closed(self) -> None:
        """Returns once the socket is gone."""
        await self.closed.wait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _read(self) -> None:
        ended = ChannelEnded(None)
        try:
            while True:
                data = await self._channel.receive_frame()
                try:
                    self._dispatch(data)
                except InvalidMessageError as e:
                    ended = ChannelEnded(e)
                    await self._channel.close()
                    return
        except ChannelEnded as e:
            ended = e
        finally:
            self._end = ended
            for acked in self._waiting.values():
                if not acked.done():
                    acked.set_result(False)
            self._waiting.clear()
            self._frames.put_nowait(None)
            self.closed.set()
            callbacks, self._end_callbacks = self._end_callbacks, []
            for callback in callbacks:
                try:
                    callback(ended.error)
                except Exception:
                    log.exception("%s: end callback failed", self.url)

    def _dispatch(self, data: str | bytes) -> None:
        """Routes one server frame: an ack of ours, or an envelope for the caller."""
        if not isinstance(data, str):
            raise InvalidMessageError("binary frames are not accepted from the server")
        try:
            value = loads(data)
        except ValueError as e:
            raise InvalidMessageError(f"invalid frame from the server: not JSON: {e}") from e
        if isinstance(value, dict) and value.keys() == {"ack"}:
            try:
                self._on_ack(ack_from_value(value))
            except AckError as e:
                raise InvalidMessageError(f"invalid ack from the server: {e}") from e
            return
        try:
            envelope = envelope_from_value(value)
        except EnvelopeError as e:
            raise InvalidMessageError(f"invalid frame from the server: {e}") from e
        self._frames_received += 1
        self._frames.put_nowait(envelope)

    def _on_ack(self, ack: int) -> None:
        expected = self._acked + 1
        if ack >= self._next_id:
            raise InvalidMessageError(f"the server acked frame {ack}, which was not sent")
        if ack != expected:
            raise InvalidMessageError(f"the server acked frame {ack}: expected {expected}")
        self._acked = ack
        acked = self._waiting.pop(ack, None)
        if acked is not None and not acked.done():
            acked.set_result(True)


# -- the high-level operations --------------------------------------------------------


async def subscribe_on(connection: V7Connection, ctx: SubscriptionContext) -> Subscription:
    """Sends ``start-subscription`` on ``connection``; its messages as a Subscription.

    Does not wait for the server's ack: like a v6 subscription, request
    errors (1002) and in-band errors surface on the first ``__anext__``. That
    includes a socket the server already closed, in which case the send fails
    and the connection records why.
    """
    with contextlib.suppress(ClientError):
        await connection.send(start_subscription_message(ctx), wait_for_ack=False)
    return Subscription(connection, ctx)


async def reserve_on(
    connection: V7Connection, task_id: str
) -> tuple[SnapshotStatus, V7ReservationFollowup]:
    """Sends ``reserve-snapshot``, waits for ``reserved``, acks it.

    Closes ``connection`` if that fails. A server without backups closes with
    1002 (:class:`ProtocolError`).
    """
    try:
        await connection.send(["reserve-snapshot", {"taskID": task_id}])
        try:
            message = await anext(connection)
        except StopAsyncIteration:
            raise ConnectionLostError(
                "the connection was closed before the reservation was confirmed"
            ) from None
        if not isinstance(message, SnapshotStatus):
            raise InvalidMessageError(f"expected a reserved message, got {message.kind!r}")
        await connection.ack_consumed()
    except BaseException:
        await connection.close()
        raise
    return message, V7ReservationFollowup(connection, task_id)


class V7ReservationFollowup:
    """Holds a v7 reservation until ``subscribe`` or ``cancel`` (same socket).

    ``closed`` is set once the socket is gone, for whatever reason. Unlike the
    v6 followup, after ``subscribe()`` that socket *is* the subscription, so
    ``closed`` is set when the subscription ends. ``aborted`` is True if the
    socket died before ``subscribe()``/``cancel()``. Then the reservation is
    lost and the caller should start over, possibly on another server.
    """

    def __init__(self, connection: V7Connection, task_id: str) -> None:
        self.task_id = task_id
        self.connection = connection
        self.closed = asyncio.Event()
        self.close_error: ClientError | None = None  # why the socket ended, if abnormally
        self._settled = False  # subscribe() or cancel() was called
        self._aborted = False
        connection.add_end_callback(self._ended)

    @property
    def aborted(self) -> bool:
        """True if the socket died before ``subscribe()``/``cancel()``: the reservation is lost."""
        return self._aborted

    async def subscribe(self, ctx: SubscriptionContext) -> Subscription:
        """Sends ``start-subscription`` on the reservation's socket.

        ``ctx.task_id`` becomes this task (and ``ctx.initial`` True, as in v6).
        Raises :class:`ConnectionLostError` (or the close's own error) if the
        socket is already gone. Only one call per followup.
        """
        if self._settled:
            raise RuntimeError("subscribe() or cancel() was already called on this reservation")
        if self.closed.is_set():
            raise self.close_error or ConnectionLostError(
                "the reservation's connection closed before the subscription"
            )
        self._settled = True
        ctx = dataclasses.replace(ctx, task_id=self.task_id, initial=True)
        return await subscribe_on(self.connection, ctx)

    async def cancel(self) -> None:
        """Abandons the reservation: closes the socket (idempotent)."""
        self._settled = True
        await self.connection.close()
        await self.wait_closed()

    async def wait_closed(self) -> None:
        """Returns once the socket is gone."""
        await self.closed.wait()

    def _ended(self, error: ClientError | None) -> None:
        self.close_error = error
        if not self._settled:
            self._aborted = True
            log.warning(
                "snapshot reservation for %s ended before the subscription: %s",
                self.task_id,
                error or "closed by the server",
            )
        self.closed.set()
