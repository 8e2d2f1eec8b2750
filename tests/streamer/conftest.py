"""Streamer fixtures: a real, migrated SQLite change DB owned by "owner"."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.storage import (
    ChangeDb,
    Shard,
    create_change_db,
    parse_change_db_url,
)
from tests.change_dbs import migrated

REPLICA_VERSION = "01"
OWNER = "owner"


@pytest.fixture
async def change_db(tmp_path: Path) -> AsyncIterator[ChangeDb]:
    db = create_change_db(parse_change_db_url(str(tmp_path / "cdc.db")), Shard())
    await migrated(
        db, replica_version=REPLICA_VERSION, publications=("pub",), auto_reset=True, owner=OWNER
    )
    try:
        yield db
    finally:
        await db.dispose()
