"""``changestreamer replicate`` as a process against our server (memory source): following
a replica file, and starting from none by restoring the server's backup."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.backup.config import LitestreamOptions, find_executable
from app.backup.process import LitestreamRunner
from tests.server.conftest import REPLICA_VERSION, Server, start_server
from tests.waiting import eventually

from .conftest import create_index, create_table, insert, new_replica
from .test_runner import tx

CLI = [sys.executable, "-m", "app.cli", "replicate"]
TIMEOUT_S = 30


async def state_version(replica: Path) -> str:
    def read() -> str:
        conn = sqlite3.connect(replica)
        try:
            row = conn.execute('SELECT stateVersion FROM "_zero.replicationState"').fetchone()
            return str(row[0])
        finally:
            conn.close()

    return await asyncio.to_thread(read)


async def replicate(*args: str, cwd: Path) -> asyncio.subprocess.Process:
    """The command, with none of this environment's ZERO_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERO_")}
    return await asyncio.create_subprocess_exec(
        *CLI, *args, cwd=cwd, env=env, stderr=asyncio.subprocess.PIPE
    )


async def until_state_version(replica: Path, version: str) -> None:
    async def reached() -> bool:
        return replica.exists() and await state_version(replica) == version

    await eventually(reached, f"{replica} to reach {version}", 20, poll_s=0.05)


def foo_rows(replica: Path) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(replica)
    try:
        return conn.execute("SELECT id, name, _0_version FROM foo").fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
async def test_replicate_follows_the_stream_until_interrupted(
    tmp_path: Path, sig: signal.Signals, status: int
) -> None:
    replica = new_replica(tmp_path / "replica.db", REPLICA_VERSION)
    async for server in start_server(tmp_path):
        proc = await replicate(server.url, "--replica", str(replica), "--id", "cli", cwd=tmp_path)
        try:
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 20)
            stream.push_all(
                [
                    *tx("02", create_table(), create_index()),
                    *tx("03", insert({"id": 1, "name": "a"})),
                ]
            )
            await until_state_version(replica, "03")
            proc.send_signal(sig)
            _, err = await asyncio.wait_for(proc.communicate(), 20)
            assert proc.returncode == status, err.decode()  # Ctrl-C: 130, as shells count
            assert b"Traceback" not in err
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert foo_rows(replica) == [(1, "a", "03")]


@pytest.fixture
async def backup(tmp_path: Path, unused_tcp_port: int) -> str:
    """The URL of a litestream backup (file://) of a new replica at REPLICA_VERSION."""
    (tmp_path / "service").mkdir()
    options = LitestreamOptions(
        executable=find_executable(None),
        replica_file=new_replica(tmp_path / "service" / "replica.db", REPLICA_VERSION),
        backup_url=f"file://{tmp_path / 'backup'}",
        port=unused_tcp_port,
        incremental_backup_interval_minutes=0.005,  # 0.3 s
    )
    runner = LitestreamRunner(options)
    running = asyncio.create_task(runner.run())
    try:
        await eventually(
            lambda: list((tmp_path / "backup").rglob("*.ltx")),
            "litestream to upload something",
            30,
            poll_s=0.05,
        )
    finally:
        await runner.stop()
        await asyncio.wait_for(running, TIMEOUT_S)
    return options.backup_url


async def backed_up_server(tmp_path: Path, backup_url: str) -> AsyncIterator[Server]:
    """Our server, naming ``backup_url`` and holding it as backed up at REPLICA_VERSION
    (no start-up delay: reservations are confirmed by the change log's owner, and a
    reservation does not end the delay)."""
    async for server in start_server(tmp_path / "server", backup_url=backup_url, startup_delay_s=0):
        server.service.backups.set_coverage_target(REPLICA_VERSION)
        server.service.backups.track(REPLICA_VERSION)
        yield server


@pytest.mark.parametrize("protocol", ["6", "7"])
async def test_a_missing_replica_is_restored_from_the_backup_then_followed(
    tmp_path: Path, backup: str, protocol: str
) -> None:
    (tmp_path / "server").mkdir()
    copy = tmp_path / "copy.db"
    async for server in backed_up_server(tmp_path, backup):
        proc = await replicate(
            server.url, "--replica", str(copy), "--protocol-version", protocol, cwd=tmp_path
        )
        try:
            stream = await asyncio.wait_for(server.source.wait_for_stream(), TIMEOUT_S)
            stream.push_all(
                [
                    *tx("02", create_table(), create_index()),
                    *tx("03", insert({"id": 1, "name": "a"})),
                ]
            )
            await until_state_version(copy, "03")
            # It subscribed as the reserving task: that ended the reservation.
            reservations = server.service.reservations
            assert reservations.open_tasks == []
            assert reservations.longest_completed_s > 0
            proc.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(proc.communicate(), 20)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 130, err.decode()
    said = [line for line in err.decode().splitlines() if "does not exist" in line]
    assert len(said) == 1, said
    assert said[0].endswith(
        f"{copy} does not exist: restoring it from the change-streamer's backup "
        f"(snapshot reservation on {server.url} as task replicate-{proc.pid})"
    )
    assert foo_rows(copy) == [(1, "a", "03")]


async def test_a_missing_replica_and_no_backup_is_one_line_naming_the_ways_to_one(
    tmp_path: Path,
) -> None:
    copy = tmp_path / "copy.db"
    async for server in start_server(tmp_path):  # no backup URL
        proc = await replicate(server.url, "--replica", str(copy), cwd=tmp_path)
        _, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    assert proc.returncode == 2
    lines = [line for line in err.decode().splitlines() if line.startswith("changestreamer")]
    assert lines == [
        f"changestreamer replicate: {copy} does not exist, and {server.url} has no backup to "
        "restore it from (Error: replication-manager is not configured with a "
        "ZERO_LITESTREAM_BACKUP_URL): restore one (changestreamer restore --backup-url URL "
        f"--replica {copy}) or copy the service's replica file (sqlite3 replica.db "
        f'".backup {copy}"), then start replicate again'
    ]
    assert not copy.exists()


async def test_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    proc = await replicate(
        "ws://127.0.0.1:9", "--replica", str(tmp_path / "no" / "copy.db"), cwd=tmp_path
    )
    _, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    assert proc.returncode == 2
    assert err.decode().splitlines() == [
        f"changestreamer replicate: directory {tmp_path / 'no'} does not exist"
    ]
