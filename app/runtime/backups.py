"""Backups for ``serve``: which poller, litestream, the monitor, and the restore path.

Per configuration (wire.md §6, written down in docs/architecture.md):

* **A backup URL** (``ZERO_LITESTREAM_BACKUP_URL``, Postgres upstream): litestream
  v0.5 backs the replica up as a child process, into a destination of this node's
  own under the URL (``app/backup/destinations.py``: at most one litestream ever
  writes a destination); the ``VfsPoller`` reads the *destination* back through the
  litestream VFS, so every watermark the streamer purges or reserves at is one a
  restore really gets. ``/ready`` waits until the backup covers the replica (the
  coverage gate): once the monitor has read the replica's position, litestream is
  made to upload at once (``LitestreamRunner.sync``) rather than at its next interval,
  and the poller reads the destination again. ``/ready`` says when the backup is
  wedged, or litestream crash-loops or has been down for a minute.
* **No backup URL**: the ``ReplicaPoller`` offers the local position — the
  replica's ``stateVersion`` when the service keeps its replica current, else the
  change log's durable watermark (demo source, ``CHANGESTREAMER_FOLLOW_REPLICA=false``)
  — every ``CHANGESTREAMER_REPLICA_POLL_INTERVAL_SECONDS``, so the change log is
  purged below what every subscriber has acknowledged in every configuration.

zero-cache 1.9.0's default backup mode (``ZERO_LITESTREAM_BACKUP_USING_V5=false``)
needs rocicorp's litestream v0.3 fork and its Prometheus progress metric; we back
up with the official v0.5 in both cases (view-syncers restore v0.5 backups with
``ZERO_LITESTREAM_EXECUTABLE_V5``), and say so at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from app.backoff import Backoff
from app.backup.config import BackupConfigError, LitestreamOptions, find_executable
from app.backup.destinations import resolve
from app.backup.monitor import BackupMonitor
from app.backup.process import LitestreamRunner, check_version
from app.backup.restore import Restored, RestoreError, restore_replica
from app.backup.watermarks import (
    LocalState,
    ReplicaPoller,
    VfsPoller,
    VfsProbe,
    read_local_state,
)
from app.config import Settings
from app.runtime.held_reservation import HeldReservation
from app.streamer.backup_watch import BackupWatch
from app.streamer.service import ChangeStreamerService
from app.timeouts import within

__all__ = [
    "BackupConfigError",
    "Backups",
    "RestoreError",
    "check_backup_settings",
    "litestream_options",
    "restore_if_missing",
    "start_backups",
    "vfs_extension",
]

log = logging.getLogger(__name__)

# Retries of the first upload, until the gate opens (litestream may still be starting).
FIRST_UPLOAD_RETRY_S: Final = 1.0
FIRST_UPLOAD_RETRY_MAX_S: Final = 30.0


def litestream_options(
    settings: Settings, replica_file: Path | None = None, *, backup_path: str | None = None
) -> LitestreamOptions:
    """The settings' litestream options for ``replica_file`` (default ZERO_REPLICA_FILE)
    and the destination ``backup_path`` under ZERO_LITESTREAM_BACKUP_URL (None: the URL)."""
    if not settings.litestream_backup_url:
        raise BackupConfigError("ZERO_LITESTREAM_BACKUP_URL is not set")
    return LitestreamOptions(
        executable=find_executable(settings.litestream_executable),
        replica_file=(replica_file or settings.replica_file).absolute(),
        backup_url=resolve(settings.litestream_backup_url, backup_path),
        endpoint=settings.litestream_endpoint,
        region=settings.litestream_region,
        port=settings.litestream_port_resolved,
        checkpoint_threshold_mb=settings.litestream_checkpoint_threshold_mb,
        min_checkpoint_page_count=settings.litestream_min_checkpoint_page_count,
        max_checkpoint_page_count=settings.litestream_max_checkpoint_page_count,
        incremental_backup_interval_minutes=settings.litestream_incremental_backup_interval_minutes,
        snapshot_backup_interval_hours=settings.litestream_snapshot_backup_interval_hours,
        restore_parallelism=settings.litestream_restore_parallelism,
        multipart_concurrency=settings.litestream_multipart_concurrency,
        multipart_size=settings.litestream_multipart_size,
        log_level=settings.litestream_log_level,
        log_format=settings.log_format,
        config_path=Path(settings.litestream_config_path)
        if settings.litestream_config_path
        else None,
    )


def vfs_extension(settings: Settings) -> Path:
    """``ZERO_LITESTREAM_VFS_EXTENSION_PATH``, else the one ``litestream-vfs`` installed."""
    if settings.litestream_vfs_extension_path:
        path = Path(settings.litestream_vfs_extension_path)
        if not path.is_file():
            raise BackupConfigError(f"ZERO_LITESTREAM_VFS_EXTENSION_PATH {path} does not exist")
        return path
    try:
        import litestream_vfs  # type: ignore[import-untyped]
    except ImportError:
        raise BackupConfigError(
            "the litestream VFS extension is missing: install litestream-vfs or set "
            "ZERO_LITESTREAM_VFS_EXTENSION_PATH"
        ) from None
    return Path(litestream_vfs.loadable_path())


async def check_backup_settings(settings: Settings) -> list[str]:
    """Refuses backup settings that cannot work (one line); returns start-up notes."""
    if not settings.litestream_backup_url:
        return []
    if not settings.upstream_db:
        raise BackupConfigError(
            "ZERO_LITESTREAM_BACKUP_URL needs a Postgres upstream (ZERO_UPSTREAM_DB): "
            "the demo source has no replica to back up"
        )
    if not settings.follow_replica:
        raise BackupConfigError(
            "ZERO_LITESTREAM_BACKUP_URL needs CHANGESTREAMER_FOLLOW_REPLICA=true: "
            "a backup of a replica nobody keeps current is no backup"
        )
    interval_s = settings.backup_interval_s
    wedged_after_s = settings.backup_wedged_after_s
    if wedged_after_s is not None and wedged_after_s <= interval_s:
        raise BackupConfigError(
            f"CHANGESTREAMER_BACKUP_WEDGED_AFTER_SECONDS ({wedged_after_s:g}) must be longer "
            f"than the backup interval, ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES "
            f"({interval_s:g} s): the backup moves only that often, so it would be called "
            "wedged between two uploads"
        )
    options = litestream_options(settings)
    version = await check_version(options.executable)
    # View-syncers restore with ZERO_LITESTREAM_EXECUTABLE_V5; when this one is set
    # too (one environment for both roles), it must be a v0.5 as well.
    if settings.litestream_executable_v5:
        await check_version(Path(settings.litestream_executable_v5))
    vfs_extension(settings)
    notes = [f"backups: litestream {version} ({options.executable}) to {options.backup_url}"]
    if not settings.litestream_backup_using_v5:
        notes.append(
            "backups: ZERO_LITESTREAM_BACKUP_USING_V5 is false (zero's default, which means "
            "rocicorp's litestream v0.3 fork); this service backs up with litestream v0.5, "
            "which view-syncers restore with ZERO_LITESTREAM_EXECUTABLE_V5"
        )
    return notes


@dataclass(slots=True)
class Backups:
    """The backup side of one service: tasks that end when the service stops."""

    monitor: BackupMonitor
    runner: LitestreamRunner | None = None
    poller: VfsPoller | ReplicaPoller | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def stats(self) -> dict[str, object]:
        stats = self.monitor.stats()
        if self.runner is not None:
            state = self.runner.state
            stats["litestream"] = {
                "pid": state.pid,
                "starts": state.starts,
                "lastExit": state.last_exit,
                "recentErrors": list(state.recent_errors)[-3:],
            }
        if isinstance(self.poller, VfsPoller):
            stats["probeFailures"] = self.poller.failures
            stats["probeError"] = self.poller.last_error
        return stats

    @property
    def problem(self) -> str | None:
        down = self.runner.problem() if self.runner is not None else None
        return down or self.monitor.problem

    async def stop(self) -> None:
        if self.poller is not None:
            self.poller.stop()
        if self.runner is not None:
            await self.runner.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def start_backups(
    service: ChangeStreamerService,
    settings: Settings,
    *,
    replica_file: Path | None,
    backup_path: str | None = None,
    lock_fd: int | None = None,
) -> Backups:
    """Starts what this configuration needs (module docstring): backups of
    ``replica_file`` into ``backup_path`` under the backup URL; litestream inherits
    ``lock_fd`` (the replica's lock, ``app/runtime/replica_lock.py``).

    The service stops it (``service.stop`` awaits ``Backups.stop``).
    """

    def local() -> LocalState | None:
        if replica_file is not None and settings.follow_replica:
            return read_local_state(replica_file)
        return LocalState(service.storer.durable)

    runner: LitestreamRunner | None = None
    poller: VfsPoller | ReplicaPoller
    if settings.litestream_backup_url and replica_file is not None:
        options = litestream_options(settings, replica_file, backup_path=backup_path)
        runner = LitestreamRunner(options, pass_fds=() if lock_fd is None else (lock_fd,))
        probe = VfsProbe(
            options.vfs_url(),
            vfs_extension(settings),
            timeout_s=settings.litestream_vfs_probe_timeout_ms / 1000,
            log_file=settings.litestream_vfs_log_file,
        )
        poller = VfsPoller(probe, local, settings.litestream_vfs_probe_interval_ms / 1000)
        wedged_after_s = settings.backup_wedged_after_seconds
    else:
        poller = ReplicaPoller(local, settings.replica_poll_interval_s)
        wedged_after_s = float("inf")  # nothing to wedge: the position is local
    monitor = BackupMonitor(
        poller,
        service.backups.track,
        local,
        wedged_after_s=wedged_after_s,
        on_coverage_target=service.backups.set_coverage_target,
        backups=runner is not None,
    )
    backups = Backups(monitor, runner, poller)
    service.backups.state = backups

    async def run_monitor() -> None:
        # From the start, not from the takeover: this node takes the change log over
        # only once a backup covers its replica (the coverage gate). Until it owns
        # the log the watermarks go no further than the gate (BackupWatch.activate).
        try:
            await monitor.run()
        except Exception:
            log.exception("the backup monitor failed")

    if runner is not None:
        backups._tasks.append(asyncio.create_task(runner.run(), name="litestream"))
        assert isinstance(poller, VfsPoller)
        first = force_first_upload(runner, poller, service.backups)
        backups._tasks.append(asyncio.create_task(first, name="first backup"))
    backups._tasks.append(asyncio.create_task(run_monitor(), name="backup monitor"))
    return backups


async def force_first_upload(
    runner: LitestreamRunner, poller: VfsPoller, watch: BackupWatch
) -> None:
    """Has litestream upload the replica once the monitor has read its position, and
    again (with backoff) until the gate opens: the coverage gate then waits for one
    upload, not for ``ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES``."""
    await watch.wait_target()
    retry = Backoff(FIRST_UPLOAD_RETRY_S, FIRST_UPLOAD_RETRY_MAX_S)
    failure: str | None = None
    while not watch.covered():
        try:
            txid = await runner.sync()
        except RuntimeError as e:
            if str(e) != failure:  # once per reason: litestream may still be starting
                log.info("the first upload of the replica is not made yet: %s", e)
            failure = str(e)
        else:
            log.info("the replica is uploaded to its backup (transaction %d)", txid)
            poller.wake()  # read the destination now, not at the next probe
        with contextlib.suppress(TimeoutError):
            await within(watch.wait_covered(), retry.next_delay())


async def restore_if_missing(
    settings: Settings,
    *,
    replica_version: str | None,
    owner_address: str | None,
    backup_path: str | None,
) -> tuple[Restored | None, HeldReservation | None]:
    """Restores ZERO_REPLICA_FILE from the backup when it is missing (zero-cache's way),
    from ``backup_path`` under the backup URL: where the change log's owner backs up,
    as it recorded upstream (None: the URL itself, where earlier versions backed up).

    ``replica_version`` (the change DB's) must match the backup's. With an
    ``owner_address`` (another node owns the change log) a snapshot reservation is
    opened there first and returned still held: the caller releases it once this
    node owns the change log, so the old owner purges nothing the restored replica
    needs in between. (None, None): no backup URL, a replica file exists, or the
    destination is empty.
    """
    if not settings.litestream_backup_url or settings.replica_file.exists():
        return None, None
    options = litestream_options(settings, backup_path=backup_path)
    held: HeldReservation | None = None
    if owner_address:
        held = HeldReservation(
            owner_address,
            settings.task_id or "changestreamer-restore",
            password=settings.replication_password,  # the nodes of one deployment share it
        )
        if await asyncio.to_thread(held.start):
            log.info("holding a snapshot reservation on %s during the restore", owner_address)
    try:
        restored = await restore_replica(options, replica_version=replica_version)
    except BaseException:
        if held is not None:
            await asyncio.to_thread(held.release)
        raise
    if restored is None:
        log.info("no backup at %s yet: the replica is synced from upstream", options.backup_url)
        if held is not None:
            await asyncio.to_thread(held.release)
        return None, None
    return restored, held
