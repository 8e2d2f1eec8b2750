"""``serve`` over a Postgres upstream: replica, slot, change DB and service, in order.

On start:

1. The replica file (``ZERO_REPLICA_FILE``). If it exists and its replica is still
   servable upstream (``replicas`` row synced, slot present and not invalidated,
   same publications), keep it. Otherwise — or when the change DB says a reset is
   required — delete it and run an initial sync (new slot, new replicaVersion).
   Without ``ZERO_AUTO_RESET`` a replica that cannot continue is an error instead.
2. The change DB is tied to the replica (``ensure_config``): a fresh replica resets
   the change log; a log that belongs to another replica that has moved on is an
   auto-reset.
3. The service streams from the replica's slot; a replica follower (a child process
   reading the change log) keeps the replica file current (it is what backups copy).

An auto-reset later (reset-required from the stream) stops the service; ``serve``
then builds everything again from step 1.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from app.config import Settings
from app.logs import redacted_conninfo
from app.replica.schema import ReplicaState, read_replica_state, remove_replica_files
from app.runtime.backups import RestoreError, restore_if_missing
from app.runtime.held_reservation import HeldReservation
from app.runtime.options import task_id
from app.runtime.replica_runtime import (
    ReplicaRuntime,
    UpstreamSetupError,
    service_over_replica,
)
from app.sources.postgres.conninfo import ConnectError, async_connect, parse_conninfo
from app.sources.postgres.errors import AutoResetRequired, ShardSetupError
from app.sources.postgres.initial_sync import DEFAULT_WORKERS, InitialSyncError, initial_sync
from app.sources.postgres.shard import ShardConfig
from app.sources.postgres.slots import (
    ReplicaRow,
    check_replica,
    failover_refusal,
    recorded_backup_path,
)
from app.sources.postgres.source import PostgresChangeSource, PostgresSourceOptions
from app.storage import (
    ChangeDb,
    Replication,
    ReplicationConfig,
)

__all__ = [
    "PostgresRuntime",
    "PreparedUpstream",
    "UpstreamSetupError",
    "owner_backup_path",
    "postgres_service",
    "prepare_upstream",
]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PostgresRuntime(ReplicaRuntime):
    slot: str = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class PreparedUpstream:
    """A replica that can stream: its state and the upstream row that serves it."""

    url: str
    shard: ShardConfig
    replica: ReplicaState
    row: ReplicaRow
    # A reservation on the previous owner after a restore: released once we own the log.
    held_reservation: HeldReservation | None = None
    # When the restore began (monotonic), if the replica was restored from the backup.
    restore_started: float | None = None


async def prepare_upstream(settings: Settings, db: ChangeDb) -> PreparedUpstream:
    """Steps 1 of the module docstring: a servable replica, synced now if needed."""
    upstream = settings.upstream_db
    if not upstream:
        raise UpstreamSetupError("ZERO_UPSTREAM_DB is not set")
    try:
        # Every upstream connection reads the string through conninfo, which
        # refuses what the replication client cannot honour: say so now, once.
        parse_conninfo(upstream)
    except ConnectError as e:
        raise UpstreamSetupError(f"upstream {redacted_conninfo(upstream)}: {e}") from e
    cfg = ShardConfig(
        app_id=settings.app_id,
        shard_num=settings.shard_num,
        publications=tuple(settings.app_publications),
    )
    if settings.upstream_pg_replication_slot_failover:
        await _check_failover(upstream)
    replication = Replication(db)
    existing = await replication.config()
    reset_required = existing is not None and existing.reset_required
    restore_started = time.monotonic()
    held, restored = (
        await _restore_if_missing(settings, replication, existing)
        if not reset_required
        else (None, False)
    )
    try:
        state, row = await _prepare_replica(
            upstream,
            cfg,
            settings.replica_file,
            auto_reset=settings.auto_reset,
            force=reset_required,
            sync=_sync_options(settings),
        )
    except (ShardSetupError, InitialSyncError, psycopg.Error) as e:
        raise UpstreamSetupError(f"upstream {redacted_conninfo(upstream)}: {e}") from e
    return PreparedUpstream(upstream, cfg, state, row, held, restore_started if restored else None)


async def postgres_service(
    settings: Settings,
    db: ChangeDb,
    prepared: PreparedUpstream,
    *,
    address: str,
    backup_path: str | None = None,
) -> PostgresRuntime:
    """Steps 2 and 3: the change DB tied to the replica, and the service over the slot.
    ``backup_path``: where this node backs up (under the backup URL), recorded in the
    replica's ``replicas`` row when it takes the slot over."""
    state, row = prepared.replica, prepared.row
    task = task_id(settings)
    source = PostgresChangeSource(
        prepared.url,
        PostgresSourceOptions(
            app_id=prepared.shard.app_id,
            shard_num=prepared.shard.shard_num,
            publications=tuple(row.publications),
            slot=row.slot,
            ddl_detection=row.ddl_detection,
            initial_schema=dict(row.initial_schema) if row.initial_schema is not None else None,
            replica_id=row.id,
            task_id=task,
            backup_path=backup_path,
            silence_timeout_s=(
                settings.upstream_pg_stream_inbound_timeout_ms / 1000
                if settings.upstream_pg_stream_inbound_timeout_ms is not None
                else None
            ),
        ),
        lag_report_interval_ms=settings.replication_lag_report_interval_ms,
    )
    restore_s = (
        time.monotonic() - prepared.restore_started if prepared.restore_started is not None else 0.0
    )
    service = await service_over_replica(
        settings,
        db,
        source,
        state,
        row.publications,
        address=address,
        restore_s=restore_s,
        backup_path=backup_path,
        task=task,
    )
    log.info(
        "replicating %s through slot %s; replica %s at %s",
        redacted_conninfo(prepared.url),
        row.slot,
        state.replica_version,
        state.state_version,
    )
    return PostgresRuntime(
        service=service, replica=state, replica_file=settings.replica_file, slot=row.slot
    )


