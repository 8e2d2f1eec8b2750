"""Streamer fixtures: a real, migrated SQLite change DB owned by "owner"."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.storage import (
    ChangeDb,
    Replication,
    Shard,
    SubscriptionState,
    create_change_db,
    migrate,
    parse_change_db_url,
)

REPLICA_VERSION = "01"
OWNER = "owner"


@pytest.fixture
async def change_db(tmp_path: Path) -> AsyncIterator[ChangeDb]:
    db = create_change_db(parse_change_db_url(str(tmp_path / "cdc.db")), Shard())
    await migrate(db)
    replication = Replication(db)
    await replication.ensure_config(
        SubscriptionState(REPLICA_VERSION, ("pub",), REPLICA_VERSION), auto_reset=True
    )
    await replication.assume_ownership(OWNER, "127.0.0.1:4849")
    try:
        yield db
    finally:
        await db.dispose()
