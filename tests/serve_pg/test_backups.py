"""Backups end to end: Postgres → ``serve`` → litestream → a restored second replica.

Real parts only: the ``changestreamer`` console script, a scratch Postgres
database, litestream v0.5 child processes backing up to a local directory, the
VFS read-back, ``changestreamer restore`` and ``changestreamer replicate``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.client import ChangeStreamerClient
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
    lite_rows,
    process_alive,
    replica_versions,
    wait_until_replica_matches,
)
from tests.waiting import stays

TASK = "view-syncer-7"


def backup_env(backup_url: str, **extra: str) -> dict[str, str]:
    return {
        "ZERO_LITESTREAM_BACKUP_URL": backup_url,
        # Uploads every 0.3 s and probes every 0.1 s: the tests wait on them.
        "ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES": "0.005",
        "ZERO_LITESTREAM_VFS_PROBE_INTERVAL_MS": "100",
        "ZERO_LITESTREAM_PORT": str(free_port()),
        "ZERO_LITESTREAM_LOG_LEVEL": "info",
        "ZERO_TASK_ID": "rm-1",
        "CHANGESTREAMER_PURGE_DELAY_SECONDS": "0.5",
        "CHANGESTREAMER_CHANGE_LOG_RETENTION_SECONDS": "0",
        **extra,
    }


def ready_status(serve: Serve) -> tuple[int | None, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{serve.port}/ready", timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return None, {}


def unready_reason(serve: Serve) -> str | None:
    """Why ``/ready`` says 503 now; None while it says anything else."""
    code, body = ready_status(serve)
    return str(body.get("reason", "")) if code == 503 else None


def statz(serve: Serve) -> dict[str, Any]:
    url = f"http://127.0.0.1:{serve.port}/statz?format=json"
    with urllib.request.urlopen(url, timeout=5) as r:
        data: dict[str, Any] = json.loads(r.read())
        return data


def change_log_min(serve: Serve) -> str | None:
    rows = lite_rows(serve.change_db_file, 'SELECT min(watermark) FROM "changeLog"')
    value: str | None = rows[0][0]
    return value


def backed_up_after(serve: Serve, watermark: str) -> Callable[[], bool]:
    """Whether ``serve``'s backup now reaches past ``watermark``."""
    return lambda: (statz(serve)["backup"]["backupWatermark"] or "") > watermark


def starts_after(serve: Serve, watermark: str) -> Callable[[], bool]:
    """Whether ``serve``'s change log now starts after ``watermark`` (it was purged)."""
    return lambda: (change_log_min(serve) or "") > watermark


