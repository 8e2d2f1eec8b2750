"""Backups, restores and the change log's size, measured on real processes.

    python -m bench.backup                       # 1,000,000 rows, 120 s write runs
    python -m bench.backup --rows 100000 --write-seconds 30

1. Seeds an upstream table with ``--rows`` rows (~200 bytes each) on the local
   Postgres, starts ``changestreamer serve`` with a litestream backup to a local
   directory and reports, from the start: initial sync done, the first backup file
   uploaded, ``/ready`` (the backup covers the replica: the coverage gate).
2. Restores that backup with ``changestreamer restore`` and times it.
3. Writes ``--rate`` small transactions per second for ``--write-seconds``, once with
   the backup and once without (the replica poller), sampling the change log's rows
   and bytes (``/statz``) every second: the peak and the final size say whether the
   log stays bounded. Purge settings are the defaults (30 s delay) but for the
   retention (``--retention``, default 0 here: the service's 300 s would keep a
   whole short run).
4. With ``--restoring-clients N``, the backup run a third time while N view-syncers
   restore in turn: each holds a snapshot reservation for ``--restore-seconds``, and
   a new one opens before the oldest closes, so one is open at every moment (zero
   1.9 purges nothing then; here each holds the floor at its own watermark).

Loopback only; every process it starts is stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

import psycopg

from app.client import ChangeStreamerClient
from bench.pg_e2e import PG, admin, drop_slots, free_port_block

REPO = Path(__file__).resolve().parents[1]
SERVE = REPO / ".venv" / "bin" / "changestreamer"
UPSTREAM = "bkb_upstream"
APP_ID = "bkb"


def seed(rows: int) -> None:
    drop_slots(APP_ID)
    admin(f"DROP DATABASE IF EXISTS {UPSTREAM} WITH (FORCE)")
    admin(f"CREATE DATABASE {UPSTREAM}")
    with psycopg.connect(f"{PG}/{UPSTREAM}", autocommit=True) as conn:
        conn.execute(b"CREATE TABLE big (id bigint PRIMARY KEY, n int, title text, body text)")
        conn.execute(b"CREATE TABLE load (id bigint PRIMARY KEY, n int, title text)")
        conn.execute(
            f"INSERT INTO big SELECT g, g % 1000, 'row ' || g || ' {'t' * 48}', "
            f"'{'b' * 128}' FROM generate_series(1, {rows}) g".encode()
        )
        conn.execute(b"VACUUM ANALYZE big")


class Serve:
    def __init__(self, work: Path, env: dict[str, str]) -> None:
        self.work = work
        self.port = free_port_block(1)
        base = {
            k: v for k, v in os.environ.items() if not k.startswith(("ZERO_", "CHANGESTREAMER_"))
        }
        base.pop("AWS_CA_BUNDLE", None)
        self.log_path = work / "serve.log"
        self._log = self.log_path.open("wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [str(SERVE), "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=work,
            env={
                **base,
                "NODE_ENV": "development",
                "ZERO_APP_ID": APP_ID,
                "ZERO_UPSTREAM_DB": f"{PG}/{UPSTREAM}",
                "ZERO_REPLICA_FILE": str(work / "replica.db"),
                "ZERO_CHANGE_STREAMER_STARTUP_DELAY_MS": "0",
                **env,
            },
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, None
        except OSError:
            return 0, None

    def log_has(self, text: str) -> bool:
        return text in self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def wait(what: str, check: Any, timeout_s: float, serve: Serve) -> float:
    """Seconds since the service started when ``check()`` first held."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if serve.proc.poll() is not None:
            raise SystemExit(f"serve exited while waiting for {what}; see {serve.log_path}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}; see {serve.log_path}")
        time.sleep(0.05)
    return time.monotonic() - serve.started


def backup_files(backup: Path) -> bool:
    return backup.exists() and any(backup.rglob("*.ltx"))


def write_run(
    serve: Serve, seconds: float, rate: float, restoring: int = 0, restore_s: float = 10.0
) -> dict[str, Any]:
    """Small transactions at ``rate``/s; the change log's size sampled every second;
    ``restoring`` clients holding reservations in turn meanwhile."""
    stop = threading.Event()
    opened: list[int] = []
    restorers = threading.Thread(
        target=lambda: asyncio.run(_restore_in_turn(serve, restoring, restore_s, stop, opened)),
        name="restoring-clients",
    )
    if restoring:
        restorers.start()
    try:
        result = _write_and_sample(serve, seconds, rate)
    finally:
        stop.set()
        if restoring:
            restorers.join(60)
    if restoring:
        result["reservations"] = opened[0] if opened else 0
    return result


async def _restore_in_turn(
    serve: Serve, clients: int, hold_s: float, stop: threading.Event, opened: list[int]
) -> None:
    """``clients`` reservations at a time, each held ``hold_s``, one opening every
    ``hold_s / clients`` (before the oldest closes)."""
    client = ChangeStreamerClient(f"ws://127.0.0.1:{serve.port}")
    held: deque[Any] = deque()
    count = 0
    try:
        while not stop.is_set():
            _, followup = await client.reserve_snapshot(f"bench-restore-{count}")
            held.append(followup)
            count += 1
            if len(held) > clients:
                await held.popleft().cancel()
            await asyncio.sleep(hold_s / clients)
    finally:
        for followup in held:
            await followup.cancel()
        opened.append(count)


