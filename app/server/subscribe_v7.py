"""The merged v7 protocol: ``GET /replication/v7/subscribe`` (spec/wire.md §5).

One socket carries a snapshot reservation, the wait while the client restores
its replica from backup, and then the subscription — so the node that reserved
the change log is the one that serves it:

    idle ──reserve-snapshot──► reserved (one ``reserved`` message) ──start-subscription──► v6 stream
      └──────────────────────────start-subscription (a replica that is still valid)──────────┘

Both directions use ``{"id":N,"msg":…}`` frames with their own id counters, and
both ack what they receive. The server acks a client frame once it has acted on
it; it sends the change stream in batch frames (``{"id":N,"batch":[…]}``).

Rules (the spec leaves them to the server; these are ours): a socket holds one
reservation: a second ``reserve-snapshot`` of the same task replaces the first, of
another task it is a protocol error; ``reserve-snapshot`` after
``start-subscription``, a second ``start-subscription``, an unknown message, more
than ``MAX_FRAME_MESSAGES`` messages in a frame, an id or task id over
``MAX_CLIENT_ID_BYTES``, or a malformed frame is a protocol error (close 1002 with
the reason); a socket that closes before ``start-subscription`` cancels its
reservation, and a reservation that another connection ends (a reservation or a
subscription of the same task) closes this socket with 1002 and the reason, so the
client knows its restore is no longer protected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from fastapi import WebSocket

from app.protocol.canonical_json import dumps, loads
from app.protocol.envelope import (
    AckError,
    EnvelopeError,
    ack_frame,
    ack_from_value,
    envelope_from_value,
)
from app.protocol.lexi import InvalidWatermarkError, parse_state_version
from app.server.transport import (
    Outbound,
    ProtocolViolation,
    id_problem,
    receive_frame,
    run_until_done,
    settle,
)
from app.streamer.downstream import Downstream
from app.streamer.reservations import (
    BackupsNotConfiguredError,
    Reservation,
    TooManyReservations,
)
from app.streamer.service import (
    ChangeStreamerService,
    SocketSlot,
    SubscriberContext,
    TooManySubscribers,
)

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 7
# Messages one client frame may carry: a view-syncer sends one or two (an ack
# batch is a frame of its own). More is a protocol error, before any is acted on.
MAX_FRAME_MESSAGES = 8


class Session:
    """One ``/subscribe`` socket."""

    def __init__(
        self,
        websocket: WebSocket,
        get_service: Callable[[], ChangeStreamerService],
        *,
        log_fields: dict[str, object] | None = None,
        slot: SocketSlot | None = None,
    ) -> None:
        self._websocket = websocket
        self._slot = slot
        self._first_message = asyncio.Event()
        self._get_service = get_service
        # The connection's log fields (``app.logs.bind_log_fields``), updated in place
        # as messages name the task and the subscriber: the tasks already running see it.
        self._log_fields = log_fields if log_fields is not None else {}
        self._outbound = Outbound(websocket)
        self._expected_client_id = 1
        self._reservation: Reservation | None = None
        self._relay: asyncio.Task[None] | None = None
        self._downstream: Downstream | None = None
        self._sender: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._ending = False
        # Set when the server ends the session: this socket's reservation was
        # ended by another connection before this one subscribed (the socket then
        # protects nothing: it is closed with ``_end_reason``, and the client learns
        # to start over), or the subscription's channel closed (the subscriber was
        # dropped: its sender may be stuck behind a client that does not read).
        self._server_ended = asyncio.Event()
        self._end_reason: str | None = None

    async def run(self) -> None:
        receiver = asyncio.create_task(self._receive(), name="v7-receive")
        subscription = asyncio.create_task(self._send_subscription(), name="v7-send")
        server_ended = asyncio.create_task(self._ended_by_server(), name="v7-server-ended")
        try:
            await run_until_done(
                self._websocket,
                {receiver, subscription, server_ended},
                on_end=self._end,
                name="v7",
            )
        finally:
            tasks = [t for t in (self._relay, self._sender) if t is not None]
            for task in tasks:
                task.cancel()
            await settle(tasks)
            # Each task's frame refers to this session: no cycle through a kept one.
            self._relay = self._sender = None

    async def _ended_by_server(self) -> None:
        await self._server_ended.wait()
        if self._end_reason is not None:
            raise ProtocolViolation(self._end_reason)

    def _end(self, reason: str) -> None:
        self._ending = True
        if self._reservation is not None:
            self._reservation.cancel()  # a no-op once the subscription completed it
        if self._downstream is not None:
            self._downstream.close(reason)
        self._subscribed.set()  # releases a sender that never got a subscription

    async def _send_subscription(self) -> None:
        await self._subscribed.wait()
        if self._downstream is None:
            return
        await self._outbound.pump(self._downstream, batched=True)

    async def _receive(self) -> None:
        timeout_s = self._get_service().options.first_message_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if self._first_message.is_set():
                data = await receive_frame(self._websocket)
            else:
                try:
                    async with asyncio.timeout_at(deadline):
                        data = await receive_frame(self._websocket)  # cancel-safe (a queue)
                except TimeoutError:
                    raise ProtocolViolation(
                        f"no reserve-snapshot or start-subscription within {timeout_s:g} s"
                    ) from None
            if data is None:
                return
            if not isinstance(data, str):
                raise ProtocolViolation("binary frames are not accepted")
            try:
                value = loads(data)
            except ValueError as e:
                raise ProtocolViolation(f"frame is not valid JSON: {e}") from None
            if isinstance(value, dict) and "ack" in value and "id" not in value:
                try:
                    self._outbound.ack(ack_from_value(value))
                except AckError as e:
                    raise ProtocolViolation(f"error parsing ack: {e}") from None
                continue
            await self._on_client_frame(value)

    async def _on_client_frame(self, value: Any) -> None:
        try:
            envelope = envelope_from_value(value)
        except EnvelopeError as e:
            raise ProtocolViolation(str(e)) from None
        if envelope.id != self._expected_client_id:
            raise ProtocolViolation(
                f"unexpected frame id {envelope.id}: expected {self._expected_client_id}"
            )
        if len(envelope.messages) > MAX_FRAME_MESSAGES:
            raise ProtocolViolation(
                f"a frame carries at most {MAX_FRAME_MESSAGES} messages "
                f"(frame {envelope.id} has {len(envelope.messages)})"
            )
        self._expected_client_id += 1
        for message in envelope.messages:
            await self._on_message(message)
            self._first_message.set()
        await self._outbound.send_raw(ack_frame(envelope.id))

    async def _on_message(self, message: Any) -> None:
        if not isinstance(message, list) or len(message) != 2 or not isinstance(message[1], dict):
            raise ProtocolViolation("a message must be [type, {…}]")
        kind, body = message
        if kind == "reserve-snapshot":
            self._reserve(body)
        elif kind == "start-subscription":
            self._start_subscription(body)
        else:
            raise ProtocolViolation(f"unknown message type {kind!r}")

    def _reserve(self, body: dict[str, Any]) -> None:
        if self._downstream is not None:
            raise ProtocolViolation("reserve-snapshot after start-subscription")
        task_id = _client_id(body, "taskID", "reserve-snapshot")
        held = self._reservation
        if held is not None and held.task_id != task_id:
            raise ProtocolViolation(
                f"reserve-snapshot of task {task_id}: this socket holds the reservation "
                f"of task {held.task_id} (one reservation per socket)"
            )
        self._log_fields["task"] = task_id
        try:
            reservation = self._get_service().start_snapshot_reservation(task_id)
        except BackupsNotConfiguredError:
            raise ProtocolViolation(
                "replication-manager is not configured with a ZERO_LITESTREAM_BACKUP_URL"
            ) from None
        except TooManyReservations as e:
            raise ProtocolViolation(str(e)) from None
        if self._relay is not None:
            self._relay.cancel()
        self._reservation = reservation  # the service cancels the one it replaces
        self._relay = asyncio.create_task(self._send_reserved(reservation))

    async def _send_reserved(self, reservation: Reservation) -> None:
        async for message in reservation:
            status = loads(message)[1]
            reserved = {**status, "tag": "snapshot"}
            await self._outbound.send([dumps(["reserved", reserved])], None)
        # Ended while this socket still holds it, not by this socket: another
        # connection reserved the same task (cancelled) or subscribed as it
        # (completed), or it reached its time limit.
        ended_elsewhere = (
            reservation is self._reservation and self._downstream is None and not self._ending
        )
        if ended_elsewhere:
            how = "completed by a subscription" if reservation.outcome == "completed" else "ended"
            self._end_reason = (
                f"the reservation of task {reservation.task_id} was {how} on another "
                "connection; reserve again"
            )
            log.info("%s", self._end_reason)
            self._server_ended.set()

    def _start_subscription(self, body: dict[str, Any]) -> None:
        if self._downstream is not None:
            raise ProtocolViolation("start-subscription was already received")
        where = "start-subscription"
        ctx = SubscriberContext(
            protocol_version=PROTOCOL_VERSION,
            id=_client_id(body, "id", where),
            mode="backup" if body.get("mode") == "backup" else "serving",
            replica_version=_watermark(body, "replicaVersion", where),
            watermark=_watermark(body, "watermark", where),
            task_id=_client_id(body, "taskID", where),
        )
        self._log_fields.clear()  # in place, and in the order /changes lines have
        self._log_fields.update(ctx.log_fields())
        # Registering the subscriber closes this task's reservation: the
        # subscriber's own position protects the log from then on, so no gap.
        # This socket's place under the limit becomes the subscriber's own.
        if self._slot is not None:
            self._slot.release()
        try:
            self._downstream = self._get_service().subscribe(ctx)
        except TooManySubscribers as e:
            raise ProtocolViolation(str(e)) from None
        self._downstream.on_close(self._server_ended.set)
        self._subscribed.set()


def _string(body: dict[str, Any], key: str, where: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise ProtocolViolation(f"{where}: missing {key}")
    return value


def _client_id(body: dict[str, Any], key: str, where: str) -> str:
    value = _string(body, key, where)
    problem = id_problem(value, key)
    if problem is not None:
        raise ProtocolViolation(f"{where}: {problem}")
    return value


def _watermark(body: dict[str, Any], key: str, where: str) -> str:
    value = _string(body, key, where)
    try:
        parse_state_version(value)
    except InvalidWatermarkError as e:
        raise ProtocolViolation(f"{where}: {key}: {e}") from None
    return value
