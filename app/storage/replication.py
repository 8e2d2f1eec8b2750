"""Replication state and config: which replica the log belongs to, who owns it.

``replicationConfig`` ties the change log to one replica (``replicaVersion``,
``publications``) and carries the ``resetRequired`` flag. ``replicationState``
holds the durable head (``lastWatermark``) and the single writer (``owner``,
``ownerAddress`` — the latter is how view-syncers discover the streamer).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, select, text, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from app.stop_signals import AutoResetSignal
from app.storage.backfill import backfill_requests
from app.storage.engine import APPLICATION_NAME, ChangeDb
from app.storage.tables import (
    backfilling,
    change_log,
    replication_config,
    replication_state,
    table_metadata,
)

log = logging.getLogger(__name__)

# How long a reset waits for other change-streamer sessions that hold locks on
# the change log before it terminates them (the reference's value).
TRUNCATE_LOCK_TIMEOUT_S = 5.0

# Truncation order = the storer's lock order (state row first, then the log), so
# a reset and a storer transaction cannot deadlock.
_TRUNCATE_ORDER = (replication_state, change_log, replication_config, table_metadata, backfilling)


@dataclass(frozen=True, slots=True)
class ReplicationConfig:
    replica_version: str
    publications: tuple[str, ...]
    reset_required: bool


@dataclass(frozen=True, slots=True)
class ReplicationState:
    last_watermark: str
    owner: str | None
    owner_address: str | None


@dataclass(frozen=True, slots=True)
class ChangeLogState:
    replica_version: str
    min_watermark: str


@dataclass(frozen=True, slots=True)
class StartParameters:
    """What a new upstream stream starts from, read in one snapshot."""

    last_watermark: str
    backfill_requests: list[dict[str, Any]]
    owner: str | None  # who owns the change log as of this snapshot


@dataclass(frozen=True, slots=True)
class SubscriptionState:
    """The local replica's identity and position."""

    replica_version: str
    publications: tuple[str, ...]
    watermark: str


