"""Snapshot reservations: ``/replication/v{N}/snapshot?taskID=…`` (wire.md §2.4, §3).

A view-syncer about to restore a backup reserves a snapshot: the server answers
with exactly one ``status`` (where the backup is, which replica version it has,
the oldest watermark the change log can still serve) and keeps the socket open;
while it is open the change log is not purged past the reservation. The
reservation ends when the same task subscribes with ``initial=true`` — the
server then closes the reservation socket — or when the client goes away.

:meth:`ChangeStreamerClient.reserve_snapshot` returns the status and a
:class:`ReservationFollowup` (the shape of zero's newer client API,
wire.md §5.1) that holds the socket open:

* ``await followup.subscribe(ctx)`` subscribes on ``/changes`` with
  ``initial=true&taskID=<task>``, which ends the reservation;
* ``await followup.cancel()`` closes the reservation socket without subscribing;
* ``followup.closed`` (an :class:`asyncio.Event`) is set once the reservation
  socket is gone, for whatever reason; ``followup.aborted`` is True if that
  happened before ``subscribe()``/``cancel()`` — the reservation no longer
  protects the log and the caller should start over with a new reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from app.client.channel import Channel, ChannelEnded
from app.client.errors import ClientError, ConnectionLostError, InvalidMessageError
from app.client.subscription import Subscription, SubscriptionContext
from app.protocol.messages import MessageValidationError
from app.protocol.subscription_messages import DownstreamStatus, parse_downstream_message

__all__ = [
    "ReservationFollowup",
    "SnapshotFollowup",
    "SnapshotStatus",
    "receive_snapshot_status",
    "snapshot_status_from_body",
]

log = logging.getLogger(__name__)

Subscribe = Callable[[SubscriptionContext], Awaitable[Subscription]]


@dataclass(frozen=True, slots=True)
class SnapshotStatus:
    """The reservation's one status message (``body`` keeps any extra fields)."""

    backup_url: str
    replica_version: str
    min_watermark: str
    body: dict[str, Any]


def snapshot_status_from_body(body: Any, what: str = "snapshot status") -> SnapshotStatus:
    """A :class:`SnapshotStatus` from a status body (v6 ``status``, v7 ``reserved``)."""
    if not isinstance(body, dict):
        raise InvalidMessageError(f"{what}: the body must be an object")
    fields = {}
    for key in ("backupURL", "replicaVersion", "minWatermark"):
        value = body.get(key)
        if not isinstance(value, str):
            raise InvalidMessageError(f"{what}: field {key!r} must be a string")
        fields[key] = value
    return SnapshotStatus(
        backup_url=fields["backupURL"],
        replica_version=fields["replicaVersion"],
        min_watermark=fields["minWatermark"],
        body=body,
    )


def _snapshot_status(message: object) -> SnapshotStatus:
    if not isinstance(message, DownstreamStatus):
        kind = getattr(message, "kind", type(message).__name__)
        raise InvalidMessageError(f"expected a snapshot status message, got {kind!r}")
    return snapshot_status_from_body(message.body)


async def receive_snapshot_status(channel: Channel) -> SnapshotStatus:
    """Waits for the status, acks it and returns it; closes the channel on failure."""
    try:
        envelope = await channel.receive()
    except ChannelEnded as ended:
        await channel.close()
        raise ended.error or ConnectionLostError(
            "the reservation was closed before a status was received"
        ) from None
    try:
        try:
            message = parse_downstream_message(envelope.messages[0])
        except MessageValidationError as e:
            raise InvalidMessageError(f"invalid message from the server: {e}") from e
        status = _snapshot_status(message)
    except ClientError:
        await channel.close()
        raise
    await channel.ack(envelope.id)
    return status


class SnapshotFollowup(Protocol):
    """What :meth:`ChangeStreamerClient.reserve_snapshot` returns with the status.

    :class:`ReservationFollowup` (v6) and
    :class:`~app.client.v7.V7ReservationFollowup` (v7) both have this shape.
    """

    task_id: str
    closed: asyncio.Event
    close_error: ClientError | None

    @property
    def aborted(self) -> bool: ...

    async def subscribe(self, ctx: SubscriptionContext) -> Subscription: ...

    async def cancel(self) -> None: ...

    async def wait_closed(self) -> None: ...


class ReservationFollowup:
    """Holds the reservation socket open until ``subscribe`` or ``cancel``."""

    def __init__(self, channel: Channel, task_id: str, subscribe: Subscribe) -> None:
        self.task_id = task_id
        self.closed = asyncio.Event()
        self.close_error: ClientError | None = None  # why the socket ended, if abnormally
        self._channel = channel
        self._subscribe = subscribe
        self._settled = False  # subscribe() or cancel() was called
        self._aborted = False
        self._reader = asyncio.create_task(self._hold(), name=f"reservation {task_id}")

    @property
    def aborted(self) -> bool:
        """True if the socket died before ``subscribe()``/``cancel()``: the reservation is lost."""
        return self._aborted

    async def subscribe(self, ctx: SubscriptionContext) -> Subscription:
        """Subscribes as this task with ``initial=true``, which ends the reservation.

        ``ctx.task_id`` and ``ctx.initial`` are overridden. The reservation
        socket then closes (the server ends it); ``closed`` is set.
        """
        self._settled = True
        return await self._subscribe(dataclasses.replace(ctx, task_id=self.task_id, initial=True))

    async def cancel(self) -> None:
        """Abandons the reservation: closes its socket (idempotent)."""
        self._settled = True
        await self._channel.close()
        await self.wait_closed()

    async def wait_closed(self) -> None:
        """Returns once the reservation socket is gone."""
        await self.closed.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def _hold(self) -> None:
        try:
            while True:
                envelope = await self._channel.receive()
                # Only one status is ever sent; ack anything else to keep the
                # server's ack sequence intact, and otherwise ignore it.
                await self._channel.ack(envelope.id)
        except ChannelEnded as ended:
            self.close_error = ended.error
        finally:
            if not self._settled:
                self._aborted = True
                log.warning(
                    "snapshot reservation for %s ended before the subscription: %s",
                    self.task_id,
                    self.close_error or "closed by the server",
                )
            with contextlib.suppress(Exception):
                await self._channel.close()
            self.closed.set()
