"""A change DB as ``serve`` leaves it before streaming: migrated, its replication
config written, and (when ``owner`` is given) owned. The one way tests set one up.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.storage import ChangeDb, Replication, SubscriptionState, migrate

__all__ = ["migrated"]


async def migrated(
    db: ChangeDb,
    *,
    replica_version: str = "01",
    publications: Sequence[str] = (),
    auto_reset: bool = False,
    owner: str | None = None,
    address: str = "127.0.0.1:4849",
) -> ChangeDb:
    """``db`` migrated and configured for a replica at ``replica_version`` (its state
    version too); owned by ``owner`` at ``address`` if given. Returns ``db``."""
    await migrate(db)
    replication = Replication(db)
    await replication.ensure_config(
        SubscriptionState(replica_version, tuple(publications), replica_version),
        auto_reset=auto_reset,
    )
    if owner is not None:
        await replication.assume_ownership(owner, address)
    return db