class Replication:
    """Reads and writes ``replicationConfig`` and ``replicationState``."""

    def __init__(self, db: ChangeDb) -> None:
        self._db = db

    async def ensure_config(
        self, replica: SubscriptionState, *, auto_reset: bool
    ) -> ReplicationConfig:
        """Ties the change log to ``replica``, initializing or resetting it (core.md §5.4).

        * Empty: write the config, ``lastWatermark = replicaVersion`` and the two seed
          rows that make the replica version a resumable point.
        * Another replica version or publication set: if the replica is still at its
          replica version (freshly synced), wipe the five tables and start over;
          otherwise raise ``AutoResetSignal``.
        * ``resetRequired``: raise ``AutoResetSignal`` if ``auto_reset``, else log.
        """
        async with self._db.writer.connect() as conn, conn.begin():
            row = (await conn.execute(select(replication_config))).mappings().first()
            if row is not None and (
                row["replicaVersion"] != replica.replica_version
                or sorted(row["publications"]) != sorted(replica.publications)
            ):
                if replica.replica_version != replica.watermark:
                    raise AutoResetSignal(
                        f"Cannot reset change db@{row['replicaVersion']} to service "
                        f"replica@{replica.replica_version} from watermark {replica.watermark}"
                    )
                log.info(
                    "change log belongs to replica %s %s; resetting it for replica %s %s",
                    row["replicaVersion"],
                    list(row["publications"]),
                    replica.replica_version,
                    list(replica.publications),
                )
                await self._truncate_all(conn)
                row = None
            if row is None:
                await self._initialize(conn, replica)
                return ReplicationConfig(
                    replica.replica_version, tuple(sorted(replica.publications)), False
                )
            config = ReplicationConfig(
                row["replicaVersion"], tuple(row["publications"]), bool(row["resetRequired"])
            )
        if config.reset_required:
            if auto_reset:
                raise AutoResetSignal("reset required by replication stream")
            log.error(
                "The replication stream asked for a reset (resetRequired is set) but "
                "auto-reset is off: resync the replica by hand"
            )
        return config

    async def _initialize(self, conn: AsyncConnection, replica: SubscriptionState) -> None:
        version = replica.replica_version
        await conn.execute(
            insert(replication_config).values(
                replicaVersion=version,
                publications=sorted(replica.publications),
                resetRequired=None,
                lock=1,
            )
        )
        await conn.execute(
            insert(replication_state).values(
                lastWatermark=version, owner=None, ownerAddress=None, lock=1
            )
        )
        await conn.execute(
            insert(change_log),
            [
                {"watermark": version, "pos": 0, "change": '{"tag":"begin"}', "precommit": None},
                {"watermark": version, "pos": 1, "change": '{"tag":"commit"}', "precommit": None},
            ],
        )

    async def _truncate_all(self, conn: AsyncConnection) -> None:
        if self._db.dialect == "sqlite":
            # The writer holds SQLite's write lock: nobody else is in a write.
            for table in _TRUNCATE_ORDER:
                await conn.exec_driver_sql(f"DELETE FROM {self._db.table_name(table.name)}")
            return
        names = ", ".join(self._db.table_name(t.name) for t in _TRUNCATE_ORDER)
        timeout_ms = int(TRUNCATE_LOCK_TIMEOUT_S * 1000)
        await conn.exec_driver_sql(f"SET LOCAL lock_timeout = {timeout_ms}")
        savepoint = await conn.begin_nested()
        try:
            await conn.exec_driver_sql(f"TRUNCATE {names}")
            await savepoint.commit()
            return
        except DBAPIError as e:
            await savepoint.rollback()
            if getattr(e.orig, "sqlstate", None) != "55P03":
                raise
        terminated = await self._terminate_lock_holders(conn)
        log.warning("terminated change-streamer sessions %s that blocked the reset", terminated)
        await conn.exec_driver_sql(f"TRUNCATE {names}")

    async def _terminate_lock_holders(self, conn: AsyncConnection) -> list[int]:
        """Ends other change-streamer sessions holding locks on this shard's tables."""
        rows = await conn.execute(
            text(
                """
                SELECT DISTINCT l.pid, pg_terminate_backend(l.pid)
                  FROM pg_locks l
                  JOIN pg_class c ON c.oid = l.relation
                  JOIN pg_namespace n ON n.oid = c.relnamespace
                  JOIN pg_stat_activity a ON a.pid = l.pid
                 WHERE n.nspname = :schema AND l.granted
                   AND a.application_name = :app AND l.pid <> pg_backend_pid()
                """
            ),
            {"schema": self._db.schema, "app": APPLICATION_NAME},
        )
        pids = [int(pid) for pid, _ in rows]
        # pg_terminate_backend only signals; give the backends a moment to exit and
        # release their locks.
        await asyncio.sleep(0.1)
        return pids

    async def assume_ownership(self, owner: str, address: str | None) -> str:
        """Makes ``owner`` the single writer; waits for an open storer transaction.

        Returns ``lastWatermark`` as of the takeover: the previous owner can store
        nothing after it, so this is where the change log really ends.
        """
        async with self._db.writer.connect() as conn, conn.begin():
            await conn.execute(update(replication_state).values(owner=owner, ownerAddress=address))
            last = await conn.scalar(select(replication_state.c.lastWatermark))
        return str(last)

    async def set_reset_required(self) -> None:
        async with self._db.writer.connect() as conn, conn.begin():
            await conn.execute(update(replication_config).values(resetRequired=True))

    async def config(self) -> ReplicationConfig | None:
        async with self._db.reader.connect() as conn:
            row = (await conn.execute(select(replication_config))).mappings().first()
        if row is None:
            return None
        return ReplicationConfig(
            row["replicaVersion"], tuple(row["publications"]), bool(row["resetRequired"])
        )

    async def state(self) -> ReplicationState | None:
        async with self._db.reader.connect() as conn:
            row = (await conn.execute(select(replication_state))).mappings().first()
        if row is None:
            return None
        return ReplicationState(row["lastWatermark"], row["owner"], row["ownerAddress"])

    async def start_parameters(self) -> StartParameters:
        """``lastWatermark`` and pending backfills, from one snapshot."""
        async with self._db.reader.connect() as conn, conn.begin():
            if self._db.dialect == "postgresql":
                await conn.exec_driver_sql(
                    "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"
                )
            row = (
                await conn.execute(
                    select(replication_state.c.lastWatermark, replication_state.c.owner)
                )
            ).first()
            if row is None or row[0] is None:
                raise RuntimeError("the change DB is not initialized (no replicationState row)")
            return StartParameters(row[0], await backfill_requests(conn), row[1])

    async def change_log_state(self) -> ChangeLogState:
        """The replica version and the oldest watermark a subscriber can resume from."""
        async with self._db.reader.connect() as conn:
            version = await conn.scalar(select(replication_config.c.replicaVersion))
            minimum = await conn.scalar(select(func.min(change_log.c.watermark)))
        if version is None:
            raise RuntimeError("the change DB is not initialized (no replicationConfig row)")
        if minimum is None:
            log.warning("the change log is empty; reporting the replica version as its minimum")
            minimum = version
        return ChangeLogState(version, minimum)

    async def last_watermark_from_log(self) -> str:
        """The newest watermark in the log, else the replica version."""
        async with self._db.reader.connect() as conn:
            newest = await conn.scalar(select(func.max(change_log.c.watermark)))
            if newest is not None:
                return str(newest)
            version = await conn.scalar(select(replication_config.c.replicaVersion))
        if version is None:
            raise RuntimeError("the change DB is not initialized (no replicationConfig row)")
        return str(version)
