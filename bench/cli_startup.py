"""How long the ``changestreamer`` command takes to answer ``--help`` and ``--version``.

    python -m bench.cli_startup              # 20 runs of each
    python -m bench.cli_startup --runs 50

Each run is a new process, started as a user starts it (the installed console
script, ``.venv/bin/changestreamer``; ``--module`` for ``python -m app.cli``), timed
from spawn to exit. Prints the median, min and max wall time of each command, after
one untimed run that warms the file cache. Parsing a command line must load nothing
of the service (tests/test_cli_ux.py checks that); this measures what that buys.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / ".venv" / "bin" / "changestreamer"


def wall_times(command: list[str], runs: int) -> list[float]:
    subprocess.run(command, check=True, capture_output=True)  # warm-up, untimed
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per command (default 20)")
    parser.add_argument(
        "--module", action="store_true", help="run `python -m app.cli` instead of the script"
    )
    args = parser.parse_args()
    base = [sys.executable, "-m", "app.cli"] if args.module else [str(SCRIPT)]
    print(f"{' '.join(base)}: {args.runs} runs each, wall time from spawn to exit")
    for option in ("--help", "--version"):
        times = wall_times([*base, option], args.runs)
        print(
            f"  {option:<9}  median {statistics.median(times) * 1000:6.1f} ms   "
            f"min {min(times) * 1000:6.1f} ms   max {max(times) * 1000:6.1f} ms"
        )


if __name__ == "__main__":
    main()
