"""The replica follower's apply path in one process: change-log rows → replica file.

    .venv/bin/python -m bench.follower [--transactions 20000] [--rows 1,100] [--repeat 5]

What ``serve``'s follower child does per batch (``app.runtime.log_follower``):
``messages_from_rows`` on a batch of stored rows, then ``Replicator.apply_batch``
into a real replica file (synchronous=FULL, one SQLite commit per batch). The rows
are shaped as the Postgres source stores them (``json: "s"`` begins, the relation
with both key forms, commit LSNs and times) for the table ``bench.pg_e2e`` writes
(``hpd_load``). No Postgres, no change DB: it isolates the follower's CPU per
transaction and per row, which end-to-end runs on two cores cannot resolve.

Reports the median over ``--repeat`` runs of µs per transaction and per row, with
the spread (min–max).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from app.protocol.canonical_json import dumps
from app.protocol.lexi import to_lexi
from app.replica.replicator import Replicator
from app.replica.schema import init_replica, open_replica
from app.runtime.log_follower import READ_BATCH, messages_from_rows
from app.storage import StoredRow

REPLICA_VERSION = "01"
RELATION = {
    "tag": "relation",
    "relationOid": 16390,
    "schema": "public",
    "name": "hpd_load",
    "rowKey": {"columns": ["id"], "type": "default"},
    "keyColumns": ["id"],
    "replicaIdentity": "default",
}
TITLE = "row {} " + "t" * 40
BODY = "b" * 200


def _create_table() -> dict[str, object]:
    def col(pos: int, pg_type: str) -> dict[str, object]:
        return {"pos": pos, "dataType": pg_type, "notNull": True, "typeOID": 20}

    return {
        "tag": "create-table",
        "spec": {
            "schema": "public",
            "name": "hpd_load",
            "columns": {
                "id": col(1, "int8"),
                "n": col(2, "int4"),
                "title": col(3, "text"),
                "body": col(4, "text"),
            },
            "primaryKey": ["id"],
        },
        "metadata": {"rowKey": {"columns": ["id"]}},
    }


def _create_index() -> dict[str, object]:
    return {
        "tag": "create-index",
        "spec": {
            "schema": "public",
            "tableName": "hpd_load",
            "name": "hpd_load_pkey",
            "unique": True,
            "columns": {"id": "ASC"},
        },
    }


def stored_rows(transactions: int, rows_per_tx: int, first_lsn: int) -> list[StoredRow]:
    """The change-log rows of ``transactions`` insert transactions."""
    out: list[StoredRow] = []
    next_id = 1
    for t in range(transactions):
        lsn = first_lsn + t * 1000
        watermark = to_lexi(lsn)
        lsn_text = f"0/{lsn:X}"
        begin = {
            "tag": "begin",
            "commitLsn": lsn_text,
            "commitTime": 1_700_000_000_000_000 + t,
            "xid": 1000 + t,
            "json": "s",
        }
        out.append((watermark, 0, dumps(begin), None))
        for pos in range(1, rows_per_tx + 1):
            new = {"id": next_id, "n": next_id % 1000, "title": TITLE.format(next_id), "body": BODY}
            next_id += 1
            change = {"tag": "insert", "relation": RELATION, "new": new}
            out.append((watermark, pos, dumps(change), None))
        commit = {
            "tag": "commit",
            "flags": 0,
            "commitLsn": lsn_text,
            "commitEndLsn": f"0/{lsn + 8:X}",
            "commitTime": 1_700_000_000_000_000 + t,
            "commitTimeMs": 1_700_000_000_000 + t // 1000,
        }
        out.append((watermark, rows_per_tx + 1, dumps(commit), watermark))
    return out


def _batches(rows: list[StoredRow]) -> list[list[StoredRow]]:
    return [rows[i : i + READ_BATCH] for i in range(0, len(rows), READ_BATCH)]


async def one_run(directory: Path, transactions: int, rows_per_tx: int) -> float:
    """Seconds to apply ``transactions`` transactions to a fresh replica."""
    path = directory / f"replica-{rows_per_tx}-{time.monotonic_ns()}.db"
    conn = open_replica(path, create=True)
    try:
        init_replica(conn, REPLICA_VERSION, ["zero_data"], {})
    finally:
        conn.close()
    async with Replicator(path, mode="backup") as replicator:
        setup: list[StoredRow] = [
            ("02", 0, '{"tag":"begin"}', None),
            ("02", 1, dumps(_create_table()), None),
            ("02", 2, dumps(_create_index()), None),
            ("02", 3, '{"tag":"commit"}', "02"),
        ]
        await replicator.apply_batch(messages_from_rows(setup))
        batches = _batches(stored_rows(transactions, rows_per_tx, 0x1000000))
        start = time.perf_counter()
        for batch in batches:
            await replicator.apply_batch(messages_from_rows(batch))
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.follower")
    parser.add_argument("--transactions", type=int, default=20_000)
    parser.add_argument("--rows", default="1,100", help="rows per transaction, comma-separated")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-follower-") as tmp:
        for rows_per_tx in (int(r) for r in args.rows.split(",")):
            transactions = max(1, args.transactions // rows_per_tx)
            runs = [
                asyncio.run(one_run(Path(tmp), transactions, rows_per_tx))
                for _ in range(args.repeat)
            ]
            per_tx = sorted(1e6 * s / transactions for s in runs)
            per_row = [t / rows_per_tx for t in per_tx]
            print(
                f"{rows_per_tx:>4}-row tx × {transactions:,}: "
                f"{statistics.median(per_tx):8.1f} µs/tx ({per_tx[0]:.1f}–{per_tx[-1]:.1f}), "
                f"{statistics.median(per_row):6.2f} µs/row"
            )


if __name__ == "__main__":
    main()
