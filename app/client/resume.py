"""A subscription that survives dropped connections (what zero's replicator does).

:class:`ResumingSubscription` yields the same messages as
:class:`~app.client.subscription.Subscription` but reconnects when a
connection ends — cleanly (the server closed the stream) or not — with
exponential backoff: 25 ms, doubling, at most 10 s between attempts.

Position. Each reconnect subscribes from the watermark of the last ``commit``
the caller consumed (asked past), so nothing is skipped. ``initial`` stays as
given only while that watermark has not moved, as zero's client does.

Unfinished transactions. If a connection drops between a ``begin`` and its
``commit``, the caller gets a synthetic ``Rollback`` (body
``{"tag":"rollback"}``, the same message the server sends when its upstream
breaks mid-transaction) and the transaction is then streamed again, in full,
on the next connection. Consumers therefore handle a drop with the code they
already have for rollbacks.

No duplicates. A transaction whose commit watermark is not greater than the
last consumed commit is dropped whole (zero's server never resends one, but a
different server might), so a commit is never yielded twice. A ``status`` is
yielded at the start of every connection.

Not retried: in-band errors (``ChangeStreamerError``: wrong replica version,
watermark too old, too far behind) and refused upgrades (``UnauthorizedError``:
401, a missing or wrong replication password; 403) — retrying would get the same
answer — and, unless ``retry_protocol_errors`` is set, 1002 closes (the request
is invalid).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from app.client.errors import (
    ClientError,
    ConnectionLostError,
    ProtocolError,
    UnauthorizedError,
)
from app.client.subscription import Subscription, SubscriptionContext, SubscriptionMessage
from app.protocol.messages import Begin, Commit, Rollback

__all__ = ["ReconnectPolicy", "ResumingSubscription", "backoff_delays"]

log = logging.getLogger(__name__)

Connect = Callable[[SubscriptionContext], Awaitable[Subscription]]


@dataclass(frozen=True, slots=True)
class ReconnectPolicy:
    """When to reconnect and when to give up.

    ``max_attempts`` bounds the *consecutive* unsuccessful attempts (a
    connection that could not be opened, or that ended before delivering a
    single message); ``max_elapsed_s`` bounds the time since the first of them.
    ``None`` means unbounded (zero's replicator retries forever). Both counters
    reset whenever a connection delivers a message.
    """

    initial_delay_s: float = 0.025
    max_delay_s: float = 10.0
    max_attempts: int | None = None
    max_elapsed_s: float | None = None
    retry_protocol_errors: bool = False


def backoff_delays(policy: ReconnectPolicy) -> Callable[[int], float]:
    """The delay before the n-th consecutive retry (n ≥ 1)."""

    def delay(n: int) -> float:
        return min(policy.initial_delay_s * 2.0 ** (n - 1), policy.max_delay_s)

    return delay


_SYNTHETIC_ROLLBACK = Rollback({"tag": "rollback"})


class ResumingSubscription:
    """See the module docstring. Connects lazily, on the first ``__anext__``."""

    def __init__(
        self, connect: Connect, ctx: SubscriptionContext, policy: ReconnectPolicy | None = None
    ) -> None:
        self._connect = connect
        self._ctx = ctx
        self._policy = policy or ReconnectPolicy()
        self._delay = backoff_delays(self._policy)
        self._current: Subscription | None = None
        self._watermark = ctx.watermark  # last commit the caller consumed
        self._in_transaction: str | None = None  # commit watermark of the open one
        self._skipping = False  # dropping a transaction that was already yielded
        self._failures = 0
        self._failing_since: float | None = None
        self._progress = False  # the current connection delivered a message
        self._closed = False
        self.connections = 0  # connections opened so far

    @property
    def watermark(self) -> str:
        """The last commit watermark consumed; where a reconnect resumes from."""
        return self._watermark

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SubscriptionMessage:
        while True:
            if self._closed:
                raise StopAsyncIteration
            if self._current is None:
                self._current = await self._reconnect()
            try:
                message = await self._current.__anext__()
            except StopAsyncIteration:
                if self._closed:
                    raise
                await self._dropped(ConnectionLostError("connection closed by the server"))
            except (ConnectionLostError, ProtocolError) as e:
                if isinstance(e, ProtocolError) and not self._policy.retry_protocol_errors:
                    await self.close()
                    raise
                await self._dropped(e)
            except ClientError:  # an in-band error: final
                await self.close()
                raise
            else:
                if not self._progress:
                    self._progress = True
                    self._failures = 0
                    self._failing_since = None
                if self._accept(message):
                    return message
                continue
            if self._in_transaction is not None:
                self._in_transaction = None
                return _SYNTHETIC_ROLLBACK

    async def close(self) -> None:
        """Closes the current connection (idempotent); the iteration ends cleanly."""
        self._closed = True
        current, self._current = self._current, None
        if current is not None:
            await current.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------

    def _accept(self, message: SubscriptionMessage) -> bool:
        """Tracks transactions; False for messages of an already-yielded one."""
        if isinstance(message, Begin):
            self._skipping = message.commit_watermark <= self._watermark
            if self._skipping:
                log.info("dropping transaction %s: already consumed", message.commit_watermark)
                return False
            self._in_transaction = message.commit_watermark
            return True
        if self._skipping:
            if isinstance(message, (Commit, Rollback)):
                self._skipping = False
            return False
        if isinstance(message, Commit):
            self._watermark = message.watermark
            self._in_transaction = None
        elif isinstance(message, Rollback):
            self._in_transaction = None
        return True

    async def _dropped(self, error: ClientError) -> None:
        """Forgets the ended connection; raises ``error`` if it is time to give up."""
        self._current = None
        self._skipping = False
        progress, self._progress = self._progress, False
        log.info("subscription dropped (%s); resuming after %s", error, self._watermark)
        if not progress and self._give_up_after_failure():
            await self.close()
            raise error

    def _give_up_after_failure(self) -> bool:
        """Counts an unsuccessful attempt; True once the policy's bounds are reached."""
        self._failures += 1
        now = asyncio.get_running_loop().time()
        if self._failing_since is None:
            self._failing_since = now
        policy = self._policy
        if policy.max_attempts is not None and self._failures >= policy.max_attempts:
            return True
        return (
            policy.max_elapsed_s is not None and now - self._failing_since >= policy.max_elapsed_s
        )

    async def _reconnect(self) -> Subscription:
        ctx = dataclasses.replace(
            self._ctx,
            watermark=self._watermark,
            initial=self._ctx.initial and self._watermark == self._ctx.watermark,
        )
        while True:
            if self.connections > 0 or self._failures > 0:
                await asyncio.sleep(self._delay(max(self._failures, 1)))
            try:
                subscription = await self._connect(ctx)
            except UnauthorizedError:  # a setting to fix: the same answer every time
                self._closed = True
                raise
            except ConnectionLostError as e:  # includes ConnectFailedError
                log.info("cannot subscribe (%s)", e)
                if self._give_up_after_failure():
                    self._closed = True
                    raise
                continue
            self.connections += 1
            if self._closed:  # close() ran while connecting
                await subscription.close()
                raise StopAsyncIteration
            return subscription
