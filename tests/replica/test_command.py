"""``changestreamer replicate`` as a process against our server (memory source)."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import sys
from pathlib import Path

from tests.server.conftest import REPLICA_VERSION, start_server

from .conftest import create_index, create_table, insert, new_replica
from .test_runner import tx

CLI = [sys.executable, "-m", "app.cli", "replicate"]


async def state_version(replica: Path) -> str:
    def read() -> str:
        conn = sqlite3.connect(replica)
        try:
            row = conn.execute('SELECT stateVersion FROM "_zero.replicationState"').fetchone()
            return str(row[0])
        finally:
            conn.close()

    return await asyncio.to_thread(read)


async def test_replicate_follows_the_stream_until_interrupted(tmp_path: Path) -> None:
    replica = new_replica(tmp_path / "replica.db", REPLICA_VERSION)
    async for server in start_server(tmp_path):
        proc = await asyncio.create_subprocess_exec(
            *CLI,
            server.url,
            "--replica",
            str(replica),
            "--id",
            "cli-replica",
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 20)
            stream.push_all(
                [
                    *tx("02", create_table(), create_index()),
                    *tx("03", insert({"id": 1, "name": "a"})),
                ]
            )
            for _ in range(400):  # up to 20 s
                if await state_version(replica) == "03":
                    break
                await asyncio.sleep(0.05)
            assert await state_version(replica) == "03"
            proc.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(proc.wait(), 20) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    conn = sqlite3.connect(replica)
    try:
        assert conn.execute("SELECT id, name, _0_version FROM foo").fetchall() == [(1, "a", "03")]
    finally:
        conn.close()


async def test_replicate_needs_an_existing_replica(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "ws://127.0.0.1:9",
        "--replica",
        str(tmp_path / "none.db"),
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ},
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"does not exist; start from a copy of the service's replica file" in err
