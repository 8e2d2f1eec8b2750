"""A table added to the publication while the upstream is busy: ours vs. zero-cache 1.9.0.

    .venv/bin/python -m bench.backfill                      # 1,000,000 rows at 1,000 tx/s, both
    .venv/bin/python -m bench.backfill --rows 100000 --impls ours   # a quick run

For each implementation in turn (same machine, one after the other, so neither
competes with the other for the two cores), on a fresh upstream database:

1. ``bf.big`` holds ``--rows`` rows (~200 bytes each, ``bench.pg_e2e``'s row shape)
   in a schema no publication covers; ``hpd_load`` (public) is empty.
2. The service starts (initial sync of the empty load table), and one subscriber
   (``bench.pg_subscribers``, its own process) follows the stream and acks it.
3. A writer commits 1-row transactions into ``hpd_load`` at ``--rate`` per second,
   synchronously. After ``--warmup`` seconds it runs ``ALTER PUBLICATION … ADD
   TABLES IN SCHEMA bf``: the table arrives with a backfill, streamed while the
   writes go on, until the subscriber receives ``backfill-completed``.

Reported: the backfill rate (rows / seconds from the ALTER's commit to the receipt
of ``backfill-completed``), and the latency of the load's commits (receipt minus
upstream commit time) before the ALTER and while the backfill ran, p50 / p99 / max.

Loopback only; every process is stopped by its PID; slots and databases are dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.pg_e2e import (
    APP_IDS,
    BODY,
    NAMES,
    PG,
    POINT_TIMEOUT_S,
    READY_TIMEOUT_S,
    REF_CHANGE_DB,
    REF_CVR_DB,
    SUBSCRIBER_READY_TIMEOUT_S,
    TITLE_PAD,
    UPSTREAM_DB,
    RssSampler,
    Subscribers,
    Writer,
    drop_databases,
    drop_slots,
    expect,
    probe_replica_version,
    recreate_databases,
    start_service,
    stop_service,
    wait_ready,
)

BACKFILL_TIMEOUT_S = 900.0


def seed(rows: int) -> None:
    table = "(id bigint PRIMARY KEY, n int NOT NULL, title text NOT NULL, body text NOT NULL)"
    with psycopg.connect(f"{PG}/{UPSTREAM_DB}", autocommit=True) as conn:
        conn.execute(f"CREATE TABLE hpd_load {table}".encode())
        conn.execute(b"CREATE SCHEMA bf")
        conn.execute(f"CREATE TABLE bf.big {table}".encode())
        conn.execute(
            f"INSERT INTO bf.big SELECT g, g % 1000, 'row ' || g || ' {TITLE_PAD}', '{BODY}' "
            f"FROM generate_series(1, {int(rows)}) g".encode()
        )
        conn.execute(b"VACUUM ANALYZE bf.big")


class OpenLoad:
    """1-row transactions started at ``rate``/s whatever their commits take (an open
    loop: up to ``CONNECTIONS`` in flight), synchronously committed, in a thread of
    its own; a closed loop on one connection would measure Postgres's fsync time,
    not a rate."""

    CONNECTIONS = 8

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.sent = 0
        self._stop = threading.Event()
        self._writer = Writer()  # its _tx_sql numbers the rows; its connection ends the run
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    async def _run(self) -> None:
        idle: asyncio.Queue[psycopg.AsyncConnection[Any]] = asyncio.Queue()
        conns = [
            await psycopg.AsyncConnection.connect(f"{PG}/{UPSTREAM_DB}", autocommit=True)
            for _ in range(self.CONNECTIONS)
        ]
        for conn in conns:
            idle.put_nowait(conn)

        async def one(conn: psycopg.AsyncConnection[Any], sql: bytes) -> None:
            try:
                await conn.execute(sql)
            finally:
                idle.put_nowait(conn)

        tasks: set[asyncio.Task[None]] = set()
        t0 = time.monotonic()
        try:
            while not self._stop.is_set():
                delay = t0 + self.sent / self.rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                conn = await idle.get()
                task = asyncio.create_task(one(conn, self._writer._tx_sql(1).encode()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                self.sent += 1
            await asyncio.gather(*tasks)
        finally:
            for conn in conns:
                await conn.close()

    def finish(self, sentinel: str) -> None:
        self._stop.set()
        self._thread.join(30)
        self._writer.sentinel(sentinel)
        self._writer.close()


def quantiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50_ms": q[49], "p99_ms": q[98], "max_ms": max(values), "n": float(len(values))}


def run_impl(impl: str, rows: int, rate: float, warmup_s: float) -> dict[str, Any]:
    recreate_databases([UPSTREAM_DB] + ([REF_CVR_DB, REF_CHANGE_DB] if impl == "ref" else []))
    t = time.monotonic()
    seed(rows)
    print(f"  {NAMES[impl]}: seeded {rows:,} rows in {time.monotonic() - t:.1f} s", flush=True)
    work = Path(tempfile.mkdtemp(prefix=f"hpb_{impl}_"))
    service = start_service(impl, work, "sqlite")
    sampler = RssSampler(service.proc.pid)
    sampler.start()
    out: dict[str, Any] = {}
    subs: Subscribers | None = None
    try:
        wait_ready(service, READY_TIMEOUT_S)
        replica_version = asyncio.run(probe_replica_version(service.ws_url))
        subs = Subscribers(
            service.ws_url, 1, replica_version, replica_version, extra_args=("--watch-backfill",)
        )
        expect(subs.wait_event(SUBSCRIBER_READY_TIMEOUT_S), "ready")
        load = OpenLoad(rate)
        load.start()
        time.sleep(warmup_s)
        with psycopg.connect(f"{PG}/{UPSTREAM_DB}", autocommit=True) as conn:
            conn.execute(f"ALTER PUBLICATION _{APP_IDS[impl]}_public_0 ADD TABLES IN SCHEMA bf")
            altered = time.time()
        sent_before = load.sent
        completed = expect(subs.wait_event(BACKFILL_TIMEOUT_S), "backfill_completed")["at"]
        load.finish(subs.sentinel)
        done = expect(subs.wait_event(POINT_TIMEOUT_S), "done")
        seconds = completed - altered
        receipts, latencies = done["latency_receipts"], done["latencies_ms"]
        before = [lat for at, lat in zip(receipts, latencies, strict=True) if at < altered]
        during = [
            lat for at, lat in zip(receipts, latencies, strict=True) if altered <= at <= completed
        ]
        out = {
            "backfill_s": seconds,
            "rows_per_s": rows / seconds,
            "load_tx_per_s": (load.sent - sent_before) / seconds,
            "before": quantiles(before),
            "during": quantiles(during),
            "rss_mib": max(sampler.peaks_kib.values(), default=0) / 1024,
        }
        print(
            f"  {NAMES[impl]}: {rows:,} rows backfilled in {seconds:.1f} s "
            f"({out['rows_per_s']:,.0f} rows/s) at {out['load_tx_per_s']:,.0f} tx/s; latency "
            f"before p50 {out['before'].get('p50_ms', 0):.1f} / p99 "
            f"{out['before'].get('p99_ms', 0):.1f} ms, during p50 "
            f"{out['during'].get('p50_ms', 0):.1f} / p99 {out['during'].get('p99_ms', 0):.1f} "
            f"/ max {out['during'].get('max_ms', 0):.1f} ms",
            flush=True,
        )
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}\n{service.log_tail(40)}"
        print(f"  {NAMES[impl]}: FAILED {out['error']}", flush=True)
    finally:
        if subs is not None:
            subs.close()
        sampler.stop()
        stop_service(service, sampler.pids)
        drop_slots(APP_IDS[impl])
        shutil.copy(service.log_path, Path(tempfile.gettempdir()) / f"hpb_{impl}_service.log")
        shutil.rmtree(work, ignore_errors=True)
    return out


def report(results: dict[str, dict[str, Any]], rows: int, rate: float) -> str:
    lines = [
        f"Backfill of a {rows:,}-row table added to the publication, {rate:,.0f} tx/s of "
        "1-row load meanwhile",
        "",
        "| | backfill s | rows/s | load tx/s | latency before p50 / p99 ms | "
        "during p50 / p99 / max ms | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for impl, r in results.items():
        if "error" in r:
            lines.append(f"| {NAMES[impl]} | failed: {r['error'].splitlines()[0]} |")
            continue
        b, d = r["before"], r["during"]
        lines.append(
            f"| {NAMES[impl]} | {r['backfill_s']:.1f} | {r['rows_per_s']:,.0f} | "
            f"{r['load_tx_per_s']:,.0f} | {b.get('p50_ms', 0):.1f} / {b.get('p99_ms', 0):.1f} | "
            f"{d.get('p50_ms', 0):.1f} / {d.get('p99_ms', 0):.1f} / {d.get('max_ms', 0):.1f} | "
            f"{r['rss_mib']:,.0f} |"
        )
    if all("error" not in r for r in results.values()) and len(results) == 2:
        ratio = results["ours"]["rows_per_s"] / results["ref"]["rows_per_s"]
        lines += ["", f"Backfill rate, ours / reference: {ratio:.2f}×"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.backfill")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rate", type=float, default=1000.0, help="load transactions/s")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before")
    parser.add_argument("--impls", default="ours,ref")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    try:
        for impl in args.impls.split(","):
            print(f"{NAMES[impl]}:", flush=True)
            results[impl] = run_impl(impl, args.rows, args.rate, args.warmup)
    finally:
        drop_databases([UPSTREAM_DB, REF_CVR_DB, REF_CHANGE_DB])
    table = report(results, args.rows, args.rate)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
