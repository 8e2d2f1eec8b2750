"""A standalone replicator: keeps a replica file in step with a change-streamer.

:func:`run_replicator` is zero's incremental syncer in small: read the replica's
replicaVersion and stateVersion, subscribe from there over the websocket client, apply
what arrives (:class:`~app.replica.replicator.Replicator`), and after a lost connection
subscribe again from the replica's new position, waiting per
:class:`~app.backoff.Backoff` (25 ms doubling to 10 s, reset after a session
that committed something). It returns when ``stop`` is set.

What ends it with an error instead of a retry:

* ``WrongReplicaVersion`` or ``WatermarkTooOld`` from the server →
  :class:`~app.replica.errors.ResyncRequiredError`: the change-streamer cannot serve
  this replica any more; it has to be synced anew (or restored from a newer backup);
* a change the writer cannot apply → :class:`~app.replica.errors.ReplicaError`
  (retrying would meet the same change);
* an upgrade refused with 401 or 403 → :class:`~app.client.UnauthorizedError` as it
  came (the replication password is missing or wrong: a setting to fix, and every
  retry would get the same answer).

Other in-band errors (a subscriber dropped for lagging) and every connection failure
are retried, as are 1002 closes (zero's replicator retries those too).

A replica just restored from a backup under a snapshot reservation passes the
reservation's followup: the first subscription goes through it (as the reserving
task, ``initial=true``, on the reservation's own socket in v7), which ends the
reservation; later ones are ordinary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

from app.backoff import Backoff
from app.client import (
    ChangeStreamerClient,
    ChangeStreamerError,
    ClientError,
    SnapshotFollowup,
    Subscription,
    SubscriptionContext,
    UnauthorizedError,
    WatermarkTooOldError,
    WrongReplicaVersionError,
)
from app.replica.errors import ResyncRequiredError
from app.replica.replicator import Replicator
from app.replica.writer import CommitResult
from app.timeouts import within

__all__ = ["run_replicator"]

log = logging.getLogger(__name__)

Subscribe = Callable[[SubscriptionContext], Awaitable[Subscription]]


async def run_replicator(
    url: str,
    replica_file: str | Path,
    *,
    subscriber_id: str,
    mode: Literal["serving", "backup"] = "serving",
    stop: asyncio.Event,
    task_id: str | None = None,
    backoff: Backoff | None = None,
    on_commit: Callable[[CommitResult], None] | None = None,
    client: ChangeStreamerClient | None = None,
    reservation: SnapshotFollowup | None = None,
    subscribe: Subscribe | None = None,
) -> None:
    """Replicates into ``replica_file`` until ``stop`` is set (see the module docstring).

    ``subscribe`` opens each session (default ``client.subscribe``): a discovering
    one follows the change log to whichever node owns it."""
    client = client or ChangeStreamerClient(url)
    open_session: Subscribe = subscribe or client.subscribe
    delays = backoff or Backoff()
    try:
        async with Replicator(replica_file, mode=mode, on_commit=on_commit) as replicator:
            initial_watermark = replicator.watermark
            while not stop.is_set():
                ctx = SubscriptionContext(
                    id=subscriber_id,
                    replica_version=replicator.replica_version,
                    watermark=replicator.watermark,
                    mode=mode,
                    task_id=task_id,
                    initial=replicator.watermark == initial_watermark,
                )
                this_session = open_session
                if reservation is not None:
                    this_session, reservation = reservation.subscribe, None
                session = asyncio.create_task(_session(this_session, ctx, replicator))
                try:
                    commits = await _unless_stopped(session, stop)
                except (WrongReplicaVersionError, WatermarkTooOldError) as e:
                    raise ResyncRequiredError(
                        f"replica {replica_file} (version {ctx.replica_version}, at "
                        f"{ctx.watermark}) must be re-synced: {e}"
                    ) from e
                except UnauthorizedError:
                    raise
                except ChangeStreamerError as e:
                    log.warning("change-streamer error, resubscribing: %s", e)
                    commits = 0
                except ClientError as e:
                    log.info("replication connection ended (%s); resubscribing", e)
                    commits = 0
                if commits is None:  # stopped
                    return
                if commits:
                    delays.reset()
                with contextlib.suppress(TimeoutError):
                    await within(stop.wait(), delays.next_delay())
    finally:
        if reservation is not None:  # never used: the replica could not be opened
            await reservation.cancel()


async def _session(subscribe: Subscribe, ctx: SubscriptionContext, replicator: Replicator) -> int:
    subscription = await subscribe(ctx)
    async with subscription:
        return await replicator.consume(subscription.batches())


async def _unless_stopped(session: asyncio.Task[int], stop: asyncio.Event) -> int | None:
    """The session's result, or None if ``stop`` was set first (the session is cancelled)."""
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({session, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not session.done():
            session.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await session
    if session.cancelled():
        return None
    return session.result()
