"""``ChangeStreamerClient``: subscribe to, resume from and reserve on a change-streamer.

The base URL is a change-streamer origin such as ``ws://host:4849`` (``http``
and ``https`` mean ``ws`` and ``wss``); like zero, the client discards its
path and query and talks to ``/replication/v{N}/changes`` and
``/replication/v{N}/snapshot`` at the root. No authentication: the endpoint
has none (wire.md §0).

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
from app.client.reservation import ReservationFollowup, SnapshotStatus, receive_snapshot_status
from app.client.resume import ReconnectPolicy, ResumingSubscription
from app.client.subscription import Subscription, SubscriptionContext
from app.client.urls import BaseURL, parse_base_url

__all__ = ["PROBE_REPLICA_VERSION", "ChangeStreamerClient"]

# A valid LexiVersion ("0"), used as the replica version of a probe subscription.
PROBE_REPLICA_VERSION: Final = "00"

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
    ) -> None:
        if protocol_version < 1:
            raise ValueError(f"protocol_version must be at least 1, got {protocol_version}")
        self.base: BaseURL = parse_base_url(base_url)
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

    async def subscribe(self, ctx: SubscriptionContext) -> Subscription:
        """Opens one subscription connection (see :mod:`app.client.subscription`).

        Raises :class:`~app.client.errors.ConnectFailedError` if the socket
        cannot be opened; request errors (1002) and in-band errors surface on
        the first ``__anext__``.
        """
        channel = await Channel.open(self.changes_url(ctx), self.options)
        return Subscription(channel, ctx)

    def resume(
        self, ctx: SubscriptionContext, policy: ReconnectPolicy | None = None
    ) -> ResumingSubscription:
        """A subscription that reconnects after drops (see :mod:`app.client.resume`)."""
        return ResumingSubscription(self.subscribe, ctx, policy)

    async def reserve_snapshot(self, task_id: str) -> tuple[SnapshotStatus, ReservationFollowup]:
        """Reserves a snapshot for ``task_id`` (see :mod:`app.client.reservation`).

        Waits for the status, which the server may withhold until it has a
        restorable backup (the liveness check keeps running meanwhile).
        A server without backups closes with 1002 → ``ProtocolError``.
        """
        if not task_id:
            raise ValueError("a snapshot reservation needs a task ID")
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
