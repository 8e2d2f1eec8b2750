"""Real litestream v0.5 processes on real files: backup, read-back through the VFS, restore."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import stat
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from app import progress
from app.backup import restore as restore_module
from app.backup.config import LitestreamOptions, find_executable
from app.backup.process import LitestreamRunner, check_version
from app.backup.restore import RestoreError, restore_replica
from app.backup.watermarks import VfsPoller, VfsProbe, read_local_state
from app.replica.schema import litestream_state_dir, read_replica_state
from tests.backup.conftest import REPLICA_VERSION, advance, item_count, new_replica
from tests.serve_pg.conftest import eventually as _eventually

TIMEOUT_S = 30.0


async def eventually(check: Callable[[], Any], what: str, timeout_s: float = TIMEOUT_S) -> Any:
    return await _eventually(check, what, timeout_s)


def vfs_extension() -> Path:
    import litestream_vfs  # type: ignore[import-untyped]

    return Path(litestream_vfs.loadable_path())


@pytest.fixture
async def runner(litestream_options: LitestreamOptions) -> AsyncIterator[LitestreamRunner]:
    r = LitestreamRunner(litestream_options)
    task = asyncio.create_task(r.run())
    yield r
    await r.stop()
    await asyncio.wait_for(task, TIMEOUT_S)


def backup_files(options: LitestreamOptions) -> list[Path]:
    root = Path(options.backup_url.removeprefix("file://"))
    return sorted(root.rglob("*.ltx")) if root.exists() else []


async def test_the_installed_litestream_is_v05() -> None:
    version = await check_version(find_executable(None))
    assert version.lstrip("v").startswith("0.5.")


async def test_a_backup_is_read_back_through_the_vfs_and_follows_the_replica(
    litestream_options: LitestreamOptions, runner: LitestreamRunner
) -> None:
    await eventually(lambda: backup_files(litestream_options), "the first upload")
    probe = VfsProbe(litestream_options.vfs_url(), vfs_extension(), timeout_s=TIMEOUT_S)
    try:
        first = await eventually(lambda: _try_read(probe), "the backup's state")
        assert first.watermark == REPLICA_VERSION
        advance(litestream_options.replica_file, "0b")
        moved = await eventually(lambda: _try_read(probe, want="0b"), "the backup to reach 0b")
        assert moved.watermark == "0b"
        local = read_local_state(litestream_options.replica_file)
        assert local is not None
        assert moved.write_time_ms == local.write_time_ms
    finally:
        await probe.close()


async def _try_read(probe: VfsProbe, want: str | None = None) -> Any:
    try:
        state = await probe.read()
    except RuntimeError:
        return None
    return state if want is None or state.watermark == want else None


async def test_the_vfs_poller_yields_each_new_backed_up_watermark_once(
    litestream_options: LitestreamOptions, runner: LitestreamRunner
) -> None:
    probe = VfsProbe(litestream_options.vfs_url(), vfs_extension(), timeout_s=TIMEOUT_S)
    replica = litestream_options.replica_file
    poller = VfsPoller(probe, lambda: read_local_state(replica), interval_s=0.1)
    seen: list[str] = []

    async def consume() -> None:
        async for backed_up in poller:
            seen.append(backed_up.watermark)

    task = asyncio.create_task(consume())
    try:
        await eventually(lambda: seen, "the first backed-up watermark")
        advance(replica, "0b")
        advance(replica, "0c")
        await eventually(lambda: seen and seen[-1] == "0c", "the backup to reach 0c")
        assert seen == sorted(set(seen)), seen  # increasing, no repeats
        assert seen[0] == REPLICA_VERSION
    finally:
        poller.stop()
        await asyncio.wait_for(task, TIMEOUT_S)
    assert probe.pid is None  # the poller's end closed its worker


async def test_an_empty_destination_times_the_probe_out_until_the_first_upload(
    litestream_options: LitestreamOptions,
) -> None:
    # The VFS waits for a first snapshot: before litestream uploads one the probe
    # gives up after its timeout (and ends its worker); once it exists, it reads.
    probe = VfsProbe(litestream_options.vfs_url(), vfs_extension(), timeout_s=1.0)
    try:
        with pytest.raises(RuntimeError, match=r"did not answer in 1 s"):
            await probe.read()
        assert probe.pid is None
        runner = LitestreamRunner(litestream_options)
        task = asyncio.create_task(runner.run())
        try:
            await eventually(lambda: backup_files(litestream_options), "the first upload")
            state = await eventually(lambda: _try_read(probe), "the backup's state")
            assert state.watermark == REPLICA_VERSION
        finally:
            await runner.stop()
            await asyncio.wait_for(task, TIMEOUT_S)
    finally:
        await probe.close()


async def test_a_killed_litestream_is_restarted_and_the_backup_goes_on(
    litestream_options: LitestreamOptions, runner: LitestreamRunner
) -> None:
    await eventually(lambda: runner.state.pid, "litestream to start")
    first_pid = runner.state.pid
    assert first_pid is not None
    os.kill(first_pid, signal.SIGKILL)
    await eventually(
        lambda: runner.state.pid not in (None, first_pid), "litestream to be restarted"
    )
    assert runner.state.starts == 2
    assert runner.state.last_exit == -signal.SIGKILL
    advance(litestream_options.replica_file, "0b")
    probe = VfsProbe(litestream_options.vfs_url(), vfs_extension(), timeout_s=TIMEOUT_S)
    try:
        await eventually(lambda: _try_read(probe, want="0b"), "the backup to reach 0b")
    finally:
        await probe.close()


@pytest.mark.usefixtures("usual_umask")
async def test_restore_brings_back_the_replica_atomically(
    litestream_options: LitestreamOptions, runner: LitestreamRunner, tmp_path: Path
) -> None:
    advance(litestream_options.replica_file, "0b", rows=250)
    probe = VfsProbe(litestream_options.vfs_url(), vfs_extension(), timeout_s=TIMEOUT_S)
    try:
        await eventually(lambda: _try_read(probe, want="0b"), "the backup to reach 0b")
    finally:
        await probe.close()
    target = tmp_path / "restored" / "replica.db"
    target.parent.mkdir()
    options = replace(litestream_options, replica_file=target)
    restored = await restore_replica(options, replica_version=REPLICA_VERSION)
    assert restored is not None
    assert restored.state.state_version == "0b"
    assert read_replica_state(target).replica_version == REPLICA_VERSION
    assert item_count(target) == item_count(litestream_options.replica_file) == 350
    assert not target.with_name("replica.db.restoring").exists()
    assert not litestream_state_dir(target).exists()
    assert sorted(p.name for p in target.parent.iterdir()) == ["replica.db"]  # nothing left
    assert stat.S_IMODE(target.stat().st_mode) == 0o600  # it holds every row


def _children_running(needle: bytes) -> list[int]:
    """PIDs of this process's children whose command line holds ``needle``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == os.getpid() and needle in cmdline:
            found.append(int(entry))
    return found


