"""``ChangeStreamerClient``: subscribe to, resume from and reserve on a change-streamer.

The base URL is a change-streamer origin such as ``ws://host:4849`` (``http``
and ``https`` mean ``ws`` and ``wss``); like zero, the client discards its
path and query and talks to ``/replication/v{N}/changes`` and
``/replication/v{N}/snapshot`` at the root. A server with
``CHANGESTREAMER_REPLICATION_PASSWORD`` wants it as Basic auth: give it as
``password`` or as the URL's user info (``ws://:secret@host:4849``); either is sent
as the ``Authorization`` header, as zero-cache's client sends it.

With ``protocol_version=7`` (or above), ``subscribe`` and ``reserve_snapshot``
use the merged ``/replication/v7/subscribe`` socket instead (:mod:`app.client.v7`):
the same calls, the same :class:`Subscription`, but one socket carries the
reservation and then the subscription. :meth:`ChangeStreamerClient.connect`
opens such a socket directly, whatever ``protocol_version`` is. The default is
still v6, which is what zero 1.9.0 speaks.

Usage::

    client = ChangeStreamerClient("ws://127.0.0.1:4849")
    async with await client.subscribe(SubscriptionContext("me", "01", "01")) as sub:
        async for message in sub:
            ...  # message N is acked when the loop asks for N+1
"""

from __future__ import annotations

import re
from typing import Final

from app.client.channel import (
    DEFAULT_LIVENESS_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    Channel,
    ChannelOptions,
)
from app.client.errors import ClientError, WrongReplicaVersionError
from app.client.reservation import (
    ReservationFollowup,
    SnapshotFollowup,
    SnapshotStatus,
    receive_snapshot_status,
)
from app.client.resume import ReconnectPolicy, ResumingSubscription
from app.client.subscription import Subscription, SubscriptionContext
from app.client.urls import BaseURL, parse_base_url
from app.client.v7 import V7Connection, reserve_on, subscribe_on
from app.versions import PROBE_REPLICA_VERSION

__all__ = ["PROBE_REPLICA_VERSION", "SUBSCRIBE_PROTOCOL_VERSION", "ChangeStreamerClient"]

# The first protocol version with the merged /subscribe endpoint.
SUBSCRIBE_PROTOCOL_VERSION: Final = 7

_CURRENT_VERSION = re.compile(r"current replica version is (\S+) \(requested ")


