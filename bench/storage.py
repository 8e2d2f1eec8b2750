"""Change-log throughput: group-committed appends and catch-up reads.

    python -m bench.storage                      # SQLite and the local Postgres
    python -m bench.storage --backends sqlite --changes 200000

For each backend and upstream transaction size (1, 10, 100 data changes per
transaction; ``a-b`` draws each transaction's size between a and b) it appends
``--changes`` data changes, wrapped in begin/commit rows as the storer writes
them, group-committing up to ``--group`` rows per database transaction (the
storer's batch size), and moving ``lastWatermark`` with each commit under the
ownership lock. "changes/s" counts data changes; "rows/s"
counts every stored row (begin and commit included). Then it reads the whole log
back through ``ChangeLog.read`` in 2000-row batches, as catch-up does, and reports
the median of ``--read-passes`` passes.

``--groups varied`` group-commits a random (seeded) number of rows between 10 %
of ``--group`` and ``--group`` each time, as the storer does under load (it
writes whatever is queued), through ``ChangeLog.commit_rows``, the storer's own
call; "append CPU" is this process's CPU time (all threads) per stored row.

Each run uses a fresh SQLite file (synchronous=FULL unless ``--sqlite-sync``) or a
fresh Postgres schema (``bench_<n>/cdc`` in ``--pg-url``) and removes it after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import text

from app.protocol.lexi import to_lexi
from app.storage import (
    ChangeDb,
    ChangeDbOptions,
    ChangeLog,
    ChangeRow,
    Replication,
    Shard,
    SubscriptionState,
    create_change_db,
    migrate,
    parse_change_db_url,
)

DEFAULT_PG_URL = os.environ.get(
    "CHANGESTREAMER_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/changestreamer_test"
)
OWNER = "bench"


async def owned_log(db: ChangeDb) -> ChangeLog:
    """The migrated change log of ``db``, owned by the bench at replica version 01."""
    await migrate(db)
    replication = Replication(db)
    await replication.ensure_config(SubscriptionState("01", (), "01"), auto_reset=False)
    await replication.assume_ownership(OWNER, None)
    return ChangeLog(db)


# A ~220-byte insert, the size of a typical small row change.
INSERT = (
    '{{"tag":"insert","relation":{{"schema":"public","name":"issues","rowKey":{{"columns":["id"],'
    '"type":"default"}}}},"new":{{"id":"{id:012d}","title":"Benchmark row number {id}",'
    '"status":"open","priority":3,"modified":1764426733675.123}}}}'
)
BEGIN = '{"tag":"begin","json":"s"}'
COMMIT = '{"tag":"commit","commitTimeMs":1764426733675}'


@dataclass(frozen=True, slots=True)
class Result:
    backend: str
    tx_size: str
    changes: int
    rows: int
    append_s: float
    append_cpu_s: float
    read_rows: int
    read_s: float


def transactions(changes: int, tx_size: str) -> Iterator[tuple[str, list[ChangeRow]]]:
    """Upstream transactions as the storer would store them, with watermarks above 01.

    ``tx_size`` is a number of data changes, or ``a-b`` for sizes drawn (seeded)
    between a and b, so group commits come in sizes that are not all multiples of
    one transaction's rows."""
    low, _, high = tx_size.partition("-")
    sizes = random.Random(3)
    n = 0
    version = 2
    while n < changes:
        wm = to_lexi(version)
        size = int(low) if not high else sizes.randint(int(low), int(high))
        rows = [ChangeRow(wm, 0, BEGIN)]
        for pos in range(1, size + 1):
            rows.append(ChangeRow(wm, pos, INSERT.format(id=n)))
            n += 1
        rows.append(ChangeRow(wm, size + 1, COMMIT, wm))
        version += 1
        yield wm, rows


