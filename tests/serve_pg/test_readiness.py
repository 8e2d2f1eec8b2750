"""``/ready`` says when the node cannot do its job, and recovers (issue 42): a change DB
on a full disk, a replica follower that crash-loops. Real ``serve`` processes, a real
tmpfs, real Postgres; nothing acked is lost on the way."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serve_pg.conftest import (
    Serve,
    ServeFactory,
    Writer,
    create_workload_schema,
    descendants,
    eventually,
    immutable,
    wait_until_replica_matches,
)
from tests.serve_pg.test_backups import unready_reason


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (root only: skipped elsewhere)."""
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(disk: Path) -> Path:
    """Writes a file until the disk is full; returns it."""
    filler = disk / "filler"
    chunk = b"\0" * (64 * 1024)
    full_disk = pytest.raises(OSError, match="No space left on device")
    with open(filler, "wb", buffering=0) as f, full_disk as full:
        while True:
            f.write(chunk)
    assert full.value.errno == errno.ENOSPC, full.value
    return filler


async def test_ready_says_the_change_log_cannot_be_written_while_its_disk_is_full(
    upstream: str, serve_factory: ServeFactory, tmp_path: Path
) -> None:
    await create_workload_schema(upstream)
    with small_disk(tmp_path / "disk", "16m") as disk:
        serve = serve_factory(upstream, ZERO_CHANGE_DB=str(disk / "cdc.db"))
        serve.start()
        await serve.wait_ready()
        writer = Writer(upstream, big_at=10_000)
        writer.start()
        try:
            await eventually(lambda: len(writer.committed) >= 5, "the writer's first commits")
            filler = fill(disk)

            async def not_writable() -> str | None:
                reason = await asyncio.to_thread(unready_reason, serve)
                if reason and reason.startswith("owner: the change log cannot be written"):
                    return reason
                return None

            reason = await eventually(not_writable, "/ready to say the log cannot be written", 60)
            assert "database or disk is full" in reason, reason
            assert serve.alive()

            filler.unlink()  # space comes back: the stream goes on where it stopped
            await serve.wait_ready(timeout_s=60)
            written = len(writer.committed)
            await eventually(
                lambda: len(writer.committed) >= written + 20, "writes after the disk recovered"
            )
        finally:
            await writer.finish()
        await wait_until_replica_matches(upstream, serve.replica_file)  # nothing lost
        await serve.terminate()


def follower_pid(serve: Serve) -> int:
    for pid, _name in descendants(serve):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"app.runtime.log_follower" in f.read():
                return pid
    raise AssertionError("no replica follower runs")


async def test_ready_says_the_replica_follower_crash_loops_and_recovers_when_it_runs_again(
    upstream: str, serve_factory: ServeFactory, tmp_path: Path
) -> None:
    await create_workload_schema(upstream)
    serve = serve_factory(upstream)
    serve.start()
    await serve.wait_ready()
    writer = Writer(upstream, big_at=10_000)
    writer.start()
    try:
        await eventually(lambda: len(writer.committed) >= 5, "the writer's first commits")
        # The follower cannot write the replica any more (an immutable file opens
        # read-only): each restart fails at its first commit.
        with immutable(serve.replica_file):
            os.kill(follower_pid(serve), signal.SIGKILL)

            async def crash_looping() -> str | None:
                reason = await asyncio.to_thread(unready_reason, serve)
                return reason if reason and "replica follower failed" in reason else None

            reason = await eventually(crash_looping, "/ready to report the crash loop", 60)
            assert reason.startswith("owner: the replica follower failed "), reason
            assert serve.alive()
        # Writable again: the next restart runs, and once it ran a while, /ready is 200.
        await serve.wait_ready(timeout_s=90)
    finally:
        await writer.finish()
    await wait_until_replica_matches(upstream, serve.replica_file)
    await serve.terminate()
