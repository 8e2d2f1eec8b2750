"""``changestreamer replicate URL --replica FILE``: a standalone serving replica.

Follows a change-streamer into a replica file: subscribes at the file's state
version, applies every transaction, acks after applying, and reconnects with backoff
until stopped (Ctrl-C: exit status 130; SIGTERM: 0). The options are parsed by
``app/cli.py``.

A replica file that does not exist yet is restored from the change-streamer's backup
first, as a zero view-syncer starts: a snapshot reservation on the change-streamer
(v6 ``/snapshot``; v7 ``reserve-snapshot`` on the ``/subscribe`` socket that the
subscription then continues on) keeps its change log from being purged past the
backup while litestream restores it (``app/backup/restore.py``, with the
``ZERO_LITESTREAM_*`` settings ``changestreamer restore`` reads; ``--backup-url``
names the same backup as this host reaches it), and the first subscription, as the
reserving task, ends the reservation. A change-streamer without backups refuses the
reservation; the command then stops with one line naming the other ways to a replica
file (a restore from a backup, a copy of the service's replica), exit status 2.

A change-streamer that refuses the replication password (HTTP 401: missing or
wrong ``CHANGESTREAMER_REPLICATION_PASSWORD`` or ``--password-file``; or 403) stops the
command at once with that one line, exit status 2, like any other bad setting.

A replica the change-streamer can no longer serve (another replica version, or older
than its change log) ends the command with exit status 3 and says so: it must be
copied or restored again. A change the replica cannot apply, or a restore that
failed, is exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import Final

from app.backoff import Backoff
from app.backup.process import check_version
from app.backup.restore import RestoreError, restore_replica
from app.client import (
    ChangeStreamerClient,
    ClientError,
    DiscoveryError,
    NoChangeStreamerError,
    ProtocolError,
    SnapshotFollowup,
    UnauthorizedError,
)
from app.client.credentials import PasswordFileError, replication_password
from app.config import SettingsError, load_settings
from app.logs import configure_logging, final_line
from app.replica.errors import ReplicaError, ResyncRequiredError
from app.replica.runner import run_replicator
from app.runtime.backups import BackupConfigError, litestream_options
from app.runtime.replica_lock import held_replica
from app.storage.errors import ChangeDbConfigError
from app.storage.shard import Shard
from app.timeouts import within

__all__ = ["run_replicate"]

log = logging.getLogger(__name__)

# --discover waits this long between looks while no change-streamer owns the log.
DISCOVER_RETRY_S: Final = 0.5
DISCOVER_RETRY_MAX_S: Final = 5.0


class _Stop(Exception):
    """The command ends here: one line on stderr, and an exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def run_replicate(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    replica: Path = args.replica
    try:
        try:
            password = replication_password(args.password_file)
        except PasswordFileError as e:
            raise _Stop(str(e), 2) from e
        missing = not replica.exists()
        if missing and not replica.parent.is_dir():
            raise _Stop(f"directory {replica.parent} does not exist", 2)
        with held_replica(replica) as held:
            if held is not None:
                raise _Stop(held, 1)
            stopped_by = asyncio.run(
                _replicate(args, replica, restore_first=missing, password=password)
            )
    except _Stop as e:
        final_line(str(e), command="changestreamer replicate")
        return e.code
    except UnauthorizedError as e:
        final_line(str(e), command="changestreamer replicate")
        return 2
    except ResyncRequiredError as e:
        final_line(str(e), command="changestreamer replicate")
        return 3
    except ReplicaError as e:
        final_line(str(e), command="changestreamer replicate")
        return 1
    return 128 + signal.SIGINT if stopped_by == signal.SIGINT else 0


async def _replicate(
    args: argparse.Namespace, replica: Path, *, restore_first: bool, password: str | None
) -> int | None:
    """Replicates (after restoring the replica, if asked) until a signal; the signal."""
    stop = asyncio.Event()
    stopped_by: list[int] = []

    def on_signal(sig: int) -> None:
        stopped_by.append(sig)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    subscriber_id = args.subscriber_id or f"replicate-{os.getpid()}"
    task_id: str | None = args.task_id

    def client_for(url: str) -> ChangeStreamerClient:
        return ChangeStreamerClient(url, protocol_version=args.protocol_version, password=password)

    url = args.url
    subscribe = None
    if args.discover:
        # The owner now, for a restore; every session then looks it up again.
        from app.client.discovery import discovering

        try:
            shard = Shard(args.app_id, args.shard_num)
        except ChangeDbConfigError as e:
            raise _Stop(str(e), 2) from None
        found = await _owner_when_there_is_one(args.discover, shard, stop)
        if found is None:  # stopped while waiting
            return stopped_by[0]
        url = found
        subscribe = discovering(args.discover, shard, client_for)
    client = client_for(url)
    reservation: SnapshotFollowup | None = None
    if restore_first:
        task_id = task_id or subscriber_id
        restoring = asyncio.create_task(_restore(client, replica, task_id, args.backup_url))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({restoring, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not restoring.done():  # stopped: the restore is cancelled, the reservation closed
            restoring.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await restoring
            return stopped_by[0]
        reservation = restoring.result()
    commits = 0

    def count(_: object) -> None:
        nonlocal commits
        commits += 1
        if commits % 1000 == 0:
            log.info("replicated %d transactions", commits)

    where = f"the owner named in {args.discover}" if args.discover else url
    log.info("replicating %s into %s", where, replica)
    await run_replicator(
        url,
        replica,
        subscriber_id=subscriber_id,
        stop=stop,
        task_id=task_id,
        on_commit=count,
        client=client,
        reservation=reservation,
        subscribe=subscribe,
    )
    log.info("stopped after %d transactions", commits)
    return stopped_by[0] if stopped_by else None


async def _owner_when_there_is_one(change_db: str, shard: Shard, stop: asyncio.Event) -> str | None:
    """The change log's owner, waiting (with backoff) while none is recorded yet, as
    zero's view-syncers do: a node starting with the default delay takes the log over
    15 s after it is ready. None if stopped first; other discovery errors stop."""
    from app.client.discovery import discover

    retry = Backoff(DISCOVER_RETRY_S, DISCOVER_RETRY_MAX_S)
    waiting = False
    while True:
        try:
            return await discover(change_db, shard)
        except NoChangeStreamerError:
            if not waiting:
                log.info("--discover: no change-streamer owns the change log yet; waiting")
                waiting = True
        except DiscoveryError as e:
            raise _Stop(f"--discover: {e}", 1) from None
        with contextlib.suppress(TimeoutError):
            await within(stop.wait(), retry.next_delay())
        if stop.is_set():
            return None


async def _restore(
    client: ChangeStreamerClient, replica: Path, task_id: str, backup_url: str | None
) -> SnapshotFollowup:
    """Restores the missing ``replica`` under a snapshot reservation, which it returns."""
    try:
        settings = load_settings()  # ZERO_LITESTREAM_*: where litestream is, S3 endpoint
    except SettingsError as e:
        raise _Stop(str(e), 2) from None
    log.info(
        "%s does not exist: restoring it from the change-streamer's backup "
        "(snapshot reservation on %s as task %s)",
        replica,
        client.base,
        task_id,
    )
    try:
        status, followup = await client.reserve_snapshot(task_id)
    except ProtocolError as e:  # 1002: no backups there
        raise _Stop(
            f"{replica} does not exist, and {client.base} has no backup to restore it from "
            f"({e.reason}): restore one (changestreamer restore --backup-url URL --replica "
            f"{replica}) or copy the service's replica file (sqlite3 replica.db "
            f'".backup {replica}"), then start replicate again',
            2,
        ) from None
    except UnauthorizedError:
        raise
    except ClientError as e:
        raise _Stop(f"{replica} does not exist and cannot be restored: {e}", 1) from None
    url = backup_url or status.backup_url
    try:
        options = litestream_options(
            settings.model_copy(update={"litestream_backup_url": url}), replica
        )
        await check_version(options.executable)
        restored = await restore_replica(
            options, replica_version=status.replica_version, min_watermark=status.min_watermark
        )
        if restored is None:
            raise _Stop(f"{replica} does not exist and cannot be restored: no backup at {url}", 1)
    except (BackupConfigError, RestoreError) as e:
        await followup.cancel()
        raise _Stop(f"{replica} does not exist and cannot be restored: {e}", 1) from None
    except BaseException:
        await followup.cancel()
        raise
    return followup
