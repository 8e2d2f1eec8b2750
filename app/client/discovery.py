"""Finding the change-streamer through the change DB (wire.md §0, discover mode).

The change-streamer that owns a shard's change log writes its address to
``replicationState.ownerAddress`` when it takes ownership. A value with
``://`` is a complete URI; a bare ``host:port`` means ``ws://host:port``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from app.client.errors import DiscoveryError, NoChangeStreamerError
from app.storage import ChangeDbConfigError, Replication, Shard, create_change_db
from app.storage import parse_change_db_url as _parse_url

__all__ = ["address_to_url", "discover"]


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
