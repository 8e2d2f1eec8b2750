"""``changestreamer restore``: a replica file from its litestream backup, atomically.

``--backup-url`` is restored as given (a reservation's status names a node's, and
``/statz``'s ``backup`` group). Without it, with ``ZERO_UPSTREAM_DB`` set, the backup
is the one the change log's owner recorded upstream under
``ZERO_LITESTREAM_BACKUP_URL`` (each node backs up into a sub-path of its own,
``app/backup/destinations.py``), as a replacement node finds it.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from app.backup.process import check_version
from app.backup.restore import restore_replica
from app.commands import CommandError
from app.commands.startup import read_settings, start_logging
from app.config import Settings
from app.runtime.backups import BackupConfigError, RestoreError, litestream_options
from app.runtime.postgres import UpstreamSetupError, owner_backup_path
from app.runtime.replica_lock import held_replica

__all__ = ["run_restore"]


def run_restore(args: argparse.Namespace) -> int:
    """Restores the backup into the replica file (refusing to replace one without ``--force``)."""
    settings = read_settings(change_db=False)
    start_logging(settings)
    updates: dict[str, object] = {}
    backup_path: str | None = None
    if args.backup_url:
        updates["litestream_backup_url"] = args.backup_url
    elif settings.upstream_db and settings.upstream_type != "custom":
        try:
            backup_path = asyncio.run(owner_backup_path(settings, args.replica_version))
        except UpstreamSetupError as e:
            raise CommandError(str(e), 1) from None
    replica = args.replica or settings.replica_file
    if not replica.parent.is_dir():
        raise CommandError(f"directory {replica.parent} does not exist", 2)
    with held_replica(replica) as held:
        if held is not None:
            raise CommandError(held, 1)
        return _restore(args, settings, replica, updates, backup_path)


def _restore(
    args: argparse.Namespace,
    settings: Settings,
    replica: Path,
    updates: dict[str, object],
    backup_path: str | None,
) -> int:
    try:
        options = litestream_options(
            settings.model_copy(update=updates), replica, backup_path=backup_path
        )
        if replica.exists() and not args.force:
            raise CommandError(f"{replica} exists; pass --force to replace it", 2)
        asyncio.run(check_version(options.executable))
        restored = asyncio.run(restore_replica(options, replica_version=args.replica_version))
    except (BackupConfigError, RestoreError) as e:
        raise CommandError(str(e), 1) from None
    if restored is None:
        hint = (
            ""
            if backup_path is not None or args.backup_url
            else " (each node backs up into a sub-path of its own: a reservation's status "
            "and /statz's backup group name it; ZERO_UPSTREAM_DB finds the owner's)"
        )
        raise CommandError(f"no backup at {options.backup_url}{hint}", 1)
    print(
        f"restored {replica}: replica version {restored.state.replica_version} at "
        f"{restored.state.state_version}, {restored.bytes} bytes in {restored.seconds:.1f} s"
    )
    return 0
