"""What ``/statz``'s ``upstream`` group shows of a Postgres upstream.

zero-cache's group counts the shard's replicas, the clients that sent mutations
and the mutations processed; this one adds what a replication-manager's operator
watches most: every replication slot of the shard, with the WAL it retains
(``pg_wal_lsn_diff`` of the server's current position against the slot's
``restart_lsn``: what Postgres must keep on disk for it) and what it has not
confirmed yet (against ``confirmed_flush_lsn``: how far acks lag). One short
connection per request, every statement bounded by a timeout.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from app.sources.postgres.shard import ShardConfig
from app.sources.postgres.slots import slot_name_prefix

__all__ = ["upstream_stats"]

STATEMENT_TIMEOUT_MS = 5000


async def upstream_stats(url: str, shard: ShardConfig) -> dict[str, Any]:
    schema = sql.Identifier(shard.shard_schema)
    async with await psycopg.AsyncConnection.connect(
        url,
        autocommit=True,
        connect_timeout=5,
        options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
    ) as conn:

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
        pattern = slot_name_prefix(shard).replace("_", "\\_") + "%"
        current = (
            "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() "
            "ELSE pg_current_wal_lsn() END"
        )
        rows = await (
            await conn.execute(
                f"""SELECT slot_name, active, restart_lsn::text, confirmed_flush_lsn::text,
                       pg_wal_lsn_diff({current}, restart_lsn)::bigint,
                       pg_wal_lsn_diff({current}, confirmed_flush_lsn)::bigint
                FROM pg_replication_slots WHERE slot_name LIKE %s ORDER BY slot_name""".encode(),
                [pattern],
            )
        ).fetchall()
        stats["slots"] = [
            {
                "name": name,
                "active": active,
                "restartLSN": restart,
                "confirmedFlushLSN": confirmed,
                "retainedWalBytes": retained,
                "unconfirmedWalBytes": unconfirmed,
            }
            for name, active, restart, confirmed, retained, unconfirmed in rows
        ]
        return stats