async def run_one(
    backend: str,
    url: str,
    shard: Shard,
    changes: int,
    tx_size: str,
    group: int,
    sync: str,
    read_passes: int,
    varied: bool,
) -> Result:
    opts = ChangeDbOptions(sqlite_synchronous=sync)  # type: ignore[arg-type]
    db = create_change_db(parse_change_db_url(url), shard, opts)
    try:
        log = await owned_log(db)

        # Built before the clock starts: the storer hands the log ready rows.
        upstream = list(transactions(changes, tx_size))
        pending: list[ChangeRow] = []
        last = "01"
        rows = 0
        sizes = random.Random(1)
        target = group if not varied else sizes.randint(max(1, group // 10), group)
        start, cpu_start = time.perf_counter(), time.process_time()
        for wm, tx_rows in upstream:
            pending.extend(tx_rows)
            last = wm
            if len(pending) >= target:
                await commit(log, pending, last, varied=varied)
                rows += len(pending)
                pending = []
                if varied:
                    target = sizes.randint(max(1, group // 10), group)
        if pending:
            await commit(log, pending, last, varied=varied)
            rows += len(pending)
        append_s = time.perf_counter() - start
        append_cpu_s = time.process_time() - cpu_start

        # The median of a few passes: single passes vary by ±30% on a shared VM.
        passes: list[tuple[int, float]] = []
        for _ in range(read_passes):
            read_rows = 0
            start = time.perf_counter()
            async for batch in log.read("01", last, batch_size=2000):
                read_rows += len(batch)
            passes.append((read_rows, time.perf_counter() - start))
        read_rows, read_s = sorted(passes, key=lambda p: p[1])[len(passes) // 2]
        return Result(backend, tx_size, changes, rows, append_s, append_cpu_s, read_rows, read_s)
    finally:
        if db.dialect == "postgresql":
            async with db.writer.begin() as conn:
                await conn.execute(text(f'DROP SCHEMA IF EXISTS "{shard.cdc_schema}" CASCADE'))
        await db.dispose()


async def commit(log: ChangeLog, rows: list[ChangeRow], last: str, *, varied: bool) -> None:
    if varied:
        await log.commit_rows(OWNER, rows, last)
        return
    async with log.write(OWNER) as tx:
        await tx.append(rows)
        tx.set_last_watermark(last)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--changes", type=int, default=100_000, help="data changes per run")
    parser.add_argument("--tx-sizes", default="1,10,100")
    parser.add_argument("--group", type=int, default=2000, help="rows per group commit")
    parser.add_argument(
        "--groups", default="fixed", choices=["fixed", "varied"], help="group commit sizes"
    )
    parser.add_argument("--sqlite-sync", default="FULL", choices=["OFF", "NORMAL", "FULL"])
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL)
    parser.add_argument("--read-passes", type=int, default=3, help="catch-up passes (median)")
    args = parser.parse_args()

    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, backend in enumerate(args.backends.split(",")):
            for j, size in enumerate(args.tx_sizes.split(",")):
                shard = Shard("bench", i * 10 + j)
                if backend == "sqlite":
                    url = str(Path(tmp) / f"bench-{size}.db")
                elif backend == "postgres":
                    url = args.pg_url
                else:
                    raise SystemExit(f"unknown backend {backend!r}")
                result = await run_one(
                    backend,
                    url,
                    shard,
                    args.changes,
                    size,
                    args.group,
                    args.sqlite_sync,
                    args.read_passes,
                    args.groups == "varied",
                )
                results.append(result)
                print_row(result, header=not results[:-1])


def print_row(r: Result, *, header: bool) -> None:
    if header:
        print(
            f"{'backend':<9} {'tx size':>7} {'changes':>8} {'append changes/s':>17} "
            f"{'append rows/s':>14} {'append CPU µs/row':>18} {'catch-up rows/s':>16}"
        )
    print(
        f"{r.backend:<9} {r.tx_size:>7} {r.changes:>8} {r.changes / r.append_s:>17,.0f} "
        f"{r.rows / r.append_s:>14,.0f} {r.append_cpu_s / r.rows * 1e6:>18.2f} "
        f"{r.read_rows / r.read_s:>16,.0f}",
        flush=True,
    )


if __name__ == "__main__":
    asyncio.run(main())
