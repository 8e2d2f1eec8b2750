"""The custom initial sync (spec/source.md §4.2) from a real websocket source into a
real SQLite file."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from app.replica.schema import read_replica_state
from app.sources.base import ChangeSourceError
from app.sources.custom import CustomChangeSource
from app.sources.custom_sync import CustomSyncError, custom_initial_sync
from app.stop_signals import AutoResetSignal
from tests.sources.custom_upstream import (
    CLOSE,
    Frame,
    create_table,
    custom_upstream,
    initial_sync,
    issue,
    required_tables,
    transaction,
)

APP = "app"


def source(url: str, publications: list[str] | None = None) -> CustomChangeSource:
    return CustomChangeSource(
        url,
        app_id=APP,
        shard_num=0,
        publications=publications or [],
        replica_version=None,
        connect_timeout_s=5,
    )


async def sync(initial: list[Frame], replica: Path, **kwargs: Any) -> Any:
    async with custom_upstream([initial]) as up:
        state = await custom_initial_sync(
            source(up.url, kwargs.get("publications")),
            replica,
            app_id=APP,
            shard_num=0,
            publications=kwargs.get("publications", []),
        )
    return state, up


def rows(path: Path, query: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(query).fetchall()


async def test_the_first_transaction_becomes_the_replica(tmp_path: Path) -> None:
    replica = tmp_path / "replica.db"
    status = ["status", {"ack": False}, {"watermark": "01"}]  # ignored
    frames = initial_sync(APP, "0k")
    state, up = await sync(
        [status, *frames[:3], status, *frames[3:]], replica, publications=["a", "b"]
    )
    assert (state.replica_version, state.state_version) == ("0k", "0k")
    assert state.publications == ("a", "b")
    assert read_replica_state(replica) == state
    assert rows(replica, 'SELECT id, title, "_0_version" FROM issues ORDER BY id') == [
        (1, "issue 1", "0k"),
        (2, "issue 2", "0k"),
        (3, "issue 3", "0k"),
    ]
    # No history for view-syncers to replay: the replica starts here.
    assert rows(replica, 'SELECT count(*) FROM "_zero.changeLog2"') == [(0,)]
    assert not (tmp_path / "replica.db.syncing").exists()
    # Opened without a position; nothing is acked for the initial transaction.
    (query,) = up.connections
    assert "lastWatermark" not in query
    assert "replicaVersion" not in query
    assert (query["appID"], query["shardNum"], query["publications"]) == (
        [APP],
        ["0"],
        ["a", "b"],
    )
    assert up.acks == []


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        (
            [["rollback", {"tag": "rollback"}]],
            r"unexpected message during the initial sync .*\["
            r'"rollback",\{"tag":"rollback"\}\]',
        ),
        (
            [*transaction("0a")[:-1], ["rollback", {"tag": "rollback"}]],
            "unexpected message during the initial sync",
        ),
        ([["data", issue(1, "x")]], "unexpected message during the initial sync"),
        ([*transaction("0a")[:-1], CLOSE], "ended the stream before the initial sync's commit"),
        (
            transaction("0a", *required_tables(APP)[:4]),  # clients and mutations only
            r'the "app.permissions" table is missing \(syncable tables found: '
            r"app_0.clients, app_0.mutations\)",
        ),
        (
            transaction("0a", *create_table("public", "t", {"id": "int4"}, ["id"]), issue(1, "x")),
            "cannot apply the initial sync: unknown table 'issues'",
        ),
    ],
)
async def test_anything_but_one_complete_transaction_fails(
    tmp_path: Path, frames: list[Frame], error: str
) -> None:
    replica = tmp_path / "replica.db"
    with pytest.raises(CustomSyncError, match=error):
        await sync(frames, replica)
    assert list(tmp_path.iterdir()) == []  # no replica, no staging file


async def test_a_broken_watermark_rule_fails_the_sync(tmp_path: Path) -> None:
    frames = transaction("0a")
    frames[-1] = ["commit", {"tag": "commit"}, {"watermark": "0b"}]
    with pytest.raises(ChangeSourceError, match="commit with watermark 0b, not its begin's"):
        await sync(frames, tmp_path / "replica.db")
    assert list(tmp_path.iterdir()) == []


async def test_reset_required_is_an_auto_reset_signal(tmp_path: Path) -> None:
    frames: list[Frame] = [
        *transaction("0a")[:1],
        ["control", {"tag": "reset-required", "message": "start over"}],
    ]
    with pytest.raises(AutoResetSignal, match="start over"):
        await sync(frames, tmp_path / "replica.db")
    assert list(tmp_path.iterdir()) == []


async def test_an_existing_replica_file_is_replaced_only_on_success(tmp_path: Path) -> None:
    replica = tmp_path / "replica.db"
    replica.write_bytes(b"old")
    with pytest.raises(CustomSyncError):
        await sync([*transaction("0a")[:-1], CLOSE], replica)
    assert replica.read_bytes() == b"old"
    state, _ = await sync(initial_sync(APP, "0b"), replica)
    assert state.replica_version == "0b"
