"""A replication-manager replaced by another, node by node, on a shared Postgres
change DB (issue 28): each node a ``serve`` process, backups to a local directory.

B starts with no replica: it restores A's backup under a reservation on A, follows
the log, waits for the coverage gate and takes the change log over; A retires (it
stays up, not ready, until it is stopped). A subscriber of ours in discover mode
follows the change log from A to B to C and sees every writer transaction exactly
once; the new owner's replica equals Postgres; a restarted A does not take the log
back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from app.client import ChangeStreamerClient, ResumingSubscription, SubscriptionContext
from app.client.discovery import discovering
from app.protocol.messages import Data
from app.runtime import retirement
from app.storage import Shard
from tests.pgdb import scratch_database
from tests.serve_pg.conftest import (
    APP_ID,
    SERVE,
    Serve,
    ServeFactory,
    Writer,
    create_workload_schema,
    descendants,
    eventually,
    free_port,
    immutable,
    integrity,
    pg_rows,
    process_alive,
    replica_versions,
    wait_until_replica_matches,
)
from tests.serve_pg.test_backups import backup_env, cli, ready_status, statz
from tests.serve_pg.test_postgres_restart import accepting, restart_cluster
from tests.waiting import stays

_SETTINGS = ("ZERO_", "CHANGESTREAMER_")
LITESTREAM = SERVE.parent / "litestream"


@pytest.fixture
async def change_db(pg_url: str) -> AsyncIterator[str]:
    """The change DB every node shares (as zero's nodes share ``ZERO_CHANGE_DB``)."""
    name = "hpf_handoff_cdb"
    async with scratch_database(pg_url, name):
        yield pg_url.rsplit("/", 1)[0] + "/" + name


def node(
    serve_factory: ServeFactory,
    upstream: str,
    change_db: str,
    backup: str,
    task: str,
    *,
    zero_defaults: bool = False,
) -> Serve:
    """A node over the shared change DB, backing up under ``backup``: with the tests'
    sub-second intervals and no start-up delay, or (``zero_defaults``) with every
    interval at zero-cache's default, as an operator runs it."""
    if zero_defaults:
        env = {
            "ZERO_LITESTREAM_BACKUP_URL": backup,
            "ZERO_LITESTREAM_PORT": str(free_port()),
            # Empty is unset: the defaults (a 15 s start-up delay, the 30 s cleanup delay).
            "ZERO_CHANGE_STREAMER_STARTUP_DELAY_MS": "",
            "CHANGESTREAMER_PURGE_DELAY_SECONDS": "",
        }
        return serve_factory(upstream, ZERO_TASK_ID=task, ZERO_CHANGE_DB=change_db, **env)
    return serve_factory(
        upstream,
        **backup_env(
            backup,
            ZERO_TASK_ID=task,
            ZERO_CHANGE_DB=change_db,
            # A subscriber that is between two nodes must still find its changes.
            CHANGESTREAMER_PURGE_DELAY_SECONDS="60",
        ),
    )


_DESTINATION = re.compile(r"\d{13}-(.+)-[0-9a-f]{6}")


def destinations(backup_dir: Path) -> list[str]:
    """The tasks with a destination under the backup URL (app/backup/destinations.py)."""
    found = [_DESTINATION.fullmatch(p.name) for p in backup_dir.iterdir()]
    return [m.group(1) for m in found if m is not None]


def destination_state(backup_dir: Path, task: str) -> tuple[list[int], int]:
    """The transaction IDs of ``task``'s destination (level 0, where each upload goes)
    and the newest modification time of anything in it."""
    (path,) = [
        p for p in backup_dir.iterdir() if (m := _DESTINATION.fullmatch(p.name)) and m[1] == task
    ]
    files = [f for f in path.rglob("*") if f.is_file()]
    level0 = path / "ltx" / "0"
    txids = sorted(int(f.name.split("-")[0], 16) for f in level0.glob("*.ltx"))
    return txids, max(f.stat().st_mtime_ns for f in files)


def torn_uploads(backup_dir: Path) -> list[str]:
    """Each transaction of each destination restored on its own (``litestream restore
    -txid``) and checked with ``PRAGMA integrity_check``: the ones that are torn."""
    torn = []
    scratch = backup_dir.parent / "txid-check"
    scratch.mkdir(exist_ok=True)
    for destination in sorted(p for p in backup_dir.iterdir() if p.is_dir()):
        for ltx in sorted((destination / "ltx" / "0").glob("*.ltx")):
            txid = ltx.name.split("-")[0]
            out = scratch / f"{destination.name}-{txid}.db"
            done = subprocess.run(
                [
                    str(LITESTREAM),
                    "restore",
                    "-txid",
                    txid,
                    "-o",
                    str(out),
                    f"file://{destination}",
                ],
                capture_output=True,
                timeout=60,
            )
            if done.returncode != 0:  # gone since the listing (retention): not a torn one
                continue
            verdict = integrity(out)
            if verdict != "ok":
                torn.append(f"{destination.name} {txid}: {verdict}")
    return torn


async def refused_upgrade(serve: Serve, replica_version: str) -> None:
    """A serving subscriber at the wrong replica version: the stream says so and ends."""
    query = f"id=stranger&replicaVersion={replica_version}&watermark={replica_version}"
    url = f"ws://127.0.0.1:{serve.port}/replication/v6/changes?{query}"
    async with ws_connect(url, open_timeout=10) as ws:
        with contextlib.suppress(ConnectionClosed):
            while True:
                message = await asyncio.wait_for(ws.recv(), 10)
                if "WrongReplicaVersion" in str(message):
                    break


@contextlib.asynccontextmanager
async def serving_subscriber(serve: Serve, replica_version: str) -> AsyncIterator[None]:
    """An accepted serving subscriber of ``serve`` for as long as the block runs."""
    client = ChangeStreamerClient(f"ws://127.0.0.1:{serve.port}")
    ctx = SubscriptionContext(
        id="router-probe", replica_version=replica_version, watermark=replica_version
    )
    subscription = await client.subscribe(ctx)
    try:
        yield
    finally:
        await subscription.close()


async def owner(change_db: str) -> str | None:
    rows = await pg_rows(change_db, f'SELECT owner FROM "{APP_ID}_0/cdc"."replicationState"')
    return rows[0][0] if rows else None


class Follower:
    """Our subscriber in discover mode: the writer's sequence numbers it saw, in order."""

    def __init__(self, change_db: str, replica_version: str) -> None:
        connect = discovering(change_db, Shard(APP_ID, 0), lambda url: ChangeStreamerClient(url))
        ctx = SubscriptionContext(
            id="follower", replica_version=replica_version, watermark=replica_version
        )
        self.subscription = ResumingSubscription(connect, ctx)
        self.replica_version = replica_version
        self.seqs: list[int] = []
        self.pending: list[int] = []  # of the open transaction
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="discover-follower")

    async def _run(self) -> None:
        async for message in self.subscription:
            if isinstance(message, Data) and _relation(message) == "ledger":
                new = message.body.get("new") or {}
                if message.tag == "insert":
                    self.pending.append(int(new["seq"]))
            elif getattr(message, "kind", None) == "commit":
                self.seqs += self.pending
                self.pending = []
            elif getattr(message, "kind", None) == "rollback":
                self.pending = []

    async def wait_for(self, seqs: set[int], timeout_s: float = 60.0) -> None:
        def seen_all() -> bool:
            if self.task is not None and self.task.done():
                self.task.result()
                raise AssertionError("the follower stopped")
            return seqs <= set(self.seqs)

        await eventually(seen_all, f"the follower to see {len(seqs)} transactions", timeout_s)

    async def close(self) -> None:
        await self.subscription.close()
        if self.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.task, 10)


