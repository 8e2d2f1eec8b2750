"""The replica follower: the service's own replica applied from the change log.

Real change DBs (SQLite file and Postgres), real replica files, and the real child
process for the parts that are about the process (wake-ups on stdin, EOF = the parent
is gone, the resync exit code)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.protocol.canonical_json import dumps
from app.protocol.messages import Begin, Commit, Data
from app.replica.errors import ResyncRequiredError
from app.replica.replicator import Replicator
from app.runtime.log_follower import (
    CHANGE_DB_ENV,
    EXIT_RESYNC,
    LogFollower,
    messages_from_rows,
)
from app.runtime.replica_follower import ReplicaFollower, parse_line
from app.storage import ChangeDb, ChangeLog, ChangeRow, StoredRow
from app.storage.engine import reader_target
from app.storage.log_reader import LogReader, open_log_reader
from tests.change_dbs import migrated
from tests.storage.conftest import drop_schema, make_db
from tests.waiting import eventually

from .conftest import create_index, create_table, insert, rows

OWNER = "task-a"


def tx(watermark: str, *changes: dict[str, Any]) -> list[ChangeRow]:
    """The rows the storer writes for one upstream transaction."""
    out = [ChangeRow(watermark, 0, '{"tag":"begin"}')]
    out += [ChangeRow(watermark, i, dumps(c)) for i, c in enumerate(changes, start=1)]
    out.append(ChangeRow(watermark, len(changes) + 1, '{"tag":"commit"}', watermark))
    return out


@pytest.fixture(params=["sqlite", "postgres"])
async def change_db(
    request: pytest.FixtureRequest, tmp_path: Path, pg_url: str
) -> AsyncIterator[ChangeDb]:

    db = make_db(request.param, tmp_path, pg_url)
    try:
        await migrated(db, publications=("pub",), owner=OWNER)
        yield db
    finally:
        await drop_schema(db)
        await db.dispose()


@pytest.fixture
def reader(change_db: ChangeDb) -> Iterator[LogReader]:
    """The follower's own reader of the log (``log_reader``, no engines)."""
    with open_log_reader(reader_target(change_db.url), change_db.shard) as reader:
        yield reader


def test_rows_become_the_messages_of_the_stream() -> None:
    stored = [(r.watermark, r.pos, r.change, r.precommit) for r in tx("02", insert({"id": 1}))]
    begin, data, commit = messages_from_rows(stored)
    assert isinstance(begin, Begin)
    assert begin.commit_watermark == "02"
    assert not begin.skip_ack
    assert isinstance(data, Data)
    assert data.tag == "insert"
    assert data.body["new"] == {"id": 1}
    assert isinstance(commit, Commit)
    assert commit.watermark == "02"


async def test_catch_up_applies_what_the_log_holds_past_the_replica(
    change_db: ChangeDb, reader: LogReader, replica: Path
) -> None:
    log = ChangeLog(change_db)
    await log.commit_rows(OWNER, tx("02", create_table(), create_index()), "02")
    await log.commit_rows(OWNER, tx("03", insert({"id": 1, "name": "a"})), "03")
    async with Replicator(replica, mode="backup") as replicator:
        follower = LogFollower(reader, replicator)
        follower.check()
        assert await follower.catch_up() == 2
        assert replicator.watermark == "03"
        assert await follower.catch_up() == 0  # nothing new: nothing applied twice
        # A transaction bigger than one read batch is applied whole.
        many = [insert({"id": n, "name": "b"}) for n in range(2, 2_600)]
        await log.commit_rows(OWNER, tx("04", *many), "04")
        follower.notified = "04"
        assert await follower.catch_up() == 1
        assert replicator.watermark == "04"
    assert rows(replica, "SELECT count(*), min(id), max(id) FROM foo") == [(2_599, 1, 2_599)]
    assert rows(replica, 'SELECT "stateVersion" FROM "_zero.replicationState"') == [("04",)]


async def test_a_log_of_another_replica_version_is_refused(
    reader: LogReader, tmp_path: Path
) -> None:
    from .conftest import new_replica

    other = new_replica(tmp_path / "other.db", version="00")
    async with Replicator(other, mode="backup") as replicator:
        with pytest.raises(ResyncRequiredError, match="replica version 01, the replica is 00"):
            LogFollower(reader, replicator).check()


async def test_a_log_purged_past_the_replica_means_resync(
    change_db: ChangeDb, reader: LogReader, replica: Path
) -> None:
    log = ChangeLog(change_db)
    async with Replicator(replica, mode="backup") as replicator:
        # The replica applied 02 elsewhere; the log never had it (purged, say).
        await replicator.apply_batch(messages_from_rows(_stored(tx("02", create_table()))))
        await log.commit_rows(OWNER, tx("03", insert({"id": 1})), "03")
        with pytest.raises(ResyncRequiredError, match="replica is at 02, but the change log"):
            await LogFollower(reader, replicator).catch_up()
        assert replicator.watermark == "02"


def _stored(change_rows: list[ChangeRow]) -> list[StoredRow]:
    return [(r.watermark, r.pos, r.change, r.precommit) for r in change_rows]