@dataclass(frozen=True, slots=True)
class SyncOptions:
    """How an initial sync runs (its settings)."""

    workers: int = DEFAULT_WORKERS
    failover: bool = False


def _sync_options(settings: Settings) -> SyncOptions:
    workers = settings.initial_sync_table_copy_workers
    if workers > settings.upstream_max_conns:
        # Each copy worker holds an upstream connection for the whole copy.
        log.info(
            "initial sync copies with %d workers (ZERO_UPSTREAM_MAX_CONNS=%d caps "
            "ZERO_INITIAL_SYNC_TABLE_COPY_WORKERS=%d)",
            settings.upstream_max_conns,
            settings.upstream_max_conns,
            workers,
        )
        workers = settings.upstream_max_conns
    return SyncOptions(workers=workers, failover=settings.upstream_pg_replication_slot_failover)


async def _check_failover(upstream: str) -> None:
    """Failover slots need Postgres 17: refuse at once, not at the next initial sync."""
    try:
        async with await async_connect(upstream, autocommit=True) as conn:
            refusal = failover_refusal(conn.info.server_version)
    except psycopg.Error as e:
        raise UpstreamSetupError(f"upstream {redacted_conninfo(upstream)}: {e}") from e
    if refusal is not None:
        raise UpstreamSetupError(refusal)


async def _prepare_replica(
    upstream: str,
    cfg: ShardConfig,
    replica_file: Path,
    *,
    auto_reset: bool,
    force: bool,
    sync: SyncOptions | None = None,
) -> tuple[ReplicaState, ReplicaRow]:
    if await asyncio.to_thread(replica_file.exists):
        reason: str | None = "the change DB says a reset is required" if force else None
        if reason is None:
            state = read_replica_state(replica_file)
            try:
                row = await _check(upstream, cfg, state.replica_version)
            except AutoResetRequired as e:
                reason = str(e)
            else:
                if sorted(row.publications) == sorted(state.publications):
                    return state, row
                reason = (
                    f"the replica was synced for publications {sorted(state.publications)}, "
                    f"the shard now has {sorted(row.publications)}"
                )
        if not auto_reset:
            raise UpstreamSetupError(
                f"replica {replica_file} cannot continue ({reason}); enable ZERO_AUTO_RESET "
                "or delete the replica file to re-sync"
            )
        log.warning("replica %s cannot continue (%s): re-syncing it", replica_file, reason)
        remove_replica_files(replica_file)
    log.info("initial sync of %s into %s", redacted_conninfo(upstream), replica_file)
    sync = sync or SyncOptions()
    await initial_sync(upstream, cfg, replica_file, workers=sync.workers, failover=sync.failover)
    state = read_replica_state(replica_file)
    return state, await _check(upstream, cfg, state.replica_version)


async def _restore_if_missing(
    settings: Settings, replication: Replication, existing: ReplicationConfig | None
) -> tuple[HeldReservation | None, bool]:
    """A replacement node restores the backup instead of re-syncing (which would reset
    the change log every view-syncer follows). (The reservation held on the owner,
    whether the replica was restored.)"""
    state = await replication.state()
    owner = state.owner_address if state is not None and state.owner != settings.task_id else None
    version = existing.replica_version if existing is not None else None
    try:
        restored, held = await restore_if_missing(
            settings,
            replica_version=version,
            owner_address=owner,
            backup_path=(
                await owner_backup_path(settings, version)
                if not settings.replica_file.exists()
                else None
            ),
        )
    except RestoreError as e:
        if not settings.auto_reset:
            raise UpstreamSetupError(f"{e}; enable ZERO_AUTO_RESET to re-sync instead") from e
        log.warning("%s: re-syncing the replica from upstream instead (ZERO_AUTO_RESET)", e)
        return None, False
    return held, restored is not None


async def owner_backup_path(settings: Settings, replica_version: str | None) -> str | None:
    """Where the owner of the replica at ``replica_version`` (None: the newest) backs up,
    under ZERO_LITESTREAM_BACKUP_URL, as it recorded upstream when it took the slot
    over; None when nothing is recorded (then the URL itself holds the backup)."""
    if not settings.litestream_backup_url or not settings.upstream_db:
        return None
    cfg = ShardConfig(app_id=settings.app_id, shard_num=settings.shard_num, publications=())
    try:
        async with await async_connect(settings.upstream_db, autocommit=True) as conn:
            path = await recorded_backup_path(conn, cfg, replica_version)
    except (psycopg.Error, ConnectError) as e:
        raise UpstreamSetupError(f"upstream {redacted_conninfo(settings.upstream_db)}: {e}") from e
    if path is not None:
        log.info("the change log's owner backs up to %s", path)
    return path


async def _check(upstream: str, cfg: ShardConfig, replica_version: str) -> ReplicaRow:
    async with await async_connect(upstream, autocommit=True) as conn:
        return await check_replica(conn, cfg, replica_version)