async def serving_with_a_follower(
    serve_factory: ServeFactory,
    upstream: str,
    change_db: str,
    backup: str,
    *,
    zero_defaults: bool = False,
) -> tuple[Serve, Follower]:
    """Node A ready over the workload's schema, and our subscriber in discover mode."""
    await create_workload_schema(upstream)
    a = node(serve_factory, upstream, change_db, backup, "rm-a", zero_defaults=zero_defaults)
    a.start()
    await a.wait_ready()
    follower = Follower(change_db, replica_versions(a.replica_file)[0])
    follower.start()
    return a, follower


def _relation(message: Data) -> str | None:
    relation = message.body.get("relation")
    return relation.get("name") if isinstance(relation, dict) else None


async def takes_over(
    new: Serve, old: Serve, change_db: str, task: str, old_task: str, *, within_s: float = 90
) -> None:
    """``new`` restores, owns the log after the gate (``within_s`` of its start); ``old``
    retires, stays up, and ends its litestream."""
    old_litestream = statz(old)["backup"]["monitor"]["litestream"]["pid"]
    assert old_litestream is not None
    await new.wait_output(r"restored .*replica\.db \(\d+ bytes, replica version")

    async def owned() -> bool:
        return await owner(change_db) == task

    await eventually(owned, f"{task} to own the change log", within_s - new.seconds_running())
    await new.wait_ready(timeout_s=90)
    await old.wait_output(rf"changeLog ownership has been assumed by {task}; this node serves")

    async def retired() -> bool:
        code, body = await asyncio.to_thread(ready_status, old)
        return code == 503 and body.get("reason") == "retired: another node owns the change log"

    await eventually(retired, f"{old_task} to say it retired", 30)
    assert old.alive()  # retired, not exited: an orchestrator would restart an exit
    assert retirement.read(old.replica_file) == task
    # It ended its litestream and its replica follower before it said so.
    assert not process_alive(old_litestream)
    node_stats = statz(old)
    assert node_stats["node"]["state"] == "retired"
    assert node_stats["node"]["owner"] == task
    assert descendants(old) == []


