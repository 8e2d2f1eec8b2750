"""What ``/statz``'s ``upstream`` group and ``/metrics`` show of a Postgres upstream.

zero-cache's group counts the shard's replicas, the clients that sent mutations
and the mutations processed; this one adds what a replication-manager's operator
watches most: every replication slot of the shard, with the WAL it retains
(``pg_wal_lsn_diff`` of the server's current position against the slot's
``restart_lsn``: what Postgres must keep on disk for it) and what it has not
confirmed yet (against ``confirmed_flush_lsn``: how far acks lag). One short
connection per request, every statement bounded by a timeout.

:class:`SlotWalProbe` reads the same per-slot WAL for the Prometheus gauges: off
the hot path (on scrape), bounded by a timeout, and cached for a few seconds with
concurrent scrapes sharing one query, so a scrape storm costs Postgres at most one
query per ``ttl_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from psycopg import sql

from app.sources.postgres.conninfo import async_connect
from app.sources.postgres.shard import ShardConfig
from app.sources.postgres.slots import slot_name_prefix
from app.timeouts import within

__all__ = ["SlotWal", "SlotWalProbe", "slot_wal", "upstream_stats"]

log = logging.getLogger(__name__)

STATEMENT_TIMEOUT_MS = 5000
# The WAL gauges: a reading is reused this long, and one may take this long.
WAL_TTL_S: Final = 5.0
WAL_TIMEOUT_S: Final = 3.0


@dataclass(frozen=True, slots=True)
class SlotWal:
    name: str
    active: bool
    restart_lsn: str | None
    confirmed_flush_lsn: str | None
    retained_wal_bytes: int | None  # None: the slot has no restart_lsn (invalidated)
    unconfirmed_wal_bytes: int | None


async def _connect(url: str, timeout_s: float) -> psycopg.AsyncConnection[Any]:
    return await async_connect(
        url,
        autocommit=True,
        connect_timeout=max(1, int(timeout_s)),
        options=f"-c statement_timeout={int(timeout_s * 1000)}",
    )


async def slot_wal(conn: psycopg.AsyncConnection[Any], shard: ShardConfig) -> list[SlotWal]:
    """Every slot of the shard with the WAL it retains and has not confirmed."""
    pattern = slot_name_prefix(shard).replace("_", "\\_") + "%"
    current = (
        "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END"
    )
    cur = await conn.execute(
        f"""SELECT slot_name, active, restart_lsn::text, confirmed_flush_lsn::text,
               pg_wal_lsn_diff({current}, restart_lsn)::bigint,
               pg_wal_lsn_diff({current}, confirmed_flush_lsn)::bigint
        FROM pg_replication_slots WHERE slot_name LIKE %s ORDER BY slot_name""".encode(),
        [pattern],
    )
    return [SlotWal(*row) for row in await cur.fetchall()]


async def upstream_stats(url: str, shard: ShardConfig) -> dict[str, Any]:
    schema = sql.Identifier(shard.shard_schema)
    async with await _connect(url, STATEMENT_TIMEOUT_MS / 1000) as conn:

        async def one(query: sql.Composed) -> Any:
            row = await (await conn.execute(query)).fetchone()
            return None if row is None else row[0]

        stats: dict[str, Any] = {
            "type": "pg",
            "numReplicas": await one(sql.SQL('SELECT COUNT(*) FROM {}."replicas"').format(schema)),
            "numClientsWithMutations": await one(
                sql.SQL('SELECT COUNT(*) FROM {}."clients"').format(schema)
            ),
            "numMutationsProcessed": await one(
                sql.SQL('SELECT SUM("lastMutationID") FROM {}."clients"').format(schema)
            ),
        }
        stats["slots"] = [
            {
                "name": s.name,
                "active": s.active,
                "restartLSN": s.restart_lsn,
                "confirmedFlushLSN": s.confirmed_flush_lsn,
                "retainedWalBytes": s.retained_wal_bytes,
                "unconfirmedWalBytes": s.unconfirmed_wal_bytes,
            }
            for s in await slot_wal(conn, shard)
        ]
        return stats


class SlotWalProbe:
    """The shard's slots' WAL for ``/metrics``, read at most once per ``ttl_s``."""

    def __init__(
        self,
        url: str,
        shard: ShardConfig,
        *,
        ttl_s: float = WAL_TTL_S,
        timeout_s: float = WAL_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._url = url
        self._shard = shard
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._cached: tuple[float, list[SlotWal] | None] | None = None
        self.queries = 0  # how many readings went to Postgres

    async def read(self) -> list[SlotWal] | None:
        """The slots (None: the reading failed; a failure is cached too, so an
        unreachable upstream is not asked again on every scrape)."""
        async with self._lock:  # concurrent scrapes share one query
            cached = self._cached
            if cached is not None and self._clock() - cached[0] < self._ttl_s:
                return cached[1]
            self.queries += 1
            try:
                slots: list[SlotWal] | None = await within(self._query(), self._timeout_s)
            except Exception as e:
                log.warning("metrics: reading the replication slots' WAL failed: %r", e)
                slots = None
            self._cached = (self._clock(), slots)
            return slots

    async def _query(self) -> list[SlotWal]:
        async with await _connect(self._url, self._timeout_s) as conn:
            return await slot_wal(conn, self._shard)
