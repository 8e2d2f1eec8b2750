"""A handoff between two changestreamer nodes, as a zero-cache view-syncer sees it.

    .venv/bin/python -m bench.handoff                 # 5 runs of interop/run-handoff
    .venv/bin/python -m bench.handoff --runs 3 --rate 50 --rows 3000
    .venv/bin/python -m bench.handoff --runs 1 --seed-rows 1000000   # a 1M-row replica
    .venv/bin/python -m bench.handoff --fast          # sub-second intervals, no delay

The nodes run with zero-cache's default intervals (a backup every 15 minutes, a VFS
probe every 30 s, a start-up delay of 15 s), as a deployment does; ``--fast`` gives
them the tests' sub-second ones and no start-up delay.

Each run is ``interop/run-handoff``: node A serving a real zero-cache 1.9.0
view-syncer in discover mode and a Zero client, a writer inserting a row every
1/RATE s, then node B started with an empty directory, which restores the backup,
waits for its coverage gate and takes the change log over. Per run: the
write-visibility gap at the client (the longest time between two rows becoming
visible; the writer's own spacing is 1/RATE s) and the time from B's start to its
owning the change log. Reported as p50 and max over the runs, with every run's
values. A run that fails stops the benchmark with its output.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "interop" / "run-handoff"
_GAP = re.compile(r"write-visibility gap (\d+) ms")
_TOOK = re.compile(r"B owns the change log ([\d.]+) s after it started")


def run_once(rate: int, rows: int, seed_rows: int, *, fast: bool) -> tuple[int, float]:
    env = {
        **os.environ,
        "RATE": str(rate),
        "ROWS": str(rows),
        "SEED_ROWS": str(seed_rows),
        "INTERVALS": "fast" if fast else "zero",
    }
    timeout_s = 300 + rows / rate + seed_rows / 10_000
    done = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=timeout_s)
    output = done.stdout + done.stderr
    gap, took = _GAP.search(output), _TOOK.search(output)
    if done.returncode != 0 or gap is None or took is None:
        sys.stderr.write(output)
        raise SystemExit(f"interop/run-handoff failed (exit {done.returncode})")
    return int(gap.group(1)), float(took.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rate", type=int, default=20, help="writes per second")
    parser.add_argument(
        "--rows",
        type=int,
        default=None,
        help="writes per run (default: 30 s of them, 15 s with --fast: past the takeover)",
    )
    parser.add_argument(
        "--seed-rows", type=int, default=100, help="rows of the replica besides the client's"
    )
    parser.add_argument(
        "--fast", action="store_true", help="sub-second intervals and no start-up delay"
    )
    opts = parser.parse_args()
    rows = opts.rows or opts.rate * (15 if opts.fast else 30)
    gaps: list[int] = []
    tooks: list[float] = []
    for i in range(opts.runs):
        gap, took = run_once(opts.rate, rows, opts.seed_rows, fast=opts.fast)
        gaps.append(gap)
        tooks.append(took)
        print(f"run {i + 1}: gap {gap} ms, B owned the log {took:.1f} s after its start")
    print()
    intervals = "sub-second intervals, no start-up delay" if opts.fast else "zero's defaults"
    print(
        f"| {opts.runs} runs, {opts.rate} writes/s, replica of {opts.seed_rows + 100:,} rows, "
        f"{intervals} | p50 | max | each |"
    )
    print("|---|---:|---:|---|")
    print(
        f"| write-visibility gap at the Zero client (ms; writer spacing "
        f"{1000 // opts.rate} ms) | {statistics.median(gaps):.0f} | {max(gaps)} | "
        f"{', '.join(map(str, gaps))} |"
    )
    print(
        f"| B's start → B owns the change log (s) | {statistics.median(tooks):.1f} | "
        f"{max(tooks):.1f} | {', '.join(f'{t:.1f}' for t in tooks)} |"
    )


if __name__ == "__main__":
    main()
