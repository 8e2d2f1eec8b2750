"""A real Postgres restart while serve streams: it reconnects and loses nothing.

The cluster on 127.0.0.1:5432 is restarted with ``pg_ctlcluster`` (as
``scripts/ensure-postgres`` does to set ``wal_level``); it is back in a second or
two. Everything connected to it — the walsender, the writer — is cut off.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess

import psycopg

from tests.serve_pg.conftest import (
    ServeFactory,
    Writer,
    eventually,
    start_ready,
    stored_xids,
    wait_until_replica_matches,
)

PORT = "5432"


def restart_cluster() -> None:
    """``pg_ctlcluster <version> <cluster> restart`` for the cluster on our port."""
    listing = subprocess.run(
        ["pg_lsclusters", "--no-header"], check=True, capture_output=True, text=True
    ).stdout
    version, cluster = next(
        (f[0], f[1]) for f in (line.split() for line in listing.splitlines()) if f[2] == PORT
    )
    command = ["pg_ctlcluster", "--skip-systemctl-redirect", version, cluster, "restart"]
    if os.geteuid() != 0:
        command = [shutil.which("sudo") or "sudo", "-n", *command]
    subprocess.run([*command, "-m", "fast"], check=True, capture_output=True, timeout=60)


async def accepting(url: str) -> bool:
    try:
        async with await psycopg.AsyncConnection.connect(url, connect_timeout=2):
            return True
    except psycopg.OperationalError:
        return False


async def test_postgres_restart_mid_stream_loses_nothing(
    upstream: str, serve_factory: ServeFactory
) -> None:
    serve = await start_ready(upstream, serve_factory)
    writer = Writer(upstream, big_at=10, big_rows=300)
    writer.start()
    await writer.wait_stored(serve.change_db_file, 20)
    await writer.finish()

    await asyncio.to_thread(restart_cluster)
    await eventually(lambda: accepting(upstream), "Postgres accepting connections again")

    stored_before = len(writer.committed)
    writer.start()  # goes on where it stopped
    await writer.wait_stored(serve.change_db_file, stored_before + 20)
    await writer.finish()

    await wait_until_replica_matches(upstream, serve.replica_file)
    stored = stored_xids(serve.change_db_file)
    assert len(stored) == len(set(stored)), "a transaction was stored twice"
    assert set(writer.committed.values()) <= set(stored)
    assert serve.alive()
    assert "change stream failed" in serve.output()  # it did lose the connection
    await serve.terminate()