class ChangeStreamerClient:
    """A client of one change-streamer; cheap to create, holds no connection itself."""

    def __init__(
        self,
        base_url: str,
        *,
        protocol_version: int = 6,
        liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
        open_timeout_s: float = 10.0,
        close_timeout_s: float = 5.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        password: str | None = None,
    ) -> None:
        if protocol_version < 1:
            raise ValueError(f"protocol_version must be at least 1, got {protocol_version}")
        self.base: BaseURL = parse_base_url(base_url)
        if password:
            self.base = self.base.with_password(password)
        self.protocol_version = protocol_version
        self.options = ChannelOptions(
            liveness_timeout_s=liveness_timeout_s,
            open_timeout_s=open_timeout_s,
            close_timeout_s=close_timeout_s,
            max_message_bytes=max_message_bytes,
        )

    def changes_url(self, ctx: SubscriptionContext) -> str:
        return self.base.websocket(f"/replication/v{self.protocol_version}/changes", ctx.query())

    def snapshot_url(self, task_id: str) -> str:
        return self.base.websocket(
            f"/replication/v{self.protocol_version}/snapshot", {"taskID": task_id}
        )

    def subscribe_url(self, task_id: str = "") -> str:
        """``/replication/v{N}/subscribe`` with N = ``protocol_version``, at least 7."""
        version = max(self.protocol_version, SUBSCRIBE_PROTOCOL_VERSION)
        query = {"taskID": task_id} if task_id else None
        return self.base.websocket(f"/replication/v{version}/subscribe", query)

    @property
    def uses_subscribe(self) -> bool:
        """True if ``subscribe``/``reserve_snapshot`` use the merged v7 socket."""
        return self.protocol_version >= SUBSCRIBE_PROTOCOL_VERSION

    async def connect(self, task_id: str) -> V7Connection:
        """Opens a ``/subscribe`` socket (protocol v7; see :mod:`app.client.v7`).

        ``task_id`` goes in the query, where it is informational. The messages
        sent on the connection carry the authoritative task ID. Raises
        :class:`~app.client.errors.ConnectFailedError` if the socket cannot be
        opened.
        """
        channel = await Channel.open(self.subscribe_url(task_id), self.options)
        return V7Connection(channel, task_id or None)

    async def subscribe(self, ctx: SubscriptionContext) -> Subscription:
        """Opens one subscription connection (see :mod:`app.client.subscription`).

        v6: ``/changes`` with the context in the query. v7: ``/subscribe``,
        then ``start-subscription`` (taskID ``ctx.task_id``, else ``ctx.id``).
        Raises :class:`~app.client.errors.ConnectFailedError` if the socket
        cannot be opened. Request errors (1002) and in-band errors surface on
        the first ``__anext__``.
        """
        if self.uses_subscribe:
            connection = await self.connect(ctx.task_id or ctx.id)
            return await subscribe_on(connection, ctx)
        channel = await Channel.open(self.changes_url(ctx), self.options)
        return Subscription(channel, ctx)

    def resume(
        self, ctx: SubscriptionContext, policy: ReconnectPolicy | None = None
    ) -> ResumingSubscription:
        """A subscription that reconnects after drops (see :mod:`app.client.resume`)."""
        return ResumingSubscription(self.subscribe, ctx, policy)

    async def reserve_snapshot(self, task_id: str) -> tuple[SnapshotStatus, SnapshotFollowup]:
        """Reserves a snapshot for ``task_id`` (see :mod:`app.client.reservation`).

        Waits for the status, which the server may withhold until it has a
        restorable backup (the liveness check keeps running meanwhile).
        A server without backups closes with 1002 → ``ProtocolError``.

        v6: a ``/snapshot`` socket. The followup is a :class:`ReservationFollowup`
        whose ``subscribe`` opens ``/changes``. v7: ``reserve-snapshot`` on a
        ``/subscribe`` socket, then ``reserved``. The followup is a
        :class:`~app.client.v7.V7ReservationFollowup` whose ``subscribe`` goes
        on over the same socket.
        """
        if not task_id:
            raise ValueError("a snapshot reservation needs a task ID")
        if self.uses_subscribe:
            return await reserve_on(await self.connect(task_id), task_id)
        channel = await Channel.open(self.snapshot_url(task_id), self.options)
        try:
            status = await receive_snapshot_status(channel)
        except BaseException:
            await channel.close()
            raise
        return status, ReservationFollowup(channel, task_id, self.subscribe)

    async def probe_replica_version(self, subscriber_id: str = "probe") -> str:
        """The server's replica version, learned from its WrongReplicaVersion error.

        Subscribes with replica version ``"00"``; the server answers
        ``current replica version is X (requested 00)`` and the probe returns X
        (or ``"00"`` if that happens to be right, when a status arrives instead).
        Uses mode ``serving``, so it ends the server's start-up delay, as any
        serving subscription does.
        """
        ctx = SubscriptionContext(subscriber_id, PROBE_REPLICA_VERSION, PROBE_REPLICA_VERSION)
        async with await self.subscribe(ctx) as subscription:
            try:
                async for _ in subscription:
                    return PROBE_REPLICA_VERSION
            except WrongReplicaVersionError as e:
                match = _CURRENT_VERSION.search(e.message)
                if match is None:
                    raise ClientError(f"cannot read the replica version from {e}") from e
                return match.group(1)
        raise ClientError("the change-streamer closed the probe subscription without a message")