async def test_a_rolling_update_at_zero_s_default_intervals_loses_nothing_and_takes_a_minute(
    upstream: str, change_db: str, serve_factory: ServeFactory, tmp_path: Path
) -> None:
    # Every interval at zero-cache's default: a backup upload every 15 minutes, a VFS
    # probe every 30 s, a 15 s start-up delay, the 30 s cleanup delay. A → B → C, a
    # restarted A staying retired between; each new node owns the log within a
    # minute of its start, each destination is written by one node, nothing is lost.
    backup_dir = tmp_path / "backup"
    backup = f"file://{backup_dir}"
    a, follower = await serving_with_a_follower(
        serve_factory, upstream, change_db, backup, zero_defaults=True
    )
    version = follower.replica_version
    # A standalone replica of ours, restored from A's backup (its destination is A's
    # own, under the backup URL), follows the change log from node to node too.
    standalone = tmp_path / "standalone" / "replica.db"
    standalone.parent.mkdir()
    restored = await asyncio.to_thread(
        cli,
        "restore",
        "--backup-url",
        statz(a)["backup"]["backupURL"],
        "--replica",
        str(standalone),
        cwd=tmp_path,
    )
    assert restored.returncode == 0, restored.stderr
    replicate_log = (tmp_path / "replicate.log").open("wb")
    command = [str(SERVE), "replicate", "--discover", change_db, "--app-id", APP_ID]
    command += ["--replica", str(standalone)]
    replicate = subprocess.Popen(  # noqa: ASYNC220 - a spawn, not a wait
        command,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith(_SETTINGS)},
        stdout=subprocess.DEVNULL,
        stderr=replicate_log,
    )
    writer = Writer(upstream, big_at=40, big_rows=500)
    writer.start()
    b: Serve | None = None
    c: Serve | None = None
    try:
        await follower.wait_for(set(range(1, 21)))

        # 1. B replaces A after its start-up delay (no subscriber comes to B first).
        b = node(serve_factory, upstream, change_db, backup, "rm-b", zero_defaults=True)
        b.start()
        await takes_over(b, a, change_db, "rm-b", "rm-a", within_s=60)
        assert statz(b)["node"]["takeoverCause"] == "the start-up delay"
        a_done = destination_state(backup_dir, "rm-a")
        await follower.wait_for(set(writer.committed) | {max(writer.committed) + 10})

        # 2. A restarts (its container crashed): B is alive, so A stays retired.
        a.kill()
        a.start()
        await a.wait_output(r"retired: the change log is owned by rm-b \(.*\), which took it")

        async def still_retired() -> bool:
            code, body = await asyncio.to_thread(ready_status, a)
            return code == 503 and body.get("reason") == "retired: another node owns the change log"

        await eventually(still_retired, "the restarted A to say it is retired", 30)

        async def still_b() -> bool:
            return await owner(change_db) == "rm-b"

        await stays(still_b, 3.0, "rm-b's ownership while the restarted A runs")

        # 3. C replaces B. During its start-up delay an upgrade at the wrong replica
        #    version changes nothing; an accepted serving subscriber ends the delay.
        c = node(serve_factory, upstream, change_db, backup, "rm-c", zero_defaults=True)
        c.start()
        await c.wait_ready(timeout_s=60)  # ready: the gate is open, the delay runs
        assert statz(c)["node"]["state"] == "delayed"
        await refused_upgrade(c, "00")
        await stays(still_b, 2.0, "rm-b's ownership after a wrong-version upgrade to C")
        assert statz(c)["node"]["state"] == "delayed"
        async with serving_subscriber(c, version):
            await takes_over(c, b, change_db, "rm-c", "rm-b", within_s=60)
        assert statz(c)["node"]["takeoverCause"] == "a serving subscriber"
        b_done = destination_state(backup_dir, "rm-b")
        await follower.wait_for(set(writer.committed) | {max(writer.committed) + 10})
    finally:
        await writer.finish()
    done = set(writer.committed)
    await follower.wait_for(done)
    await follower.close()
    # Every transaction once, in commit order.
    assert sorted(set(follower.seqs)) == follower.seqs
    assert set(follower.seqs) >= done
    assert c is not None
    assert b is not None
    await wait_until_replica_matches(upstream, c.replica_file)
    try:
        await wait_until_replica_matches(upstream, standalone)
    finally:
        replicate.terminate()
        replicate.wait(30)
        replicate_log.close()
    for s in (b, c):  # restored, not re-synced, and whole
        assert replica_versions(s.replica_file)[0] == version
        assert "initial sync of" not in s.output()
        assert integrity(s.replica_file) == "ok"
    # One destination per node, each written by its node alone: nothing reached A's
    # or B's after they retired, and each holds one chain of transactions from 1.
    assert sorted(destinations(backup_dir)) == ["rm-a", "rm-b", "rm-c"]
    assert destination_state(backup_dir, "rm-a") == a_done
    assert destination_state(backup_dir, "rm-b") == b_done
    for task in ("rm-a", "rm-b", "rm-c"):
        txids = destination_state(backup_dir, task)[0]
        assert txids == list(range(1, len(txids) + 1)), (task, txids)
    # Retired nodes stop cleanly when asked; so does the owner.
    for s in (a, b, c):
        await s.terminate()


