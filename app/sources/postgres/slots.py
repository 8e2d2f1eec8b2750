"""Replication slots and the ``replicas`` rows that claim them (spec/source.md §5.2, §6.1).

A replica is tied to one logical slot ``{app}_{shard}_{suffix}`` (suffix from the pool
``a, b, …, z, aa, …``) through a row of ``{app}_{shard}.replicas``. Slot names are
picked, and unclaimed slots dropped, only under one advisory lock per shard, so a
starting initial sync and a running change source never fight over a slot:

* :func:`create_replication_slot` creates the slot (exporting a snapshot) and inserts
  its ``replicas`` row while holding the lock;
* :func:`record_initial_sync` marks the replica usable once the copy is done;
* :func:`check_replica` is the start-up check of a replica that already exists;
* :func:`record_takeover` writes, when a node takes the slot over, the row's
  ``subscriberContext`` (as zero does): the node's task and the sub-path it backs up
  to (``app/backup/destinations.py``), which :func:`recorded_backup_path` reads for
  a node that restores;
* :func:`drop_unclaimed_slots`, :func:`drop_slot` clean up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql as pgsql

from app.protocol import canonical_json
from app.protocol.lexi import lsn_to_watermark
from app.sources.postgres.conninfo import ConnectError, async_connect
from app.sources.postgres.errors import AutoResetRequired, SlotCreationError
from app.sources.postgres.published import PublishedSchema
from app.sources.postgres.shard import ShardConfig, drop_shard
from app.timeouts import within

__all__ = [
    "CREATE_SLOT_TIMEOUT_S",
    "CreatedSlot",
    "ReplicaRow",
    "SlotHealth",
    "check_replica",
    "create_replication_slot",
    "drop_old_replicas_and_slots",
    "drop_slot",
    "drop_unclaimed_slots",
    "failover_refusal",
    "record_initial_sync",
    "record_takeover",
    "recorded_backup_path",
    "slot_health",
    "slot_name_prefix",
    "slot_pool_suffix",
    "slot_status",
]

log = logging.getLogger(__name__)

# CREATE_REPLICATION_SLOT waits for every running transaction to end, which can take
# arbitrarily long; bound it so a stuck upstream surfaces as an error. The server-side
# lock_timeout fires a second earlier so Postgres ends the walsender itself rather than
# leaving an orphan that pins WAL with an active (undroppable) slot.
CREATE_SLOT_TIMEOUT_S: Final = 30.0

_DROP_ATTEMPTS: Final = 100  # x 20 ms: a terminated walsender normally exits in a few ms
_DROP_RETRY_S: Final = 0.02

_ALPHABET: Final = "abcdefghijklmnopqrstuvwxyz"

# CREATE_REPLICATION_SLOT … (FAILOVER) exists from this server_version_num on.
FAILOVER_MIN_VERSION: Final = 170000


def failover_refusal(server_version: int) -> str | None:
    """Why a failover slot cannot be made on this server (``server_version_num``), or None.

    zero ignores the setting before Postgres 17; refusing instead tells the operator
    that the slot they count on for failover would not be one.
    """
    if server_version >= FAILOVER_MIN_VERSION:
        return None
    return (
        "ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER needs Postgres 17 or later; the upstream "
        f"is Postgres {_version_text(server_version)} (unset the setting, or upgrade)"
    )


def _version_text(server_version: int) -> str:
    if server_version >= 100000:
        return f"{server_version // 10000}.{server_version % 10000}"
    return f"{server_version // 10000}.{server_version // 100 % 100}.{server_version % 100}"


def slot_pool_suffix(n: int) -> str:
    """The n-th (0-based) suffix: a..z, aa..az, ba.. (letters, unlike the numeric shard)."""
    if n < 0:
        raise ValueError(f"negative slot pool index {n}")
    n += 1
    suffix = ""
    while n > 0:
        n -= 1
        suffix = _ALPHABET[n % 26] + suffix
        n //= 26
    return suffix


def slot_name_prefix(cfg: ShardConfig) -> str:
    return f"{cfg.shard_schema}_"


def _slot_like_pattern(cfg: ShardConfig) -> str:
    # "_" is a LIKE wildcard; escape it so zero_1_% does not match zero_10_a.
    return slot_name_prefix(cfg).replace("_", "\\_") + "%"


def _lock_name(cfg: ShardConfig) -> str:
    return f"replication-slot-management:{cfg.shard_schema}"


def _replicas(cfg: ShardConfig) -> str:
    return pgsql.Identifier(cfg.shard_schema, "replicas").as_string()


@dataclass(slots=True)
class CreatedSlot:
    """A new slot and its ``replicas`` row.

    ``replication_conn`` is the still-open replication connection that created the
    slot: the exported ``snapshot_name`` stays valid only while it is open and idle.
    Close it (:meth:`close`) once every snapshot import has started.
    """

    slot_name: str
    consistent_point: str
    snapshot_name: str
    replica_version: str
    replica_id: str
    replication_conn: psycopg.AsyncConnection[Any]

    async def close(self) -> None:
        await self.replication_conn.close()


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """A ``replicas`` row joined with the shard config, as the change source needs it."""

    id: str
    rank: int
    slot: str
    version: str
    initial_schema: PublishedSchema | None
    initial_sync_context: dict[str, Any] | None
    subscriber_context: dict[str, Any] | None
    publications: list[str]
    ddl_detection: bool


SlotStatus = Literal["ok", "unreserved", "lost", "missing", "unknown"]


@dataclass(frozen=True, slots=True)
class SlotHealth:
    status: SlotStatus
    restart_lsn: str | None = None
    wal_status: str | None = None
    retained_wal_bytes: float | None = None
    safe_wal_bytes: float | None = None


# --- creation --------------------------------------------------------------------------


async def create_replication_slot(
    conninfo: str,
    cfg: ShardConfig,
    *,
    replica_id: str | None = None,
    timeout_s: float = CREATE_SLOT_TIMEOUT_S,
    failover: bool = False,
) -> CreatedSlot:
    """Create the shard's next slot (``pgoutput``, exported snapshot) and its replicas row.

    ``replica_id`` defaults to the current epoch milliseconds as a string. Retries once
    after granting the REPLICATION attribute (42501) or after deleting replicas of
    inactive slots (53400, too many slots). The shard must be set up. ``failover``
    makes a failover slot (Postgres 17+; :class:`SlotCreationError` before that).
    """
    replica_id = replica_id or str(int(time.time() * 1000))
    conn = await async_connect(conninfo, autocommit=True)
    repl: psycopg.AsyncConnection[Any] | None = None
    try:
        refusal = failover_refusal(conn.info.server_version) if failover else None
        if refusal is not None:
            raise SlotCreationError(refusal)
        repl = await async_connect(conninfo, replication="database", autocommit=True)
        for first in (True, False):
            await drop_unclaimed_slots(conn, cfg)
            try:
                return await _create_claimed_slot(conn, repl, cfg, replica_id, timeout_s, failover)
            except pgerrors.InsufficientPrivilege:
                if not first:
                    raise
                # Some hosts (e.g. Cloud SQL) need the attribute, and only a normal
                # connection can grant it.
                await conn.execute("ALTER ROLE current_user WITH REPLICATION")
                log.info("added the REPLICATION attribute to the database user")
            except pgerrors.ConfigurationLimitExceeded:
                if not first:
                    raise
                log.warning("reached max_replication_slots; deleting replicas of inactive slots")
                await conn.execute(
                    f"""DELETE FROM {_replicas(cfg)} AS r USING pg_replication_slots s
                          WHERE r.slot = s.slot_name AND s.database = current_database()
                            AND NOT s.active""".encode()
                )
        raise AssertionError("unreachable")
    except BaseException:
        if repl is not None:
            await repl.close()
        raise
    finally:
        await conn.close()


async def _create_claimed_slot(
    conn: psycopg.AsyncConnection[Any],
    repl: psycopg.AsyncConnection[Any],
    cfg: ShardConfig,
    replica_id: str,
    timeout_s: float,
    failover: bool,
) -> CreatedSlot:
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [_lock_name(cfg)])
        cur = await conn.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE %s",
            [_slot_like_pattern(cfg)],
        )
        in_use = {r[0] for r in await cur.fetchall()}
        n = 0
        while f"{slot_name_prefix(cfg)}{slot_pool_suffix(n)}" in in_use:
            n += 1
        name = f"{slot_name_prefix(cfg)}{slot_pool_suffix(n)}"

        # This transaction has no xid yet (no writes so far), so the slot's snapshot
        # builder does not wait for it; the replicas row is written only afterwards.
        slot_name, consistent_point, snapshot_name = await _create_slot(
            repl, name, timeout_s, failover
        )
        version = lsn_to_watermark(consistent_point)
        await conn.execute(
            f"INSERT INTO {_replicas(cfg)} (id, slot, version) VALUES (%s, %s, %s)".encode(),
            [replica_id, slot_name, version],
        )
    log.info("created replication slot %s at %s", slot_name, consistent_point)
    return CreatedSlot(slot_name, consistent_point, snapshot_name, version, replica_id, repl)


async def _create_slot(
    repl: psycopg.AsyncConnection[Any], name: str, timeout_s: float, failover: bool = False
) -> tuple[str, str, str]:
    # Replication connections only speak the simple query protocol: no parameters.
    # ``name`` is built from a checked app ID, a number and letters.
    lock_timeout_ms = int(max(timeout_s - 1.0, timeout_s / 2) * 1000)  # 29 s for 30 s
    await repl.execute(f"SET lock_timeout = {lock_timeout_ms}".encode())
    # Without options PG15 exports a snapshot (EXPORT_SNAPSHOT is the default).
    command = pgsql.SQL("CREATE_REPLICATION_SLOT {} LOGICAL pgoutput").format(
        pgsql.Identifier(name)
    )
    if failover:
        # The option list (Postgres 15+ syntax) says what the old form implied: export
        # the snapshot the copy reads.
        command = pgsql.SQL("{} (SNAPSHOT 'export', FAILOVER true)").format(command)
    try:
        cur = await within(repl.execute(command), timeout_s)
    except TimeoutError as e:
        raise SlotCreationError(
            f"Timed out after {timeout_s:g} s creating replication slot {name}"
        ) from e
    except pgerrors.LockNotAvailable as e:
        raise SlotCreationError(
            f"Timed out waiting for running transactions while creating replication slot "
            f"{name}: {e}"
        ) from e
    row = await cur.fetchone()
    if row is None:
        raise SlotCreationError(f"CREATE_REPLICATION_SLOT {name} returned no row")
    slot_name, consistent_point, snapshot_name = str(row[0]), str(row[1]), row[2]
    if snapshot_name is None:
        raise SlotCreationError(f"replication slot {name} exported no snapshot")
    return slot_name, consistent_point, str(snapshot_name)


async def record_initial_sync(
    conn: psycopg.AsyncConnection[Any],
    cfg: ShardConfig,
    replica_id: str,
    initial_schema: PublishedSchema,
    context: dict[str, Any],
) -> None:
    """Store the schema the replica was synced with; the replica is usable from now on."""
    synced = {"tables": initial_schema["tables"], "indexes": initial_schema["indexes"]}
    cur = await conn.execute(
        f"""UPDATE {_replicas(cfg)} SET "initialSchema" = %s::json,
              "initialSyncContext" = %s::json WHERE id = %s""".encode(),
        [canonical_json.dumps(synced), canonical_json.dumps(context), replica_id],
    )
    if cur.rowcount != 1:
        raise AutoResetRequired(f"replica {replica_id} is no longer registered upstream")


# --- the owner's backups -----------------------------------------------------------------


async def record_takeover(
    conn: psycopg.AsyncConnection[Any],
    cfg: ShardConfig,
    replica_id: str,
    *,
    task_id: str,
    backup_path: str | None,
) -> None:
    """Records the node that took the replica's slot over, and where it backs up.

    zero-cache 1.9.0 writes its server context into ``subscriberContext`` here too
    (and reads it only for its logs); newer versions keep the backup's sub-path in a
    column of its own, which this shard's schema (v23) does not have.
    """
    context: dict[str, Any] = {"taskID": task_id}
    if backup_path is not None:
        context["backupPath"] = backup_path
    await conn.execute(
        f'UPDATE {_replicas(cfg)} SET "subscriberContext" = %s::json WHERE id = %s'.encode(),
        [canonical_json.dumps(context), replica_id],
    )


async def recorded_backup_path(
    conn: psycopg.AsyncConnection[Any], cfg: ShardConfig, replica_version: str | None
) -> str | None:
    """The backup sub-path the newest synced replica's owner recorded (at
    ``replica_version`` if given), or None: none recorded, no such replica."""
    try:
        cur = await conn.execute(
            f"""SELECT "subscriberContext"::text FROM {_replicas(cfg)}
                  WHERE "initialSyncContext" IS NOT NULL AND (%s::text IS NULL OR version = %s)
                  ORDER BY rank DESC LIMIT 1""".encode(),
            [replica_version, replica_version],
        )
    except pgerrors.UndefinedTable:  # no shard set up yet
        return None
    row = await cur.fetchone()
    context = _json_or_none(row[0]) if row is not None else None
    path = context.get("backupPath") if isinstance(context, dict) else None
    return path if isinstance(path, str) and path else None


# --- checks ----------------------------------------------------------------------------


async def check_replica(
    conn: psycopg.AsyncConnection[Any], cfg: ShardConfig, replica_version: str
) -> ReplicaRow:
    """The replica at ``replica_version`` and proof its slot can still serve it.

    Raises :class:`AutoResetRequired` if there is no initialized replica at that
    version, the requested publications changed (the shard is dropped first, as the
    reference does, so the next initial sync sets it up for the new ones), a
    publication is gone, or the slot is missing or invalidated.
    """
    replica = await _replica_at_version(conn, cfg, replica_version)
    if replica is None:
        raise AutoResetRequired(f"No replication slot for replica at version {replica_version}")

    internal_prefix = f"_{cfg.app_id}_"
    requested = sorted(cfg.publications)
    replicated = sorted(p for p in replica.publications if not p.startswith(internal_prefix))
    if requested != replicated:
        log.warning("dropping shard %s to change publications to %s", cfg.shard_schema, requested)
        await drop_shard(conn, cfg.app_id, cfg.shard_num)
        raise AutoResetRequired(
            f"Requested publications [{','.join(requested)}] do not match configured "
            f"publications: [{','.join(replicated)}]"
        )
    cur = await conn.execute(
        "SELECT pubname FROM pg_publication WHERE pubname = ANY(%s)", [replica.publications]
    )
    exists = [r[0] for r in await cur.fetchall()]
    if len(exists) != len(replica.publications):
        raise AutoResetRequired(
            f"Upstream publications [{','.join(exists)}] do not contain all subscribed "
            f"publications [{','.join(replica.publications)}]"
        )

    health = await slot_health(conn, replica.slot)
    if health.status == "missing":
        raise AutoResetRequired(f"replication slot {replica.slot} is missing")
    if health.status == "lost":
        raise AutoResetRequired(
            f"replication slot {replica.slot} has been invalidated for exceeding the "
            "max_slot_wal_keep_size"
        )
    return replica


async def _replica_at_version(
    conn: psycopg.AsyncConnection[Any], cfg: ShardConfig, version: str
) -> ReplicaRow | None:
    config = pgsql.Identifier(cfg.shard_schema, "shardConfig").as_string()
    cur = await conn.execute(
        f"""SELECT r.id, r.rank, r.slot, r.version, r."initialSchema"::text,
                   r."initialSyncContext"::text, r."subscriberContext"::text,
                   c.publications, c."ddlDetection"
              FROM {_replicas(cfg)} r JOIN {config} c ON true
              WHERE r.version = %s AND r."initialSyncContext" IS NOT NULL
              ORDER BY r.rank DESC LIMIT 1""".encode(),
        [version],
    )
    row = await cur.fetchone()
    if row is None:
        return None
    return ReplicaRow(
        id=row[0],
        rank=int(row[1]),
        slot=row[2],
        version=row[3],
        initial_schema=_json_or_none(row[4]),
        initial_sync_context=_json_or_none(row[5]),
        subscriber_context=_json_or_none(row[6]),
        publications=list(row[7]),
        ddl_detection=bool(row[8]),
    )


def _json_or_none(text: str | None) -> Any:
    return None if text is None else canonical_json.loads(text)


async def slot_health(conn: psycopg.AsyncConnection[Any], slot: str) -> SlotHealth:
    """The slot's WAL status: ``lost`` once invalidated (``restart_lsn`` gone)."""
    cur = await conn.execute(
        """SELECT restart_lsn::text, wal_status,
                  CASE WHEN restart_lsn IS NULL THEN NULL
                       ELSE pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::float8 END,
                  safe_wal_size::float8
             FROM pg_replication_slots WHERE slot_name = %s""",
        [slot],
    )
    row = await cur.fetchone()
    if row is None:
        return SlotHealth("missing")
    restart_lsn, wal_status, retained, safe = row
    return SlotHealth(slot_status(restart_lsn, wal_status), restart_lsn, wal_status, retained, safe)


