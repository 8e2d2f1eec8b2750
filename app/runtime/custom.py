"""``serve`` over a custom change source (``ZERO_UPSTREAM_TYPE=custom``, spec/source.md §4).

``ZERO_UPSTREAM_DB`` is the source's full ``ws://``/``wss://`` URL. On start:

1. The replica file (``ZERO_REPLICA_FILE``). When the change DB says a reset is
   required, it is deleted (with ``ZERO_AUTO_RESET``; without, that is an error).
   If it exists, the configured publications (sorted) must be the ones it was synced
   with — zero's check, and like zero only when publications are configured; a
   mismatch stops start-up (a custom source cannot tell which publications it serves,
   so silently re-syncing would hide a configuration mistake). If it is missing, the
   custom initial sync builds it (:mod:`app.sources.custom_sync`): the source's first
   transaction, whose commit watermark is the replicaVersion.
2. The change DB is tied to the replica (``ensure_config``), as for Postgres: a
   fresh replica resets the change log.
3. The service streams from the durable watermark through
   :class:`~app.sources.custom.CustomChangeSource`, reconnecting with backoff; a
   replica follower keeps the replica file current (``ReplicaRuntime.start_backup``).

Restoring a missing replica from a litestream backup is not done for custom sources
(zero 1.9.0 does it): a missing replica is synced again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from app.config import Settings
from app.replica.schema import ReplicaState, read_replica_state, remove_replica_files
from app.runtime.replica_runtime import (
    ReplicaRuntime,
    UpstreamSetupError,
    service_over_replica,
)
from app.sources.base import ChangeSourceError
from app.sources.custom import CustomChangeSource
from app.sources.custom_sync import CustomSyncError, custom_initial_sync
from app.storage import ChangeDb, Replication

__all__ = [
    "PreparedCustom",
    "check_custom_settings",
    "custom_service",
    "prepare_custom_upstream",
    "publications_mismatch",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PreparedCustom:
    """A replica synced from the custom source at ``url``, ready to stream."""

    url: str
    replica: ReplicaState


def check_custom_settings(settings: Settings) -> str | None:
    """Why the settings cannot run a custom upstream (one line), or None."""
    if settings.upstream_type != "custom":
        return None
    if not settings.upstream_db:
        return (
            "ZERO_UPSTREAM_TYPE=custom needs ZERO_UPSTREAM_DB: the custom change source's "
            "URL (ws://host/changes/v0/stream)"
        )
    try:
        _source(settings, settings.upstream_db, None)
    except ValueError as e:
        return f"ZERO_UPSTREAM_DB: {e}"
    return None


async def prepare_custom_upstream(settings: Settings, db: ChangeDb) -> PreparedCustom:
    """Step 1 of the module docstring: a replica to stream for, synced now if needed.

    Raises :class:`UpstreamSetupError`, or ``AutoResetSignal`` when the source asked
    for a reset during the initial sync.
    """
    url = settings.upstream_db
    if not url:
        raise UpstreamSetupError("ZERO_UPSTREAM_DB is not set")
    replica_file = settings.replica_file
    existing = await Replication(db).config()
    if existing is not None and existing.reset_required and replica_file.exists():
        if not settings.auto_reset:
            raise UpstreamSetupError(
                f"replica {replica_file} cannot continue (the change DB says a reset is "
                "required); enable ZERO_AUTO_RESET or delete the replica file to re-sync"
            )
        log.warning("the change DB says a reset is required: re-syncing %s", replica_file)
        remove_replica_files(replica_file)
    if replica_file.exists():
        state = read_replica_state(replica_file)
        problem = publications_mismatch(settings.app_publications, state.publications)
        if problem is not None:
            raise UpstreamSetupError(
                f"replica {replica_file}: {problem}; set ZERO_APP_PUBLICATIONS back, or "
                "delete the replica file to re-sync"
            )
        return PreparedCustom(url, state)
    source = _source(settings, url, None)
    log.info("initial sync of custom change source %s into %s", source.description, replica_file)
    try:
        state = await custom_initial_sync(
            source,
            replica_file,
            app_id=settings.app_id,
            shard_num=settings.shard_num,
            publications=sorted(settings.app_publications),
        )
    except (CustomSyncError, ChangeSourceError) as e:
        raise UpstreamSetupError(f"initial sync failed: {e}") from e
    return PreparedCustom(url, state)


def publications_mismatch(configured: list[str], synced: tuple[str, ...]) -> str | None:
    """zero's check on a later start (spec/source.md §4.2 item 5), or None if it passes.

    No configured publications accept any replica, as in zero (the source decides).
    """
    if not configured or sorted(configured) == sorted(synced):
        return None
    return (
        f"ZERO_APP_PUBLICATIONS {sorted(configured)} do not match the publications the "
        f"replica was synced with {sorted(synced)}"
    )


async def custom_service(
    settings: Settings,
    db: ChangeDb,
    prepared: PreparedCustom,
    *,
    address: str,
    backup_path: str | None = None,
) -> ReplicaRuntime:
    """Steps 2 and 3: the change DB tied to the replica, and the service over the source
    (``backup_path``: where this node backs up, under the backup URL)."""
    state = prepared.replica
    source = _source(settings, prepared.url, state)
    service = await service_over_replica(
        settings, db, source, state, state.publications, address=address, backup_path=backup_path
    )
    log.info(
        "replicating custom change source %s; replica %s at %s",
        source.description,
        state.replica_version,
        state.state_version,
    )
    return ReplicaRuntime(service=service, replica=state, replica_file=settings.replica_file)


def _source(settings: Settings, url: str, replica: ReplicaState | None) -> CustomChangeSource:
    # Streams ask for the publications the replica was synced with (as zero's do);
    # the initial sync, before there is a replica, for the configured ones.
    return CustomChangeSource(
        url,
        app_id=settings.app_id,
        shard_num=settings.shard_num,
        publications=sorted(replica.publications if replica else settings.app_publications),
        replica_version=replica.replica_version if replica else None,
    )
