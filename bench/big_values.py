"""Large values end to end: delivery, event-loop stalls and memory, on real processes.

    python -m bench.big_values                      # 10, 50 and 100 MB; 1 and 3 at once
    python -m bench.big_values --sizes 50 --repeat 1

Starts ``changestreamer serve`` on a fresh upstream database on the local Postgres,
subscribes one v6 client (acks every message; no message-size limit), then for each
size and repeat count inserts that many rows whose text value is that many MB, in
separate transactions written back to back, and reports:

* seconds from the first INSERT to the receipt of the last commit;
* the service's worst event-loop lag meanwhile (``/statz`` ``eventLoopLagMs.max10s``: how
  late it ran what was due — the stall every subscriber's ping sees);
* the summed RSS of the service's processes (serve, the replica follower, the
  SQLite writer) before, at the peak (sampled every 100 ms), 3 s after and
  settled (once serve's periodic ``malloc_trim`` has run), with the service's own
  process apart.

Loopback only; the service is stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psycopg
from websockets.asyncio.client import ClientConnection, connect

from app.runtime.memory import TRIM_INTERVAL_S
from bench.pg_e2e import PG, admin, drop_slots, process_tree, rss_kib
from bench.serve import running_serve

UPSTREAM = "bbv_upstream"
APP_ID = "bbv"


@dataclass
class Point:
    size_mb: int
    repeat: int
    seconds: float
    loop_lag_ms: float
    rss_before_mib: int
    rss_peak_mib: int
    rss_after_mib: int
    serve_before_mib: int
    serve_after_mib: int
    # Once serve's periodic malloc_trim has run since (pieces are heap blocks of at
    # most 1 MiB: glibc returns them to the OS at the trim, not at the free).
    rss_settled_mib: int
    serve_settled_mib: int


def tree_rss_mib(pid: int) -> int:
    return sum(rss_kib(p) for p in process_tree(pid)) // 1024


def statz(port: int) -> dict[str, object]:
    url = f"http://127.0.0.1:{port}/statz?format=json&group=replication"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return dict(json.loads(reply.read())["replication"])


async def follow(ws: ClientConnection, commits: list[float]) -> None:
    while True:
        frame = json.loads(await ws.recv())
        await ws.send(json.dumps({"ack": frame["id"]}))
        if frame["msg"][0] == "commit":
            commits.append(time.monotonic())


async def measure(
    proc: subprocess.Popen[bytes], port: int, sizes: list[int], repeats: list[int]
) -> list[Point]:
    replica_version = str(statz(port)["replicaVersion"])
    url = (
        f"ws://127.0.0.1:{port}/replication/v6/changes?id=bench-big"
        f"&replicaVersion={replica_version}&watermark={replica_version}"
    )
    points: list[Point] = []
    async with connect(url, max_size=None, ping_interval=None) as ws:
        commits: list[float] = []
        reader = asyncio.create_task(follow(ws, commits))
        next_id = 1
        try:
            for size in sizes:
                for repeat in repeats:
                    await asyncio.sleep(3)  # quiet before the point (max10s covers it)
                    before, serve_before = tree_rss_mib(proc.pid), rss_kib(proc.pid) // 1024
                    seen = len(commits)
                    start = time.monotonic()
                    with psycopg.connect(f"{PG}/{UPSTREAM}", autocommit=True) as conn:
                        for _ in range(repeat):
                            conn.execute(
                                "INSERT INTO big VALUES (%s, repeat('x', %s))",
                                (next_id, size * 1024 * 1024),
                            )
                            next_id += 1
                    peak = before
                    deadline = time.monotonic() + 300
                    while len(commits) < seen + repeat and time.monotonic() < deadline:
                        await asyncio.sleep(0.1)
                        peak = max(peak, tree_rss_mib(proc.pid))
                    if len(commits) < seen + repeat:
                        raise RuntimeError(f"{repeat} x {size} MB: not delivered within 300 s")
                    seconds = commits[-1] - start
                    lag = float(statz(port)["eventLoopLagMs"]["max10s"])  # type: ignore[index]
                    for _ in range(30):
                        await asyncio.sleep(0.1)
                        peak = max(peak, tree_rss_mib(proc.pid))
                    after, serve_after = tree_rss_mib(proc.pid), rss_kib(proc.pid) // 1024
                    await asyncio.sleep(TRIM_INTERVAL_S + 1 - 3)
                    points.append(
                        Point(
                            size,
                            repeat,
                            seconds,
                            lag,
                            before,
                            peak,
                            after,
                            serve_before,
                            serve_after,
                            tree_rss_mib(proc.pid),
                            rss_kib(proc.pid) // 1024,
                        )
                    )
                    print(f"  {repeat} x {size} MB: {points[-1]}", flush=True)
        finally:
            reader.cancel()
    return points


def report(points: list[Point]) -> str:
    lines = [
        "| values | delivered in (s) | worst loop lag (ms) | RSS before / peak / after "
        "/ settled (MiB) | serve's own before / after / settled (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in points:
        lines.append(
            f"| {p.repeat} x {p.size_mb} MB | {p.seconds:.2f} | {p.loop_lag_ms:.0f} "
            f"| {p.rss_before_mib} / {p.rss_peak_mib} / {p.rss_after_mib} / {p.rss_settled_mib} "
            f"| {p.serve_before_mib} / {p.serve_after_mib} / {p.serve_settled_mib} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,50,100", help="MB per value")
    parser.add_argument("--repeat", default="1,3", help="values written back to back")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    repeats = [int(r) for r in args.repeat.split(",")]
    drop_slots(APP_ID)
    admin(f"DROP DATABASE IF EXISTS {UPSTREAM} WITH (FORCE)")
    admin(f"CREATE DATABASE {UPSTREAM}")
    with psycopg.connect(f"{PG}/{UPSTREAM}", autocommit=True) as conn:
        conn.execute(b"CREATE TABLE big (id int PRIMARY KEY, v text)")
    try:
        with (
            tempfile.TemporaryDirectory(prefix="bbv-") as work,
            running_serve(
                Path(work), {"ZERO_UPSTREAM_DB": f"{PG}/{UPSTREAM}", "ZERO_APP_ID": APP_ID}
            ) as (proc, port),
        ):
            points = asyncio.run(measure(proc, port, sizes, repeats))
    finally:
        drop_slots(APP_ID)
        admin(f"DROP DATABASE IF EXISTS {UPSTREAM} WITH (FORCE)")
    print(report(points))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
