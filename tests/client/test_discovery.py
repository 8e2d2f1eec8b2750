"""discover(): the change-streamer's address from a migrated SQLite change DB."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.client import DiscoveryError, NoChangeStreamerError, discover
from app.client.discovery import address_to_url
from app.storage import (
    Shard,
    create_change_db,
    parse_change_db_url,
)
from tests.change_dbs import migrated


async def change_db(path: Path, shard: Shard, address: str | None) -> str:
    db = create_change_db(parse_change_db_url(str(path)), shard)
    try:
        if address is None:
            await migrated(db)
        else:
            await migrated(db, owner="task-1", address=address)
    finally:
        await db.dispose()
    return str(path)


async def test_a_bare_address_becomes_a_ws_url(tmp_path: Path) -> None:
    url = await change_db(tmp_path / "cdc.db", Shard(), "127.0.0.1:4849")
    assert await discover(url, Shard()) == "ws://127.0.0.1:4849"


async def test_an_address_with_a_scheme_is_used_as_is(tmp_path: Path) -> None:
    shard = Shard("myapp", 2)
    url = await change_db(tmp_path / "cdc.db", shard, "wss://10.0.0.7:4849")
    assert await discover(f"sqlite:///{url}", shard) == "wss://10.0.0.7:4849"


async def test_no_owner_address_means_no_change_streamer(tmp_path: Path) -> None:
    url = await change_db(tmp_path / "cdc.db", Shard(), None)
    with pytest.raises(NoChangeStreamerError, match="no change-streamer is running"):
        await discover(url, Shard())


async def test_a_missing_database_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "cdc.db"
    with pytest.raises(DiscoveryError, match="does not exist"):
        await discover(str(path), Shard())
    assert not path.parent.exists()


async def test_an_unmigrated_database_is_a_discovery_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    with pytest.raises(DiscoveryError, match="cannot read replicationState") as e:
        await discover(str(path), Shard())
    assert not isinstance(e.value, NoChangeStreamerError)


def test_address_to_url() -> None:
    assert address_to_url("h:1") == "ws://h:1"
    assert address_to_url("http://h:1") == "http://h:1"