def slot_status(restart_lsn: str | None, wal_status: str | None) -> SlotStatus:
    """A present slot's status from its ``pg_replication_slots`` columns."""
    if restart_lsn is None or wal_status == "lost":
        return "lost"
    if wal_status in ("reserved", "extended"):
        return "ok"
    if wal_status == "unreserved":
        return "unreserved"
    return "unknown"


# --- cleanup ---------------------------------------------------------------------------


async def drop_unclaimed_slots(
    conn: psycopg.AsyncConnection[Any], cfg: ShardConfig
) -> tuple[int, int, int]:
    """Drop the shard's inactive slots that no replicas row claims.

    Only this database's: slot names are the cluster's, but another database's
    slots are claimed by that database's ``replicas`` rows, which this one cannot
    see (the same app in two databases of one cluster, or two test runs).

    Returns ``(dropped, active, draining)``: ``active`` slots belong to a replica,
    ``draining`` ones to none but are still in use (retry later).
    """
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [_lock_name(cfg)])
        cur = await conn.execute(
            f"""SELECT slot_name, pg_drop_replication_slot(slot_name)
                  FROM pg_replication_slots LEFT JOIN {_replicas(cfg)} r ON slot_name = r.slot
                  WHERE slot_name LIKE %s AND database = current_database()
                    AND NOT active AND r.id IS NULL""".encode(),
            [_slot_like_pattern(cfg)],
        )
        dropped = [r[0] for r in await cur.fetchall()]
        if dropped:
            log.info("dropped inactive replication slots %s", dropped)
        cur = await conn.execute(
            f"""SELECT r.id FROM pg_replication_slots
                  LEFT JOIN {_replicas(cfg)} r ON slot_name = r.slot
                  WHERE slot_name LIKE %s AND database = current_database()""".encode(),
            [_slot_like_pattern(cfg)],
        )
        owners: Sequence[tuple[str | None]] = await cur.fetchall()
    active = sum(1 for (owner,) in owners if owner is not None)
    return len(dropped), active, len(owners) - active