async def test_a_node_whose_backup_cannot_be_written_never_takes_over(
    upstream: str, change_db: str, serve_factory: ServeFactory, tmp_path: Path
) -> None:
    backup = tmp_path / "backup"
    await create_workload_schema(upstream)
    a = node(serve_factory, upstream, change_db, f"file://{backup}", "rm-a")
    a.start()
    await a.wait_ready()
    writer = Writer(upstream, big_at=10_000)
    writer.start()
    try:
        await eventually(lambda: len(writer.committed) >= 10, "the writer's first commits")
        # B's destination: a copy of A's backup that B can restore but never write.
        frozen = tmp_path / "frozen"
        shutil.copytree(backup, frozen)
        with immutable(frozen):
            b = node(serve_factory, upstream, change_db, f"file://{frozen}", "rm-b")
            b.start()
            await b.wait_output(r"restored .*replica\.db \(\d+ bytes, replica version")

            async def gated() -> bool:
                code, body = await asyncio.to_thread(ready_status, b)
                reason = str(body.get("reason", ""))
                return code == 503 and reason.startswith(
                    "gated: waiting for a backup that covers the replica at"
                )

            await eventually(gated, "B to wait for its backup", 60)
            written = len(writer.committed)

            async def a_serves() -> bool:
                code, _ = await asyncio.to_thread(ready_status, a)
                return code == 200 and await owner(change_db) == "rm-a" and await gated()

            # Long enough for several backup intervals (0.3 s) and VFS probes (0.1 s).
            await stays(a_serves, 5.0, "A's ownership while B cannot back up")
            assert len(writer.committed) > written  # the writes went on through A
            assert "replicating slot" not in b.output()  # it never streamed
            await b.terminate()
    finally:
        await writer.finish()
    await wait_until_replica_matches(upstream, a.replica_file)
    await a.terminate()


