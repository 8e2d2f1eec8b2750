"""A ``/replication/v{N}/changes`` subscription (wire.md §2.3).

A :class:`Subscription` is an async iterator of parsed downstream messages:
:class:`~app.protocol.subscription_messages.DownstreamStatus`,
:class:`~app.protocol.messages.Begin`, :class:`~app.protocol.messages.Data`,
:class:`~app.protocol.messages.Commit` and :class:`~app.protocol.messages.Rollback`
(the frozen dataclasses of :mod:`app.protocol`; ``msg.kind`` tells them apart
and ``msg.as_list()`` gives the wire tuple back).

Acks follow zero's replicator: message *N* is acked when the caller asks for
message *N+1*, i.e. after it has processed *N*. The server's acked watermark
(purge safety) therefore never runs ahead of what the caller applied. Closing
the subscription does not ack the message the caller last received: the
server forgets the subscriber on disconnect, so that ack would change nothing.

The same class serves protocol v7 (:mod:`app.client.v7`): there the messages
come from a :class:`~app.client.v7.V7Connection`, which flattens batch frames
and acks a frame once every message of it was consumed — the same rule.

How the iteration ends:

* an in-band ``error`` message is acked (the server waits for that ack before
  closing), then raised as a :class:`~app.client.errors.ChangeStreamerError`
  subclass;
* close 1002 raises :class:`~app.client.errors.ProtocolError`;
* a clean close (1000, 1001, 1005) ends the iteration (``StopAsyncIteration``);
* any other end raises :class:`~app.client.errors.ConnectionLostError`
  (including a liveness timeout and an unparsable message).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Protocol, Self

from app.client.channel import Channel, ChannelEnded
from app.client.errors import InvalidMessageError, error_from_message
from app.protocol.messages import Begin, Commit, Data, MessageValidationError, Rollback
from app.protocol.subscription_messages import (
    DownstreamError,
    DownstreamStatus,
    parse_downstream_message,
)

__all__ = ["MessageSource", "Mode", "Subscription", "SubscriptionContext", "SubscriptionMessage"]

Mode = Literal["serving", "backup"]

SubscriptionMessage = DownstreamStatus | Begin | Data | Commit | Rollback


@dataclass(frozen=True, slots=True)
class SubscriptionContext:
    """Who subscribes and from where.

    ``watermark`` is the last commit watermark the subscriber applied; the
    stream starts strictly after it. It must equal a stored commit watermark or
    ``replica_version`` (otherwise the server answers WatermarkTooOld).
    ``initial`` tells the server the subscriber has not applied anything since
    it started (with ``task_id`` it also ends that task's snapshot reservation).
    """

    id: str
    replica_version: str
    watermark: str
    mode: Mode = "serving"
    task_id: str | None = None
    initial: bool = False

    def query(self) -> dict[str, str]:
        """The query parameters, in the order zero's client sends them."""
        return {
            "taskID": self.task_id or "",
            "id": self.id,
            "mode": self.mode,
            "watermark": self.watermark,
            "replicaVersion": self.replica_version,
            "initial": "true" if self.initial else "false",
        }


class MessageSource(Protocol):
    """Where a :class:`Subscription` reads its messages from.

    ``next_message`` returns the next decoded message and first acks whatever
    the caller has finished with (the framing's rule); it raises
    :class:`~app.client.channel.ChannelEnded` once the socket is gone.
    ``ack_received`` acks the frame of the last returned message right away.
    """

    @property
    def url(self) -> str: ...

    async def next_message(self) -> Any: ...

    async def next_messages(self, limit: int) -> list[Any]:
        """``next_message`` for what has arrived: at least one message, at most ``limit``."""
        ...

    async def ack_received(self) -> None: ...

    async def close(self) -> None: ...


class _ChannelMessages:
    """A v6 channel as a :class:`MessageSource`: one message per frame."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._pending_ack: int | None = None

    @property
    def url(self) -> str:
        return self._channel.url

    async def next_message(self) -> Any:
        # The caller is done with the previous message: that is its ack.
        await self.ack_received()
        envelope = await self._channel.receive()
        self._pending_ack = envelope.id
        return envelope.messages[0]

    async def next_messages(self, limit: int) -> list[Any]:
        # v6 frames carry one message each and are acked one by one.
        return [await self.next_message()]

    async def ack_received(self) -> None:
        if self._pending_ack is not None:
            pending, self._pending_ack = self._pending_ack, None
            await self._channel.ack(pending)

    async def close(self) -> None:
        self._pending_ack = None  # closing is not an ack (see the module docstring)
        await self._channel.close()


class Subscription:
    """The messages of one subscription connection; see the module docstring."""

    def __init__(self, source: Channel | MessageSource, ctx: SubscriptionContext) -> None:
        self.ctx = ctx
        self._source: MessageSource = (
            _ChannelMessages(source) if isinstance(source, Channel) else source
        )
        self._done = False
        self._held: list[Any] = []  # received, not handed out: an error after good messages

    @property
    def url(self) -> str:
        return self._source.url

    @property
    def closed(self) -> bool:
        """True once the iteration ended or :meth:`close` was called."""
        return self._done

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SubscriptionMessage:
        return (await self._next(1))[0]

    async def batches(self, limit: int = 1000) -> AsyncIterator[list[SubscriptionMessage]]:
        """The messages in lists of what has arrived (at most ``limit``): for a caller
        that handles many at once. The same ack rule, per list: a list is acked when
        the next one is asked for. Ends like the iteration."""
        while True:
            try:
                yield await self._next(limit)
            except StopAsyncIteration:
                return

    async def _next(self, limit: int) -> list[SubscriptionMessage]:
        """The next messages (at least one); raises ``StopAsyncIteration`` at the end."""
        raws, self._held = self._held, []
        if not raws:
            if self._done:
                raise StopAsyncIteration
            try:
                raws = await self._source.next_messages(limit)
            except ChannelEnded as ended:
                closed_by_caller = self._done  # close() ran while we were waiting
                await self._finish()
                if ended.error is None or closed_by_caller:
                    raise StopAsyncIteration from None
                raise ended.error from None
        messages: list[SubscriptionMessage] = []
        for i, raw in enumerate(raws):
            try:
                message = parse_downstream_message(raw)
            except MessageValidationError as e:
                if messages:  # hand out what came before it first
                    self._held = raws[i:]
                    return messages
                await self._finish()
                raise InvalidMessageError(f"invalid message from the server: {e}") from e
            if isinstance(message, DownstreamError):
                if messages:
                    self._held = raws[i:]
                    return messages
                # The server waits for this ack before it closes.
                await self._source.ack_received()
                await self._finish()
                raise error_from_message(message)
            messages.append(message)
        return messages

    async def close(self) -> None:
        """Closes the connection (idempotent); the iteration then ends cleanly."""
        await self._finish()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _finish(self) -> None:
        self._done = True
        with contextlib.suppress(Exception):
            await self._source.close()
