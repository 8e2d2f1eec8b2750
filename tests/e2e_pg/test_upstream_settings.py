"""Upstream settings against the real server: initial sync's copy workers and their cap
(``ZERO_INITIAL_SYNC_TABLE_COPY_WORKERS``, ``ZERO_UPSTREAM_MAX_CONNS``), failover slots
(``ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER``, refused before Postgres 17) and the
stream's inbound timeout (``ZERO_UPSTREAM_PG_STREAM_INBOUND_TIMEOUT_MS``).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest

from app.commands.migrate import open_change_db
from app.config import Settings, load_settings
from app.runtime.postgres import UpstreamSetupError, postgres_service, prepare_upstream
from app.sources.postgres import initial_sync as initial_sync_module
from app.sources.postgres.errors import SlotCreationError
from app.sources.postgres.shard import ShardConfig
from app.sources.postgres.slots import create_replication_slot, failover_refusal
from app.storage import migrate
from tests.pgdb import scratch_database

APP_ID = "hpw"
TABLES = 6


def settings_for(url: str, work: Path, **env: str) -> Settings:
    return load_settings(
        environ={},
        env_file=None,
        ZERO_UPSTREAM_DB=url,
        ZERO_APP_ID=APP_ID,
        ZERO_REPLICA_FILE=str(work / "replica.db"),
        **env,
    )


async def make_tables(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
        for i in range(TABLES):
            await c.execute(f"CREATE TABLE t{i} (id int PRIMARY KEY, v text)".encode())
            await c.execute(
                f"INSERT INTO t{i} SELECT g, 'v' FROM generate_series(1, 50) g".encode()
            )


async def slots_of(url: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
        cur = await c.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"
        )
        return [r[0] for r in await cur.fetchall()]


@pytest.mark.parametrize(
    ("env", "workers"),
    [
        ({}, 5),  # zero's default
        ({"ZERO_INITIAL_SYNC_TABLE_COPY_WORKERS": "3"}, 3),
        ({"ZERO_INITIAL_SYNC_TABLE_COPY_WORKERS": "4", "ZERO_UPSTREAM_MAX_CONNS": "2"}, 2),
    ],
)
async def test_initial_sync_copies_with_the_configured_workers_capped_by_max_conns(
    pg_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    workers: int,
) -> None:
    pools: list[int] = []
    threads: set[str] = set()

    class RecordingPool(ThreadPoolExecutor):
        def __init__(self, max_workers: int, **kwargs: Any) -> None:
            if kwargs.get("thread_name_prefix") == "initial-sync-copy":  # not the SQLite one
                pools.append(max_workers)
            super().__init__(max_workers, **kwargs)

    copy_tables = initial_sync_module._copy_tables

    def recording_copy(*args: Any) -> None:
        threads.add(threading.current_thread().name)
        copy_tables(*args)

    monkeypatch.setattr(initial_sync_module, "ThreadPoolExecutor", RecordingPool)
    monkeypatch.setattr(initial_sync_module, "_copy_tables", recording_copy)
    async with scratch_database(pg_url, "hpw_copy_workers") as url:
        await make_tables(url)
        settings = settings_for(url, tmp_path, **env)
        db = open_change_db(settings)
        try:
            await migrate(db)
            prepared = await prepare_upstream(settings, db)
        finally:
            await db.dispose()
        assert prepared.replica.replica_version
    # One upstream connection per copy worker, for the whole copy.
    assert pools == [workers]
    assert 1 <= len(threads) <= workers


async def test_a_failover_slot_is_refused_before_postgres_17(pg_url: str, tmp_path: Path) -> None:
    async with scratch_database(pg_url, "hpw_failover") as url:
        await make_tables(url)
        async with await psycopg.AsyncConnection.connect(url) as c:
            version = c.info.server_version
        assert version < 170000, "this test needs a server before Postgres 17"
        expected = failover_refusal(version)
        assert expected == (
            "ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER needs Postgres 17 or later; the upstream "
            f"is Postgres {version // 10000}.{version % 10000} (unset the setting, or upgrade)"
        )
        settings = settings_for(url, tmp_path, ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER="true")
        db = open_change_db(settings)
        try:
            await migrate(db)
            with pytest.raises(UpstreamSetupError) as e:
                await prepare_upstream(settings, db)
        finally:
            await db.dispose()
        assert str(e.value) == expected
        assert "\n" not in str(e.value)
        assert not settings.replica_file.exists()
        assert await slots_of(url) == []  # refused before anything was created
        # The slot function refuses too, whoever calls it.
        with pytest.raises(SlotCreationError, match="needs Postgres 17 or later"):
            await create_replication_slot(url, ShardConfig(APP_ID, 0, ()), failover=True)
        assert await slots_of(url) == []
        # false (zero's default) syncs as usual.
        settings = settings_for(url, tmp_path, ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER="false")
        db = open_change_db(settings)
        try:
            await migrate(db)
            await prepare_upstream(settings, db)
        finally:
            await db.dispose()
        assert len(await slots_of(url)) == 1


@pytest.mark.parametrize(("value", "seconds"), [(None, None), ("2500", 2.5)])
async def test_the_inbound_timeout_reaches_the_stream(
    pg_url: str, tmp_path: Path, value: str | None, seconds: float | None
) -> None:
    # The behaviour itself (a silent stream torn down) is in
    # tests/serve_pg/test_upstream_settings.py; here: which limit the stream gets.
    async with scratch_database(pg_url, "hpw_inbound") as url:
        await make_tables(url)
        env = {"ZERO_UPSTREAM_PG_STREAM_INBOUND_TIMEOUT_MS": value} if value else {}
        settings = settings_for(url, tmp_path, **env)
        db = open_change_db(settings)
        try:
            await migrate(db)
            prepared = await prepare_upstream(settings, db)
            runtime = await postgres_service(settings, db, prepared, address="127.0.0.1:0")
            source: Any = runtime.service._source
            assert source._options.silence_timeout_s == seconds
            stream = await source.start_stream(prepared.replica.state_version, [])
            try:
                # None: 2 × the server's wal_sender_timeout.
                assert stream._silence_s == (seconds if seconds is not None else 120.0)
            finally:
                await stream.close()
                await source.stop()
        finally:
            await db.dispose()