@pytest.mark.parametrize("fault", ["kill-new", "kill-old", "postgres-restart"])
async def test_a_handoff_interrupted_by_a_crash_or_a_postgres_restart_loses_nothing(
    fault: str, upstream: str, change_db: str, serve_factory: ServeFactory, tmp_path: Path
) -> None:
    # kill-new: B is SIGKILLed once it restored, then started again (its replica is
    # there now). kill-old: A is SIGKILLed while B restores. postgres-restart: the
    # cluster restarts while B restores. In each, the subscriber in discover mode
    # sees every transaction once and B ends up the one owner.
    backup = f"file://{tmp_path / 'backup'}"
    a, follower = await serving_with_a_follower(serve_factory, upstream, change_db, backup)
    writer = Writer(upstream, big_at=30, big_rows=300)
    writer.start()
    try:
        await follower.wait_for(set(range(1, 11)))
        b = node(serve_factory, upstream, change_db, backup, "rm-b")
        b.start()
        if fault == "kill-old":
            await b.wait_output(r"holding a snapshot reservation on 127\.0\.0\.1:")
            a.kill()
        else:
            await b.wait_output(r"restored .*replica\.db \(\d+ bytes, replica version")
            if fault == "kill-new":
                b.kill()
                b.start()
            else:
                await writer.finish()  # its connection is cut too; it goes on after
                await asyncio.to_thread(restart_cluster)
                await eventually(lambda: accepting(upstream), "Postgres accepting connections")
                writer.start()
                if not b.alive():  # it may stop at a failed start: an orchestrator restarts it
                    b.start()

        async def b_owns() -> bool:
            return await owner(change_db) == "rm-b"

        await eventually(b_owns, "B to own the change log", 120)
        await b.wait_ready(timeout_s=90)
        await follower.wait_for(set(writer.committed) | {max(writer.committed) + 10}, 90)
    finally:
        await writer.finish()
    await follower.wait_for(set(writer.committed), 90)
    await follower.close()
    assert sorted(set(follower.seqs)) == follower.seqs  # each once, in order
    await wait_until_replica_matches(upstream, b.replica_file)
    assert await owner(change_db) == "rm-b"
    if a.alive():  # retired, not owning
        code, body = await asyncio.to_thread(ready_status, a)
        assert (code, body.get("reason")) == (503, "retired: another node owns the change log")
    await b.terminate()
    # Every upload of every node restores whole: none is a torn image of its replica
    # (the follower leaves the checkpoints to litestream).
    assert await asyncio.to_thread(torn_uploads, tmp_path / "backup") == []
