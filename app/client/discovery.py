"""Finding the change-streamer through the change DB (wire.md §0, discover mode).

The change-streamer that owns a shard's change log writes its address to
``replicationState.ownerAddress`` when it takes ownership. A value with
``://`` is a complete URI; a bare ``host:port`` means ``ws://host:port``.

:func:`discovering` is a ``connect`` for :class:`~app.client.resume.ResumingSubscription`
that looks the owner up again for every connection, as zero's view-syncers do in
discover mode: a subscription follows the change log from node to node across
handoffs (a retired node refuses the upgrade, so the next attempt finds the new
owner).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.exc import SQLAlchemyError

from app.client.errors import ConnectFailedError, DiscoveryError, NoChangeStreamerError
from app.storage import ChangeDbConfigError, Replication, Shard, create_change_db
from app.storage import parse_change_db_url as _parse_url

if TYPE_CHECKING:
    from app.client.client import ChangeStreamerClient
    from app.client.subscription import Subscription, SubscriptionContext

__all__ = ["address_to_url", "discover", "discovering"]


def address_to_url(address: str) -> str:
    """``ownerAddress`` → a base URL for :class:`ChangeStreamerClient`."""
    return address if "://" in address else f"ws://{address}"


async def discover(change_db_url: str, shard: Shard) -> str:
    """The base URL of the change-streamer owning ``shard``'s change log.

    Raises :class:`NoChangeStreamerError` when no owner address is recorded
    and :class:`DiscoveryError` when the change DB cannot be read.
    """
    try:
        url = _parse_url(change_db_url)
        is_sqlite = url.get_backend_name() == "sqlite"
        if is_sqlite and not await asyncio.to_thread(Path(url.database or "").is_file):
            # Opening it would create an empty database (and its directory).
            raise DiscoveryError(f"the change DB {url.database} does not exist")
        db = create_change_db(url, shard)
    except ChangeDbConfigError as e:
        raise DiscoveryError(str(e)) from e
    try:
        state = await Replication(db).state()
    except SQLAlchemyError as e:
        raise DiscoveryError(
            f"cannot read replicationState from {db.description}: {type(e).__name__}: "
            f"{getattr(e, 'orig', None) or e}"
        ) from e
    finally:
        await db.dispose()
    if state is None or not state.owner_address:
        raise NoChangeStreamerError("no change-streamer is running")
    return address_to_url(state.owner_address)


def discovering(
    change_db_url: str,
    shard: Shard,
    client: Callable[[str], ChangeStreamerClient],
) -> Callable[[SubscriptionContext], Awaitable[Subscription]]:
    """A ``connect`` that subscribes at whoever owns ``shard``'s change log now.

    ``client`` makes the client for a discovered base URL (its options: password,
    protocol, timeouts). A change DB that cannot be read or names no owner yet is a
    failed connection (:class:`ConnectFailedError`): retried with the subscription's
    backoff, since during a handoff or a restart of the change DB it is brief.
    """

    async def connect(ctx: SubscriptionContext) -> Subscription:
        try:
            url = await discover(change_db_url, shard)
        except DiscoveryError as e:
            raise ConnectFailedError(f"discovery: {e}") from e
        return await client(url).subscribe(ctx)

    return connect