def _write_and_sample(serve: Serve, seconds: float, rate: float) -> dict[str, Any]:
    samples: list[tuple[int, int]] = []
    with psycopg.connect(f"{PG}/{UPSTREAM}", autocommit=True) as conn:
        t0 = time.monotonic()
        next_sample = t0
        i = 0
        while time.monotonic() - t0 < seconds:
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            conn.execute(
                f"INSERT INTO load VALUES ({i + 1 + int(t0 * 1000) % 10**9 * 10**5}, {i}, "
                f"'w {i}')".encode()
            )
            i += 1
            if time.monotonic() >= next_sample:
                next_sample += 1.0
                _, stats = serve.get("/statz?format=json")
                if stats and "rows" in stats.get("changeLog", {}):
                    samples.append((stats["changeLog"]["rows"], stats["changeLog"]["bytes"]))
    time.sleep(40)  # one purge delay (30 s) and a poll after the last write
    _, stats = serve.get("/statz?format=json")
    final = (stats["changeLog"]["rows"], stats["changeLog"]["bytes"]) if stats else (0, 0)
    return {
        "transactions": i,
        "peak_rows": max(r for r, _ in samples),
        "peak_bytes": max(b for _, b in samples),
        "final_rows": final[0],
        "final_bytes": final[1],
        "purge": stats["backup"]["purge"] if stats else None,
        "backup_watermark": stats["backup"]["backupWatermark"] if stats else None,
        "monitor": stats["backup"]["monitor"] if stats else None,
        "durable": stats["replication"]["durableWatermark"] if stats else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.backup")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--write-seconds", type=float, default=120)
    parser.add_argument("--rate", type=float, default=200, help="transactions per second")
    parser.add_argument(
        "--restoring-clients",
        type=int,
        default=0,
        help="also a backup run with this many view-syncers restoring in turn",
    )
    parser.add_argument("--restore-seconds", type=float, default=10.0)
    parser.add_argument(
        "--retention",
        default="0",
        help="CHANGESTREAMER_CHANGE_LOG_RETENTION_SECONDS for the runs (default 0: the "
        "service's 300 s would keep a whole short run)",
    )
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"rows": args.rows}
    t = time.monotonic()
    seed(args.rows)
    results["seed_s"] = round(time.monotonic() - t, 1)
    with tempfile.TemporaryDirectory(prefix="bench-backup-") as tmp:
        work = Path(tmp)
        backup = work / "backup"
        (work / "a").mkdir()
        serve = Serve(
            work / "a",
            {
                "ZERO_LITESTREAM_BACKUP_URL": f"file://{backup}",
                "ZERO_LITESTREAM_PORT": str(free_port_block(1)),
                "ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES": "0.05",
                "CHANGESTREAMER_CHANGE_LOG_RETENTION_SECONDS": args.retention,
            },
        )
        try:
            results["initial_sync_done_s"] = round(
                wait("initial sync", lambda: serve.log_has("initial sync done"), 1800, serve), 2
            )
            results["first_backup_file_s"] = round(
                wait("the first upload", lambda: backup_files(backup), 1800, serve), 2
            )
            results["ready_s"] = round(
                wait("/ready", lambda: serve.get("/ready")[0] == 200, 1800, serve), 2
            )
            results["replica_bytes"] = (work / "a" / "replica.db").stat().st_size
            results["backup_bytes"] = sum(
                p.stat().st_size for p in backup.rglob("*") if p.is_file()
            )
            restored = work / "restored.db"
            t = time.monotonic()
            done = subprocess.run(
                [
                    str(SERVE),
                    "restore",
                    "--backup-url",
                    f"file://{backup}",
                    "--replica",
                    str(restored),
                ],
                cwd=work,
                env={k: v for k, v in os.environ.items() if not k.startswith("ZERO_")},
                capture_output=True,
                text=True,
                timeout=3600,
            )
            results["restore_s"] = round(time.monotonic() - t, 2)
            results["restore_output"] = done.stdout.strip() or done.stderr.strip()[-300:]
            results["with_backup"] = write_run(serve, args.write_seconds, args.rate)
            if args.restoring_clients:
                results["with_restoring_clients"] = write_run(
                    serve,
                    args.write_seconds,
                    args.rate,
                    restoring=args.restoring_clients,
                    restore_s=args.restore_seconds,
                )
        finally:
            serve.stop()
        drop_slots(APP_ID)
        seed(1000)  # the no-backup run measures the log, not the initial sync
        (work / "b").mkdir()
        serve = Serve(work / "b", {"CHANGESTREAMER_CHANGE_LOG_RETENTION_SECONDS": args.retention})
        try:
            wait("/ready", lambda: serve.get("/ready")[0] == 200, 600, serve)
            results["without_backup"] = write_run(serve, args.write_seconds, args.rate)
        finally:
            serve.stop()
    drop_slots(APP_ID)
    admin(f"DROP DATABASE IF EXISTS {UPSTREAM} WITH (FORCE)")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