def _stop_litestream_mid_write(partial: Path, deadline_s: float = 60.0) -> int:
    """Waits (in a thread) for litestream's restore to have written some of
    ``partial``, then stops it there with SIGSTOP; its PID. Polled this tightly
    on purpose: another program, it tells us nothing, and a slower look could
    only see it finished."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        pids = _children_running(b"\x00restore\x00")  # the argument, not a path holding it
        if pids:
            break
        time.sleep(0.0005)
    else:
        raise AssertionError("litestream restore never started")
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if partial.stat().st_size > 0:
                os.kill(pids[0], signal.SIGSTOP)
                return pids[0]
        time.sleep(0.0002)
    raise AssertionError(f"litestream never wrote {partial}")


async def test_a_restore_shows_the_bytes_written_as_it_goes(
    litestream_options: LitestreamOptions,
    runner: LitestreamRunner,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for i, watermark in enumerate(("0b", "0c", "0d", "0e")):  # ~15 MB of replica
        advance(litestream_options.replica_file, watermark, rows=150_000 + i)
    probe = VfsProbe(litestream_options.vfs_url(), vfs_extension(), timeout_s=TIMEOUT_S)
    try:
        await eventually(lambda: _try_read(probe, want="0e"), "the backup to reach 0e")
    finally:
        await probe.close()
    monkeypatch.setattr(progress, "AFTER_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.02)
    monkeypatch.setattr(restore_module, "PROGRESS_POLL_S", 0.01)
    caplog.set_level(logging.INFO, logger="app.progress")
    target = tmp_path / "restored" / "replica.db"
    target.parent.mkdir()
    partial = target.with_name("replica.db.restoring.tmp")  # litestream's output, first
    options = replace(litestream_options, replica_file=target)
    stopper = asyncio.create_task(asyncio.to_thread(_stop_litestream_mid_write, partial))
    restore = asyncio.create_task(restore_replica(options, replica_version=REPLICA_VERSION))
    pid = await stopper
    try:
        # Stopped mid-write: the progress line shows what it has written so far.
        def written() -> dict[str, Any] | None:
            for r in caplog.records:
                fields = r.__dict__.get("log_fields", {}).get("progress")
                if fields and fields["job"] == "restore of replica.db" and fields["done"] > 0:
                    return dict(fields)
            return None

        shown = await eventually(written, "a progress line with bytes written")
        assert shown["unit"] == "bytes"
        assert shown["done"] <= partial.stat().st_size
    finally:
        os.kill(pid, signal.SIGCONT)
    restored = await restore
    assert restored is not None
    assert restored.state.state_version == "0e"
    assert shown["done"] < restored.bytes


async def test_restore_refuses_a_backup_of_another_replica_version(
    litestream_options: LitestreamOptions, runner: LitestreamRunner, tmp_path: Path
) -> None:
    await eventually(lambda: backup_files(litestream_options), "the first upload")
    target = tmp_path / "other.db"
    new_replica(target, version="09", rows=3)  # the file a failed restore must leave alone
    options = replace(litestream_options, replica_file=target)
    with pytest.raises(RestoreError, match="is of replica version 0a, not 09"):
        await restore_replica(options, replica_version="09", attempts=1)
    assert item_count(target) == 3
    assert not target.with_name("other.db.restoring").exists()


async def test_restore_from_an_empty_destination_finds_no_backup(tmp_path: Path) -> None:
    target = tmp_path / "replica.db"
    options = LitestreamOptions(
        executable=find_executable(None),
        replica_file=target,
        backup_url=f"file://{tmp_path / 'nothing-here'}",
    )
    assert await restore_replica(options) is None
    assert not target.exists()


def torn_copy(source: Path, out: Path) -> None:
    """``source`` with one index page zeroed past its header, as a restore that missed
    the frames of a page would leave it (``row N missing from index``)."""
    import sqlite3

    with sqlite3.connect(source) as conn:
        conn.execute("CREATE INDEX items_title ON items (title)")
        (page,) = conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'items_title'"
        ).fetchone()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        size = conn.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(source.read_bytes())
    data[(page - 1) * size + 8 : page * size] = bytes(size - 8)
    out.write_bytes(bytes(data))


async def test_a_restore_that_is_not_a_whole_database_is_refused_and_replaces_nothing(
    tmp_path: Path,
) -> None:
    # litestream cannot be made to upload a torn transaction on purpose (the follower
    # no longer lets it), so a stand-in executable plays a restore that comes out
    # torn: it writes a damaged copy of a replica where `-o` says.
    torn = tmp_path / "torn.db"
    torn_copy(new_replica(tmp_path / "source.db", rows=500), torn)
    stand_in = tmp_path / "litestream"
    stand_in.write_text(f'#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\ncp {torn} "$2"\n')
    stand_in.chmod(0o755)
    target = tmp_path / "replica.db"
    new_replica(target, rows=3)  # the file a refused restore must leave alone
    options = LitestreamOptions(
        executable=stand_in, replica_file=target, backup_url=f"file://{tmp_path / 'b'}"
    )
    # SQLite's own words, on one line.
    with pytest.raises(
        RestoreError, match=r"is not a consistent database: database disk image is malformed$"
    ):
        await restore_replica(options, attempts=2, retry_delay_s=0.01)
    assert item_count(target) == 3
    assert not target.with_name("replica.db.restoring").exists()
