"""``python -m faults``: every fault's seeded loop against ``serve``, as a markdown table.

    .venv/bin/python -m faults                          # the full run (20 iterations)
    .venv/bin/python -m faults --iterations 3 --faults sigkill walsender
    .venv/bin/python -m faults --seed 7 --out /tmp/faults.md

``postgres_restart`` restarts the local cluster (``pg_ctlcluster 15 main restart``):
it is in the full run only, and ``--no-postgres-restart`` leaves it out.
Exit status 1 if any fault lost or duplicated a transaction, left an orphan, or
ended with rows that differ from Postgres.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from faults.report import markdown
from faults.scenarios import FAULTS, FULL_ONLY, FaultResult, run_fault

# Iterations of the subscriber faults and the slow ones, whatever --iterations says.
SHORT_FAULTS = {
    "postgres_restart": 3,
    "disk_full": 3,
    "litestream_killed": 5,
    "change_db_garbage": 5,
    "litestream_unwritable": 5,
    # Each holds serve stopped for 5 s.
    "pause": 10,
    # Each waits for the server's 10 s no-ack drop.
    "stalled_subscriber": 10,
    "stalled_in_catchup": 10,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m faults", description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=20, help="per fault (default 20)")
    parser.add_argument(
        "--faults", nargs="+", choices=sorted(FAULTS), default=list(FAULTS), metavar="FAULT"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-postgres-restart", action="store_true")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--workdir", type=Path, help="keep the work directories (logs) here")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> list[FaultResult]:
    results = []
    for i, fault in enumerate(args.faults):
        if args.no_postgres_restart and fault in FULL_ONLY:
            continue
        iterations = min(args.iterations, SHORT_FAULTS.get(fault, args.iterations))
        print(f"== {fault}: {iterations} iterations", file=sys.stderr, flush=True)
        try:
            result = await run_fault(fault, iterations, args.seed + i, args.workdir)
        except Exception as e:  # the harness's own failure: reported, the run goes on
            result = FaultResult(fault)
            result.fault_problems.append(f"harness error: {e!r}")
        print(
            f"   {fault}: lost {result.lost}, duplicated {result.duplicated}, "
            f"{'ok' if result.ok else 'FAILED'} in {result.seconds:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = asyncio.run(run(args))
    table = markdown(results, args.seed)
    print(table)
    if args.out is not None:
        args.out.write_text(table)
    return 0 if all(r.ok or r.skipped for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