async def drop_old_replicas_and_slots(
    conn: psycopg.AsyncConnection[Any], cfg: ShardConfig, current_replica_id: str
) -> tuple[list[str], int]:
    """Forget the replicas older than the current one and drop their inactive slots.

    After a re-sync the previous replica's row still claims its slot, which would pin
    WAL on the upstream for ever. Returns ``(dropped slot names, still active)``; an
    active one (an old process still streaming) is left for a later call.
    """
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [_lock_name(cfg)])
        cur = await conn.execute(
            f"""SELECT r.id, r.slot, s.active FROM {_replicas(cfg)} r
                  LEFT JOIN pg_replication_slots s ON s.slot_name = r.slot
                  WHERE r.rank < (SELECT rank FROM {_replicas(cfg)} WHERE id = %s)""".encode(),
            [current_replica_id],
        )
        old = await cur.fetchall()
        dropped: list[str] = []
        active = 0
        cur = await conn.execute(
            f"""SELECT slot FROM {_replicas(cfg)}
                  WHERE rank >= (SELECT rank FROM {_replicas(cfg)} WHERE id = %s)""".encode(),
            [current_replica_id],
        )
        # A slot name is reused once its slot is gone: never drop one a newer replica uses.
        in_use = {slot for (slot,) in await cur.fetchall()}
        for replica_id, slot, is_active in old:
            if is_active and slot not in in_use:
                active += 1
                continue
            if is_active is not None and slot not in in_use:  # exists and is idle
                await conn.execute("SELECT pg_drop_replication_slot(%s)", [slot])
                dropped.append(slot)
            await conn.execute(f"DELETE FROM {_replicas(cfg)} WHERE id = %s".encode(), [replica_id])
    if dropped:
        log.info("dropped the replication slots of older replicas: %s", dropped)
    return dropped, active


async def drop_slot(conninfo: str, slot_name: str) -> bool:
    """Best effort: end whatever backend holds ``slot_name``, then drop it.

    Returns whether the slot is gone; failures are logged, never raised (this runs on
    error paths where the original error matters more).
    """
    try:
        async with await async_connect(conninfo, autocommit=True) as conn:
            for _ in range(_DROP_ATTEMPTS):
                cur = await conn.execute(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                    [slot_name],
                )
                row = await cur.fetchone()
                if row is None:
                    return True
                if row[0] is not None:
                    await conn.execute("SELECT pg_terminate_backend(%s)", [row[0]])
                try:
                    await conn.execute("SELECT pg_drop_replication_slot(%s)", [slot_name])
                    return True
                except pgerrors.UndefinedObject:
                    return True
                except pgerrors.ObjectInUse:
                    # The terminated walsender has not exited yet.
                    await asyncio.sleep(_DROP_RETRY_S)
            log.warning("replication slot %s is still in use; not dropped", slot_name)
            return False
    except (psycopg.Error, ConnectError) as e:
        log.warning("unable to drop replication slot %s: %s", slot_name, e)
        return False
