"""``python -m faults.handoff_loop``: the handoff tests again and again, under load, with
every uploaded transaction of every node's backup restored and checked whole.

    .venv/bin/python -m faults.handoff_loop --runs 10 --hogs 2
    .venv/bin/python -m faults.handoff_loop --runs 5 --test tests/serve_pg/test_handoff.py

How issue 42's malformed replica was hunted (``docs/reliability.md``): a restored
replica that SQLite called "malformed" in one run in a few. Each run is one pytest
process with its own ``--basetemp`` under ``--out``, beside ``--hogs`` busy processes
(started and killed by their PIDs). After a run, each transaction of each backup
destination the run left is restored on its own (``litestream restore -txid``) and
checked with ``PRAGMA integrity_check``; the processes the run left behind (a
litestream that outlived its ``serve``) are listed and killed by PID. A failing or
torn run keeps its basetemp (the destinations, every node's log, the replicas).
Exit status 1 if any run failed or left a torn upload or a process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.serve_pg.test_handoff import torn_uploads

REPO = Path(__file__).resolve().parents[1]
PYTEST = REPO / ".venv" / "bin" / "pytest"
DEFAULT_TEST = (
    "tests/serve_pg/test_handoff.py::"
    "test_a_handoff_interrupted_by_a_crash_or_a_postgres_restart_loses_nothing[kill-new]"
)
RUN_TIMEOUT_S = 900
_HOG = "while True:\n    pass\n"
_OURS = (b"litestream", b"changestreamer", b"app.runtime", b"app.backup")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m faults.handoff_loop", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--hogs", type=int, default=2, help="busy processes beside (0: none)")
    parser.add_argument("--test", default=DEFAULT_TEST, help="the pytest node id to repeat")
    parser.add_argument("--out", type=Path, default=None, help="default /tmp/handoff-loop-<time>")
    parser.add_argument("--keep-all", action="store_true", help="keep passing runs too")
    return parser.parse_args(argv)


def leftovers(basetemp: Path) -> list[str]:
    """Processes of ours whose command line names ``basetemp``: killed by PID, listed."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if str(basetemp).encode() in cmdline and any(word in cmdline for word in _OURS):
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"pid {entry}: {command[:160]}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)
    return found


def destinations(basetemp: Path) -> list[Path]:
    """The backup URLs' folders the run's tests left (``…/backup``, one destination a
    node inside; not litestream's local ``.<replica>-litestream`` state beside a
    replica, which holds the same files before they are uploaded)."""
    return sorted({p.resolve() for p in basetemp.rglob("backup") if p.is_dir()})


def run_once(index: int, out: Path, test: str) -> tuple[bool, float, Path, str]:
    basetemp = out / f"run-{index:02d}"
    command = [str(PYTEST), "-q", "-p", "no:cacheprovider", test, f"--basetemp={basetemp}"]
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
        output, passed = done.stdout + done.stderr, done.returncode == 0
    except subprocess.TimeoutExpired as e:
        partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else ""
        output, passed = f"{partial}\nhandoff_loop: timed out after {RUN_TIMEOUT_S} s", False
    (out / f"run-{index:02d}.log").write_text(output)
    return passed, time.monotonic() - started, basetemp, output


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path(f"/tmp/handoff-loop-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"handoff_loop: {args.runs} runs of {args.test}, {args.hogs} hogs, in {out}")
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG]) for _ in range(args.hogs)]
    bad: list[int] = []
    try:
        for i in range(1, args.runs + 1):
            passed, took, basetemp, output = run_once(i, out, args.test)
            left = leftovers(basetemp)
            torn = [t for d in destinations(basetemp) for t in torn_uploads(d)]
            summary = output.strip().splitlines()[-1] if output.strip() else "(no output)"
            verdict = "PASS" if passed and not torn and not left else "FAIL"
            print(f"run {i:02d}: {verdict} in {took:.0f} s, {len(torn)} torn uploads; {summary}")
            for line in torn + left:
                print(f"  {line}")
            if verdict == "FAIL":
                bad.append(i)
                print(f"  kept {basetemp}")
            elif not args.keep_all:
                shutil.rmtree(basetemp, ignore_errors=True)
            sys.stdout.flush()
    finally:
        for hog in hogs:
            hog.kill()  # by its PID
            hog.wait(10)
    print(f"handoff_loop: {len(bad)} of {args.runs} runs failed {bad or ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