# -- the child process ------------------------------------------------------------------


async def _eventually(check: Any, what: str, timeout_s: float = 30.0) -> None:
    await eventually(check, what, timeout_s, poll_s=0.02)


async def test_the_child_applies_each_commit_it_is_told_of_and_stops_with_the_service(
    tmp_path: Path, replica: Path, pg_url: str
) -> None:
    db = make_db("sqlite", tmp_path, pg_url)
    await migrated(db, publications=("pub",), owner=OWNER)
    log = ChangeLog(db)
    await log.commit_rows(OWNER, tx("02", create_table(), create_index()), "02")
    # No poll within the test: only the line on stdin can wake it.
    follower = ReplicaFollower(
        replica, str(db.url.database), db.shard, log_level="info", poll_s=3600
    )
    running = asyncio.create_task(follower.run())
    try:

        def version() -> str:
            return str(rows(replica, 'SELECT "stateVersion" FROM "_zero.replicationState"')[0][0])

        await _eventually(lambda: version() == "02", "the log's first commit")
        await log.commit_rows(OWNER, tx("03", insert({"id": 7, "name": "x"})), "03")
        follower.notify("03")
        await _eventually(lambda: version() == "03", "the notified commit")
        assert rows(replica, "SELECT id, name FROM foo") == [(7, "x")]
        pid = follower.state.pid
        assert pid is not None
    finally:
        await follower.stop()
        assert await running is False
        await db.dispose()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_the_child_ends_when_its_parent_is_gone(
    tmp_path: Path, replica: Path, pg_url: str
) -> None:
    """stdin's EOF is how a SIGKILLed serve's child learns it is an orphan."""
    db = make_db("sqlite", tmp_path, pg_url)
    await migrated(db, publications=("pub",))
    await db.dispose()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "app.runtime.log_follower",
        "--replica",
        str(replica),
        "--app-id",
        db.shard.app_id,
        "--shard-num",
        str(db.shard.shard_num),
        "--log-level",
        "info",
        env={**os.environ, CHANGE_DB_ENV: reader_target(db.url)},
        stdin=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None
    assert proc.stderr is not None
    line = await asyncio.wait_for(proc.stderr.readline(), 30)
    assert b"following the change log" in line
    proc.stdin.close()
    assert await asyncio.wait_for(proc.wait(), 10) == 0
    assert b"the service is gone" in await proc.stderr.read()


async def test_the_child_exits_for_a_resync_and_is_not_restarted(
    tmp_path: Path, pg_url: str
) -> None:
    from .conftest import new_replica

    db = make_db("sqlite", tmp_path, pg_url)
    await migrated(db, publications=("pub",))
    await db.dispose()
    other = new_replica(tmp_path / "other.db", version="00")
    follower = ReplicaFollower(other, str(db.url.database), db.shard)
    assert await asyncio.wait_for(follower.run(), 30) is True
    assert follower.state.starts == 1
    assert follower.state.last_exit == EXIT_RESYNC
    assert any("replica version 01, the replica is 00" in e for e in follower.state.recent_errors)


def test_child_log_lines_keep_their_level() -> None:
    line = '{"time":"2026-12-01T10:00:00.123Z","level":"ERROR","logger":"x","message":"bad"}'
    assert parse_line(line) == (40, "bad", None)
    warn = '{"level":"WARN","logger":"x","message":"slow","exc":"Traceback …\\nE: e"}'
    assert parse_line(warn) == (30, "slow", "Traceback …\nE: e")
    assert parse_line("Traceback (most recent call last):") == (
        30,
        "Traceback (most recent call last):",
        None,
    )


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


async def test_the_child_gets_no_secret_of_the_parent_s_environment(
    tmp_path: Path, replica: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The follower reads the change DB's URL and nothing else of ours: the upstream
    and admin passwords in our environment never reach it (app/child_env.py)."""
    monkeypatch.setenv("ZERO_ADMIN_PASSWORD", "admin-secret-1")
    monkeypatch.setenv("ZERO_OPERATOR_PASSWORD", "operator-secret-1")
    monkeypatch.setenv("ZERO_UPSTREAM_DB", "postgresql://u:upstream-secret-1@127.0.0.1/db")
    db = make_db("sqlite", tmp_path, pg_url)
    await migrated(db, publications=("pub",), owner=OWNER)
    await ChangeLog(db).commit_rows(OWNER, tx("02", create_table(), create_index()), "02")
    follower = ReplicaFollower(replica, str(db.url.database), db.shard, poll_s=3600)
    running = asyncio.create_task(follower.run())
    try:

        def version() -> str:
            return str(rows(replica, 'SELECT "stateVersion" FROM "_zero.replicationState"')[0][0])

        await _eventually(lambda: version() == "02", "the log's first commit")
        pid = follower.state.pid
        assert pid is not None
        env = _environ_of(pid)
    finally:
        await follower.stop()
        assert await running is False
        await db.dispose()
    assert env[CHANGE_DB_ENV] == reader_target(db.url)
    assert not [k for k in env if k.startswith("ZERO_")], env
    assert not [v for v in env.values() if "secret-1" in v]