def change_log_rows(serve: Serve) -> int:
    return int(lite_rows(serve.change_db_file, 'SELECT count(*) FROM "changeLog"')[0][0])


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_", "CHANGESTREAMER_"))}
    return subprocess.run(
        [str(SERVE), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


async def test_ready_waits_for_a_backup_that_covers_the_replica(
    upstream: str, serve_factory: ServeFactory, tmp_path: Path
) -> None:
    # A destination that cannot be created (its parent is a file) keeps the backup
    # empty; /ready must say why it is not ready until the backup reaches the replica.
    blocker = tmp_path / "blocked"
    blocker.write_text("not a directory")
    await create_workload_schema(upstream)
    serve = serve_factory(upstream, **backup_env(f"file://{blocker}/backup"))
    serve.start()
    await serve.wait_output(r"waiting for a backup that covers the replica at")

    async def not_ready_for_the_backup() -> bool:
        return "waiting for a backup" in (unready_reason(serve) or "")

    await eventually(not_ready_for_the_backup, "/ready to wait for the backup")
    # Litestream retries meanwhile; still nothing to read back.
    await stays(not_ready_for_the_backup, 2, "/ready waiting for the backup", poll_s=0.2)
    code, body = ready_status(serve)
    assert code == 503, body
    _, state_version = replica_versions(serve.replica_file)
    assert state_version in body["reason"]

    blocker.unlink()  # the destination becomes writable
    await serve.wait_ready()
    stats = statz(serve)["backup"]
    assert stats["covered"] is True
    assert stats["backupWatermark"] >= state_version
    await serve.terminate()


async def test_a_reserved_restore_catches_up_with_no_gap_while_writes_continue(
    upstream: str, serve_factory: ServeFactory, tmp_path: Path
) -> None:
    backup = tmp_path / "backup"
    await create_workload_schema(upstream)
    serve = serve_factory(upstream, **backup_env(f"file://{backup}"))
    serve.start()
    await serve.wait_ready()
    writer = Writer(upstream, big_at=10, big_rows=500)
    writer.start()
    try:
        await writer.wait_stored(serve.change_db_file, 20)
        client = ChangeStreamerClient(f"ws://127.0.0.1:{serve.port}")
        status, followup = await client.reserve_snapshot(TASK)
        replica_version, _ = replica_versions(serve.replica_file)
        assert status.replica_version == replica_version
        # This node's own destination under the backup URL (app/backup/destinations.py).
        assert re.fullmatch(rf"file://{backup}/\d{{13}}-rm-1-[0-9a-f]{{6}}", status.backup_url)
        assert status.body["replicaSize"] > 0  # the replica's bytes, when reserved
        reserved = status.min_watermark

        # Restore a second replica while the reservation holds and writes go on.
        second = tmp_path / "second" / "replica.db"
        second.parent.mkdir()
        done = await asyncio.to_thread(
            cli,
            "restore",
            "--backup-url",
            status.backup_url,
            "--replica",
            str(second),
            "--replica-version",
            replica_version,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        restored_version, restored_at = replica_versions(second)
        assert restored_version == replica_version
        assert restored_at >= reserved

        # Purges run meanwhile but may not pass the reserved watermark.
        await writer.wait_stored(serve.change_db_file, 60)
        await eventually(
            lambda: statz(serve)["backup"]["purge"]["heldBy"] == "reservation",
            "a purge pass held at the reserved watermark",
        )
        floor = change_log_min(serve)
        assert floor is not None
        assert floor <= reserved

        # The restored replica subscribes as the reserving task: that ends the
        # reservation, and it catches up from its restored watermark.
        replicate_log = (tmp_path / "replicate.log").open("wb")
        replicate = subprocess.Popen(  # noqa: ASYNC220 - a spawn, not a wait
            [
                str(SERVE),
                "replicate",
                f"ws://127.0.0.1:{serve.port}",
                "--replica",
                str(second),
                "--task-id",
                TASK,
            ],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=replicate_log,
        )
        try:
            await asyncio.wait_for(followup.closed.wait(), 30)
            assert not statz(serve)["backup"]["reservations"]["open"]
            await writer.wait_stored(serve.change_db_file, 100)
        finally:
            await writer.finish()
        try:
            await wait_until_replica_matches(upstream, second)
        finally:
            replicate.terminate()
            replicate.wait(30)
            replicate_log.close()
        await wait_until_replica_matches(upstream, serve.replica_file)

        # With the reservation gone the log shrinks to the floor.
        await eventually(
            lambda: (change_log_min(serve) or "") > reserved, "a purge past the old reservation"
        )
    finally:
        if not writer.stop.is_set():
            await writer.finish()
    await serve.terminate()


async def test_without_a_backup_url_the_change_log_stays_bounded(
    upstream: str, serve_factory: ServeFactory
) -> None:
    await create_workload_schema(upstream)
    serve = serve_factory(
        upstream,
        CHANGESTREAMER_PURGE_DELAY_SECONDS="0.2",
        CHANGESTREAMER_REPLICA_POLL_INTERVAL_SECONDS="0.2",
        CHANGESTREAMER_CHANGE_LOG_RETENTION_SECONDS="0",
    )
    serve.start()
    await serve.wait_ready()
    writer = Writer(upstream, big_at=10_000)  # small transactions only
    writer.start()
    peaks: list[int] = []
    try:
        for committed in range(100, 401, 100):
            # Stored transactions get purged, so count what the writer committed.
            def committed_enough(n: int = committed) -> bool:
                writer.check()
                return len(writer.committed) >= n

            await eventually(committed_enough, f"{committed} writer commits", 60)
            peaks.append(change_log_rows(serve))
    finally:
        await writer.finish()
    await wait_until_replica_matches(upstream, serve.replica_file)
    # Each writer transaction is ~5 rows (begin, 1-3 changes, ledger row, commit):
    # 400 transactions unpurged would be ~2,000 rows.
    await eventually(lambda: change_log_rows(serve) <= 50, "the purge to catch up", 30)
    assert max(peaks) < 1000, peaks
    assert statz(serve)["backup"]["purge"]["passes"] >= 2
    await serve.terminate()


def test_restore_from_an_empty_destination_says_there_is_no_backup(tmp_path: Path) -> None:
    done = cli(
        "restore",
        "--backup-url",
        f"file://{tmp_path / 'none'}",
        "--replica",
        str(tmp_path / "r.db"),
        cwd=tmp_path,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == f"changestreamer: no backup at file://{tmp_path / 'none'}"
    assert shutil.which("litestream", path=str(Path(sys.executable).parent))


def metric(serve: Serve, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{serve.port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no sample of {name}")


def litestreams_of(replica: Path) -> list[int]:
    """The live litestream processes backing ``replica`` up (by their configuration's
    path beside it), anywhere on the machine."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (FileNotFoundError, ProcessLookupError):
            continue
        config = str(replica.parent / f".{replica.name}.litestream.yml").encode()
        if not zombie and argv and argv[0].endswith(b"litestream") and config in argv:
            found.append(int(entry))
    return found


async def test_serve_killed_by_sigkill_takes_its_children_along_and_one_restart_runs_alone(
    upstream: str, serve_factory: ServeFactory, tmp_path: Path
) -> None:
    await create_workload_schema(upstream)
    serve = serve_factory(upstream, **backup_env(f"file://{tmp_path / 'backup'}"))
    serve.start()
    await serve.wait_ready()
    writer = Writer(upstream, big_at=10_000)
    writer.start()
    try:
        await writer.wait_stored(serve.change_db_file, 10)
        children = descendants(serve)
        names = {name for _pid, name in children}
        assert "litestream" in names, children  # and the follower, the probe, the writer
        assert len(litestreams_of(serve.replica_file)) == 1
        serve.kill()  # SIGKILL, while litestream uploads every 0.3 s

        def all_gone() -> bool:
            return not any(process_alive(pid) for pid, _name in children)

        await eventually(all_gone, f"the children of the killed serve to end: {children}", 10)
        assert litestreams_of(serve.replica_file) == []

        # A second serve on the same replica is refused while the first runs again.
        serve.start()
        await serve.wait_ready()
        assert len(litestreams_of(serve.replica_file)) == 1
        base = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_", "CHANGE"))}
        twin = await asyncio.to_thread(
            subprocess.run,
            [str(SERVE), "serve", "--host", "127.0.0.1", "--port", str(free_port())],
            cwd=serve.workdir,
            env={**base, **serve.env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert twin.returncode == 1, twin.stderr
        refusal = twin.stderr.strip().splitlines()[-1]
        in_use = r"the replica \S+replica\.db is in use by another process: pid \d+"
        assert re.search(in_use, refusal), refusal
        assert len(litestreams_of(serve.replica_file)) == 1
        written = len(writer.committed)
        await eventually(lambda: len(writer.committed) >= written + 20, "more writes")
    finally:
        await writer.finish()
    await wait_until_replica_matches(upstream, serve.replica_file)
    await serve.terminate()
    assert litestreams_of(serve.replica_file) == []


async def test_litestream_killed_or_its_destination_broken_mid_run_is_told_and_recovered(
    upstream: str, serve_factory: ServeFactory, tmp_path: Path
) -> None:
    backup = tmp_path / "backup"
    await create_workload_schema(upstream)
    serve = serve_factory(
        upstream,
        **backup_env(
            f"file://{backup}",
            CHANGESTREAMER_BACKUP_WEDGED_AFTER_SECONDS="2",
            ZERO_LITESTREAM_VFS_PROBE_TIMEOUT_MS="3000",
        ),
    )
    serve.start()
    await serve.wait_ready()
    writer = Writer(upstream, big_at=10_000)
    writer.start()
    try:
        # 1. litestream killed (it is our child's child; by its PID): it is restarted.
        litestream = statz(serve)["backup"]["monitor"]["litestream"]
        assert litestream["starts"] == 1
        os.kill(litestream["pid"], 9)
        await eventually(
            lambda: statz(serve)["backup"]["monitor"]["litestream"]["starts"] == 2,
            "litestream to be restarted",
        )
        await serve.wait_output(r"litestream exited \(code -9\); restarting")

        # 2. The destination breaks (a file where its directory was): the backup stops
        #    moving while the replica does; /ready, metrics and the log say so.
        moved = tmp_path / "backup-away"
        backup.rename(moved)
        backup.write_text("in the way")

        async def wedged() -> bool:
            return (unready_reason(serve) or "").startswith("owner: backup wedged")

        await eventually(wedged, "/ready to report the wedged backup", 60)
        assert metric(serve, "changestreamer_backup_wedged") == 1
        await serve.wait_output(r"ERROR .*backup wedged: no progress for")
        floor = statz(serve)["backup"]["purge"]["floor"]
        backed_up = statz(serve)["backup"]["backupWatermark"]
        assert floor is None or floor <= backed_up  # purge never passes the backup

        # 3. It is mended: the backup moves again and /ready recovers.
        backup.unlink()
        moved.rename(backup)
        await serve.wait_ready(timeout_s=90)
        assert metric(serve, "changestreamer_backup_wedged") == 0
    finally:
        await writer.finish()
    # Nothing acked upstream was lost on the way.
    await wait_until_replica_matches(upstream, serve.replica_file)
    await serve.terminate()


async def test_a_replacement_node_restores_under_a_reservation_instead_of_re_syncing(
    upstream: str, serve_factory: ServeFactory, tmp_path: Path
) -> None:
    backup = f"file://{tmp_path / 'backup'}"
    await create_workload_schema(upstream)
    old = serve_factory(upstream, **backup_env(backup, ZERO_TASK_ID="rm-1"))
    old.start()
    await old.wait_ready()
    writer = Writer(upstream, big_at=10_000)
    writer.start()
    try:
        await writer.wait_stored(old.change_db_file, 20)
        # The new node shares the change DB (and so sees the old one as its owner)
        # and the backup, but has no replica file yet.
        new = serve_factory(
            upstream,
            **backup_env(backup, ZERO_TASK_ID="rm-2", ZERO_CHANGE_DB=str(old.change_db_file)),
        )
        new.start()
        await new.wait_output(
            rf"holding a snapshot reservation on 127\.0\.0\.1:{old.port} during the restore"
        )
        await new.wait_output(r"restored .*replica\.db \(\d+ bytes, replica version")
        await old.wait_output(r"snapshot reservation opened for task rm-2")
        await new.wait_ready(timeout_s=90)
        # The new node took the change log over; the old one stops streaming.
        await eventually(
            lambda: (
                lite_rows(old.change_db_file, 'SELECT owner FROM "replicationState"') == [("rm-2",)]
            ),
            "the new node to own the change log",
        )
        await writer.wait_stored(old.change_db_file, 60)
    finally:
        await writer.finish()
    await wait_until_replica_matches(upstream, new.replica_file)
    assert "initial sync of" not in new.output()  # restored, not re-synced
    assert replica_versions(new.replica_file)[0] == replica_versions(old.replica_file)[0]
    await new.terminate()


async def test_serve_backs_up_to_an_s3_api_and_restore_reads_it_back(
    upstream: str, serve_factory: ServeFactory, tmp_path: Path, monkeypatch: Any
) -> None:
    # moto's S3 server on loopback stands in for S3 (unreachable from here).
    from moto.server import ThreadedMotoServer

    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)  # litestream v0.5 cannot take one
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    for name, value in creds.items():
        monkeypatch.setenv(name, value)
    port = free_port()
    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    s3.start()
    try:
        import boto3

        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket="zero"
        )
        await create_workload_schema(upstream)
        s3_env = {"ZERO_LITESTREAM_ENDPOINT": endpoint, "ZERO_LITESTREAM_REGION": "us-east-1"}
        serve = serve_factory(upstream, **backup_env("s3://zero/backups/replica", **s3_env))
        serve.start()
        await serve.wait_ready()  # the coverage gate read the backup back from S3
        writer = Writer(upstream, big_at=5, big_rows=300)
        writer.start()
        try:
            await writer.wait_stored(serve.change_db_file, 30)
        finally:
            await writer.finish()
        await wait_until_replica_matches(upstream, serve.replica_file)
        _, at = replica_versions(serve.replica_file)
        await eventually(
            lambda: (statz(serve)["backup"]["backupWatermark"] or "") >= at,
            "the S3 backup to reach the replica",
        )
        # The node backs up into a sub-path of its own; `restore` finds it where the
        # node recorded it upstream when it took the slot over.
        destination = statz(serve)["backup"]["backupURL"]
        assert destination.startswith("s3://zero/backups/replica/")
        restored = tmp_path / "from-s3.db"
        env = {
            **s3_env,
            **creds,
            "ZERO_UPSTREAM_DB": upstream,
            "ZERO_APP_ID": APP_ID,
            "ZERO_LITESTREAM_BACKUP_URL": "s3://zero/backups/replica",
        }
        done = await asyncio.to_thread(
            subprocess.run,
            [str(SERVE), "restore", "--replica", str(restored)],
            cwd=tmp_path,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("ZERO_")}, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        await wait_until_replica_matches(upstream, restored, timeout_s=5)
        await serve.terminate()
    finally:
        s3.stop()


async def test_a_steady_trickle_of_restoring_clients_does_not_stop_the_log_shrinking(
    upstream: str, serve_factory: ServeFactory, tmp_path: Path
) -> None:
    # View-syncers restoring one after another, each opening its reservation before
    # the previous one ends, so that some reservation is open at every moment: each
    # holds the purge floor at its own watermark only, and the log's start moves on.
    await create_workload_schema(upstream)
    serve = serve_factory(upstream, **backup_env(f"file://{tmp_path / 'backup'}"))
    serve.start()
    await serve.wait_ready()
    writer = Writer(upstream, big_at=10_000)
    writer.start()
    client = ChangeStreamerClient(f"ws://127.0.0.1:{serve.port}")
    held: list[Any] = []
    starts: list[str] = []
    try:
        await writer.wait_stored(serve.change_db_file, 20)
        status, followup = await asyncio.wait_for(client.reserve_snapshot("restoring-0"), 30)
        held.append(followup)
        for i in range(1, 6):
            await eventually(backed_up_after(serve, status.min_watermark), "the backup to move on")
            status, followup = await asyncio.wait_for(client.reserve_snapshot(f"restoring-{i}"), 30)
            held.append(followup)
            await held.pop(0).cancel()  # the previous one finished restoring (or gave up)
            before = change_log_min(serve) or ""
            starts.append(before)
            await eventually(
                starts_after(serve, before),
                f"the change log's start to move past {before} with reservations open",
                60,
            )
            assert statz(serve)["backup"]["reservations"]["open"]  # never none open
        assert starts == sorted(starts)
    finally:
        for followup in held:
            await followup.cancel()
        await writer.finish()
    await wait_until_replica_matches(upstream, serve.replica_file)
    await serve.terminate()
