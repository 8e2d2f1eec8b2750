"""End to end from a Postgres commit to subscriber receipt: ours vs. zero-cache 1.9.0.

    .venv/bin/python -m bench.pg_e2e                    # everything, both (< 10 min)
    .venv/bin/python -m bench.pg_e2e --quick            # smoke run (small sizes)
    .venv/bin/python -m bench.pg_e2e --scenarios throughput --impls ref
    .venv/bin/python -m bench.pg_e2e --out /tmp/bench_pg_e2e_table.md

Both implementations replicate the same upstream database (``hpd_upstream`` on the
local Postgres) ONE AFTER THE OTHER in the same run, each with its own app id
(``csbench`` for ours, ``refbench`` for the reference), so shard schemas,
publications and slots never collide, and neither competes with the other for the
machine's two cores. Before each one starts, the load table is emptied while no
slot exists, so both see the same data: the big table and an empty load table.

The reference is ``interop/node_modules/.bin/zero-cache`` with
``ZERO_NUM_SYNC_WORKERS=0`` (a replication manager: change-streamer only, change DB
and CVR DB on Postgres). Ours is ``changestreamer serve`` with its default change
DB (a SQLite file beside the replica) unless ``--our-change-db postgres``.
Subscribers run in a separate process (``bench.pg_subscribers``) and ack every
message; the writer is this process (psycopg; throughput bursts commit with
``synchronous_commit = off`` so the writer's own fsyncs do not pace the load, and
end with a synchronous commit that flushes them all; the paced latency load commits
synchronously).

Scenarios:

* ``init`` — initial sync of a table of ``--rows`` rows (1,000,000; ~200 bytes a
  row): seconds from spawning the service to its readiness (ours: ``GET /ready``;
  the reference: its change-streamer port answering ``GET /``, which it opens only
  after initial sync), reported as rows/s; plus the initial sync's duration as the
  service logs it (the reference's "Synced N rows ... total: X ms", ours'
  "initial sync done: N rows ... in X s"), which leaves out process start-up.
* ``throughput`` — K = 1 and 16 subscribers × 1-row and 100-row transactions,
  written as fast as Postgres takes them; changes/s = data changes received by
  every subscriber / (last subscriber's final commit − the writer's first commit).
  Each point subscribes at the previous point's final watermark, so no point
  replays an earlier one.
* ``catchup`` (with ``throughput``) — after the points, one new subscriber at the
  watermark before the 100-row points reads all of their rows from the change log
  (stored: nothing is written meanwhile); rows/s from subscribing to the receipt of
  the last point's final commit.
* ``latency`` — one subscriber, 1-row transactions paced at ``--rate`` (1,000)
  transactions/s for ``--latency-seconds``; p50/p99 of receipt of each commit minus
  the commit's upstream commit time (``commitTime``, µs, from pgoutput; same host
  clock).

Memory: peak of the summed VmRSS of the service's process tree (ours: the Python
process and its SQLite writer process; the reference: node and its forked
workers), sampled every 100 ms, kept separately for the initial sync and the
streaming phases. CPU: the service's and
the subscriber process's CPU seconds per throughput point, to show contention.

Clean-up: the services are stopped by PID (SIGTERM, then SIGKILL for any process
left of their trees), both apps' slots and the ``hpd_*`` databases are dropped,
the work directories removed; each service's log is kept as
``$TMPDIR/hpd_<impl>_service.log`` for reading failures.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psycopg
from websockets.asyncio.client import connect

ROOT = Path(__file__).resolve().parent.parent
PG = "postgresql://postgres@127.0.0.1:5432"
UPSTREAM_DB = "hpd_upstream"
REF_CVR_DB = "hpd_ref_cvr"
REF_CHANGE_DB = "hpd_ref_cdb"
OURS_CHANGE_DB = "hpd_ours_cdb"
APP_IDS = {"ours": "csbench", "ref": "refbench"}
NAMES = {"ours": "ours", "ref": "reference"}
ZERO_CACHE = ROOT / "interop" / "node_modules" / ".bin" / "zero-cache"
CHANGESTREAMER = ROOT / ".venv" / "bin" / "changestreamer"

ADMIN_PASSWORD = "hpd-bench"
READY_TIMEOUT_S = 600.0
PROFILE_SECONDS = 5
STOP_TIMEOUT_S = 20.0
SUBSCRIBER_READY_TIMEOUT_S = 60.0
# Per point, on top of the writer's time: the service may lag the writer.
POINT_TIMEOUT_S = 240.0
# ~200 bytes of row data: 8 (id) + 4 (n) + 60 (title) + 128 (body).
TITLE_PAD = "t" * 48
BODY = "b" * 128


# --------------------------------------------------------------------- Postgres


def admin(sql: str, db: str = "postgres") -> list[tuple[Any, ...]]:
    """Run one statement with autocommit; rows if it returns any."""
    with psycopg.connect(f"{PG}/{db}", autocommit=True) as conn:
        cur = conn.execute(sql.encode())
        return cur.fetchall() if cur.description else []


def drop_slots(app_id: str) -> list[str]:
    """Drop every replication slot of ``app_id`` (slots are cluster-wide)."""
    pattern = app_id + r"\_%"
    rows = admin(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
        f"WHERE slot_name LIKE '{pattern}' AND active_pid IS NOT NULL"
    )
    # A terminated walsender releases its slot a moment later.
    deadline = time.monotonic() + 10
    while rows and time.monotonic() < deadline:
        busy = admin(
            f"SELECT 1 FROM pg_replication_slots WHERE slot_name LIKE '{pattern}' AND active"
        )
        if not busy:
            break
        time.sleep(0.1)
    dropped = admin(
        "SELECT slot_name, pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
        f"WHERE slot_name LIKE '{pattern}'"
    )
    return [str(r[0]) for r in dropped]


def recreate_databases(names: list[str]) -> None:
    for name in names:
        admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin(f"CREATE DATABASE {name}")


def drop_databases(names: list[str]) -> None:
    for name in names:
        admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def seed_upstream(rows: int) -> float:
    """Create ``hpd_big`` with ``rows`` rows and an empty ``hpd_load``; seconds taken."""
    start = time.monotonic()
    table = "(id bigint PRIMARY KEY, n int NOT NULL, title text NOT NULL, body text NOT NULL)"
    with psycopg.connect(f"{PG}/{UPSTREAM_DB}", autocommit=True) as conn:
        conn.execute(f"CREATE TABLE hpd_big {table}".encode())
        conn.execute(f"CREATE TABLE hpd_load {table}".encode())
        conn.execute(
            f"INSERT INTO hpd_big SELECT g, g % 1000, 'row ' || g || ' {TITLE_PAD}', '{BODY}' "
            f"FROM generate_series(1, {int(rows)}) g".encode()
        )
        conn.execute(b"VACUUM ANALYZE hpd_big")
    return time.monotonic() - start


class Writer:
    """The load: transactions into ``hpd_load``, batched into few round trips."""

    def __init__(self) -> None:
        self._conn = psycopg.connect(f"{PG}/{UPSTREAM_DB}", autocommit=True)
        # The writer's commit fsyncs are not what is measured; logical decoding sees
        # the commits all the same.
        self._conn.execute(b"SET synchronous_commit = off")
        self.next_id = 1

    def close(self) -> None:
        self._conn.close()

    def _tx_sql(self, rows: int, title: str | None = None) -> str:
        first = self.next_id
        self.next_id += rows
        title_expr = f"'{title}'" if title is not None else f"'row ' || g || ' {TITLE_PAD}'"
        return (
            f"BEGIN;INSERT INTO hpd_load SELECT g, g % 1000, {title_expr}, '{BODY}' "
            f"FROM generate_series({first}, {first + rows - 1}) g;COMMIT;"
        )

    def sentinel(self, sentinel: str) -> None:
        """A final 1-row transaction whose title the subscribers wait for.

        Committed synchronously: walsenders only decode flushed WAL, and with
        ``synchronous_commit = off`` the tail of a burst would wait for the WAL
        writer (up to ``wal_writer_delay``, 200 ms). A synchronous commit flushes
        everything before it too.
        """
        sql = self._tx_sql(1, sentinel).replace(
            "BEGIN;", "BEGIN;SET LOCAL synchronous_commit = on;"
        )
        self._conn.execute(sql.encode())

    def burst(self, transactions: int, rows: int) -> tuple[float, float]:
        """As fast as possible; (wall clock of the first send, seconds taken)."""
        per_trip = max(1, 200 // rows)
        started = time.time()
        t0 = time.monotonic()
        done = 0
        while done < transactions:
            n = min(per_trip, transactions - done)
            self._conn.execute("".join(self._tx_sql(rows) for _ in range(n)).encode())
            done += n
        return started, time.monotonic() - t0

    def paced(self, transactions: int, rate: float) -> float:
        """1-row transactions at ``rate`` per second; the achieved rate.

        Synchronous commits here (Postgres's default): each commit is flushed, so
        the walsender can send it at once; asynchronous ones would wait for the WAL
        writer and measure ``wal_writer_delay`` instead of the change-streamer.
        """
        self._conn.execute(b"SET synchronous_commit = on")
        try:
            t0 = time.monotonic()
            for i in range(transactions):
                delay = t0 + i / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                self._conn.execute(self._tx_sql(1).encode())
            return transactions / (time.monotonic() - t0)
        finally:
            self._conn.execute(b"SET synchronous_commit = off")


# -------------------------------------------------------------- process metrics


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants alive now."""
    tree = _children()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(tree.get(pid, []))
    return out


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of the given processes (live ones only)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


class RssSampler:
    """Peak summed VmRSS of a process tree, per phase, sampled every 100 ms."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.phase = "init"
        self.peaks_kib: dict[str, int] = {}
        self.pids: set[int] = {root}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            pids = process_tree(self.root)
            self.pids.update(pids)
            total = sum(rss_kib(p) for p in pids)
            self.peaks_kib[self.phase] = max(self.peaks_kib.get(self.phase, 0), total)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# ------------------------------------------------------------------- services


def free_port_block(n: int) -> int:
    """A port P with P .. P+n-1 all free (the reference uses P+1 and P+2)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n >= 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port block")


@dataclass
class Service:
    impl: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ws_url: str
    ready_url: str
    log_file: TextIO

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def start_service(impl: str, work: Path, our_change_db: str) -> Service:
    app_id = APP_IDS[impl]
    env = dict(os.environ)
    env.update(
        NODE_ENV="development",
        ZERO_CHANGE_STREAMER_STARTUP_DELAY_MS="0",
        ZERO_UPSTREAM_DB=f"{PG}/{UPSTREAM_DB}",
        ZERO_REPLICA_FILE=str(work / "replica.db"),
        ZERO_APP_ID=app_id,
        ZERO_SHARD_NUM="0",
        ZERO_LOG_LEVEL="info",
        ZERO_ADMIN_PASSWORD=ADMIN_PASSWORD,
    )
    log_path = work / "service.log"
    log_file = log_path.open("w")
    if impl == "ref":
        port = free_port_block(3)
        env.update(
            ZERO_NUM_SYNC_WORKERS="0",
            ZERO_PORT=str(port),
            ZERO_CVR_DB=f"{PG}/{REF_CVR_DB}",
            ZERO_CHANGE_DB=f"{PG}/{REF_CHANGE_DB}",
            ZERO_ENABLE_TELEMETRY="false",
        )
        cs_port = port + 1
        cmd = [str(ZERO_CACHE)]
        ready_url = f"http://127.0.0.1:{cs_port}/"
    else:
        cs_port = free_port_block(1)
        if our_change_db == "postgres":
            env["ZERO_CHANGE_DB"] = f"{PG}/{OURS_CHANGE_DB}"
        cmd = [str(CHANGESTREAMER), "serve", "--host", "127.0.0.1", "--port", str(cs_port)]
        ready_url = f"http://127.0.0.1:{cs_port}/ready"
    proc = subprocess.Popen(
        cmd, cwd=work, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    return Service(impl, proc, log_path, f"ws://127.0.0.1:{cs_port}", ready_url, log_file)


def wait_ready(service: Service, timeout: float) -> float:
    """Seconds until the readiness URL answers 200; raises if the process dies."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if service.proc.poll() is not None:
            raise RuntimeError(
                f"{service.impl} exited with {service.proc.returncode} before ready:\n"
                + service.log_tail()
            )
        try:
            with urllib.request.urlopen(service.ready_url, timeout=1) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{service.impl} not ready after {timeout:.0f} s:\n" + service.log_tail())


def stop_service(service: Service, pids: set[int]) -> None:
    """SIGTERM the service, then SIGKILL what is left of the processes it started."""
    if service.proc.poll() is None:
        service.proc.send_signal(signal.SIGTERM)
        try:
            service.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            service.proc.kill()
            service.proc.wait(5)
    # Forked workers normally exit with their parent; any straggler of this tree goes.
    for pid in pids:
        if pid != service.proc.pid and os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    service.log_file.close()


_VERSION = re.compile(r"current replica version is (\S+) \(requested")


async def probe_replica_version(ws_url: str) -> str:
    """The server's replica version, from its WrongReplicaVersion error to version "00"."""
    url = (
        f"{ws_url}/replication/v6/changes?taskID=&id=hpd-probe&mode=serving"
        "&watermark=00&replicaVersion=00&initial=true"
    )
    async with asyncio.timeout(30), connect(url, compression=None) as ws:
        frame = await ws.recv()
        assert isinstance(frame, str)
        await ws.send('{"ack":' + frame[6 : frame.index(",")] + "}")
        match = _VERSION.search(frame)
        if match is None:
            raise RuntimeError(f"unexpected probe answer: {frame[:300]}")
        return match.group(1)


# ------------------------------------------------------------------ subscribers


class Subscribers:
    """The ``bench.pg_subscribers`` process for one point."""

    def __init__(
        self,
        ws_url: str,
        k: int,
        replica_version: str,
        watermark: str,
        sentinel: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.sentinel = sentinel or f"hpd-end-{uuid.uuid4().hex}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.pg_subscribers",
                ws_url,
                str(k),
                replica_version,
                watermark,
                self.sentinel,
                "--timeout",
                str(POINT_TIMEOUT_S + 60),
                *extra_args,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self._lines: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self._lines.append(json.loads(line))
                self._cond.notify_all()
        with self._cond:
            self._lines.append({"event": "exit"})
            self._cond.notify_all()

    def wait_event(self, timeout: float) -> dict[str, Any]:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._lines), timeout):
                raise RuntimeError(f"subscribers: no event within {timeout:.0f} s")
            return self._lines.pop(0)

    def cpu(self) -> float:
        return cpu_seconds([self.proc.pid])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        self._reader.join(timeout=5)


def expect(event: dict[str, Any], name: str) -> dict[str, Any]:
    if event.get("event") != name:
        raise RuntimeError(f"subscribers: expected {name}, got {json.dumps(event)[:500]}")
    return event


# -------------------------------------------------------------------- results


@dataclass
class ImplResult:
    impl: str
    metrics: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class Options:
    scenarios: set[str]
    rows: int
    tx_1row: int
    tx_100row: int
    rate: float
    latency_seconds: float
    subscribers: list[int]
    our_change_db: str
    profile_ours: Path | None


# The reference: "Synced 1,000,001 rows of 5 tables in ... (... total: 2704.486 ms)";
# ours: "initial sync done: 1000001 rows in 5 tables in 11.7 s (85669 rows/s), ...".
_REF_SYNCED = re.compile(r"Synced [\d,]+ rows .*total: ([\d.]+) ms")
_OURS_SYNCED = re.compile(r"initial sync done: \d+ rows .* in ([\d.]+) s")


def _service_sync_ms(log: str) -> float | None:
    """The initial sync's duration as the service logs it."""
    if match := _REF_SYNCED.search(log):
        return float(match.group(1))
    if match := _OURS_SYNCED.search(log):
        return float(match.group(1)) * 1000
    return None


def capture_profile(service: Service, seconds: int, path: Path) -> threading.Thread:
    """Fetch ours' ``/profile`` (cProfile of the event loop) in the background."""
    port = service.ws_url.rsplit(":", 1)[1]
    request = urllib.request.Request(f"http://127.0.0.1:{port}/profile?seconds={seconds}")
    token = base64.b64encode(f":{ADMIN_PASSWORD}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")

    def fetch() -> None:
        try:
            with urllib.request.urlopen(request, timeout=seconds + 30) as r:
                path.write_bytes(r.read())
            print(f"  profile of ours written to {path}", flush=True)
        except OSError as e:
            print(f"  profile of ours failed: {e}", flush=True)

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    return thread


def run_point(
    service: Service,
    sampler: RssSampler,
    writer: Writer,
    k: int,
    rows: int,
    transactions: int,
    replica_version: str,
    watermark: str,
    profile: Path | None = None,
    sentinels: list[str] | None = None,
) -> tuple[dict[str, float], str]:
    """One throughput point; (metrics, the final watermark). Appends the point's
    sentinel to ``sentinels``."""
    subs = Subscribers(service.ws_url, k, replica_version, watermark)
    if sentinels is not None:
        sentinels.append(subs.sentinel)
    profiler: threading.Thread | None = None
    try:
        expect(subs.wait_event(SUBSCRIBER_READY_TIMEOUT_S), "ready")
        service_cpu0, subs_cpu0 = cpu_seconds(list(sampler.pids)), subs.cpu()
        if profile is not None:
            profiler = capture_profile(service, PROFILE_SECONDS, profile)
        started, write_s = writer.burst(transactions, rows)
        writer.sentinel(subs.sentinel)
        done = expect(subs.wait_event(POINT_TIMEOUT_S), "done")
        if profiler is not None:
            profiler.join(PROFILE_SECONDS + 35)
        service_cpu = cpu_seconds(list(sampler.pids)) - service_cpu0
        subs_cpu = subs.cpu() - subs_cpu0
    finally:
        subs.close()
    expected = transactions * rows + 1
    if min(done["changes"]) < expected:
        raise RuntimeError(f"subscribers got {done['changes']} changes, expected {expected}")
    elapsed = max(done["final_receipts"]) - started
    return {
        "changes_per_s": expected / elapsed,
        "elapsed_s": elapsed,
        "writer_changes_per_s": transactions * rows / write_s,
        "service_cpu_s": service_cpu,
        "subscriber_cpu_s": subs_cpu,
        "service_cpu_us_per_change": service_cpu / expected * 1e6,
    }, str(done["final_watermark"])


def run_catchup(
    service: Service, replica_version: str, watermark: str, sentinel: str
) -> dict[str, float]:
    """One subscriber reads from the change log what is already stored after
    ``watermark``, up to the commit carrying ``sentinel``: rows/s from opening its
    socket (not from starting its process, ~0.2 s of imports that count against
    neither implementation) to that commit's receipt (nothing is written meanwhile)."""
    subs = Subscribers(service.ws_url, 1, replica_version, watermark, sentinel)
    try:
        started = float(
            expect(subs.wait_event(SUBSCRIBER_READY_TIMEOUT_S), "ready")["connecting_at"]
        )
        done = expect(subs.wait_event(POINT_TIMEOUT_S), "done")
        subscriber_cpu = subs.cpu()
    finally:
        subs.close()
    rows = float(min(done["changes"]))
    elapsed = max(done["final_receipts"]) - started
    # The subscriber's CPU beside the elapsed time: near 1.0, the client is the limit.
    return {
        "rows_per_s": rows / elapsed,
        "rows": rows,
        "elapsed_s": elapsed,
        "subscriber_cpu_s": subscriber_cpu,
    }


def run_latency(
    service: Service,
    writer: Writer,
    opts: Options,
    replica_version: str,
    watermark: str,
) -> tuple[dict[str, float], str]:
    subs = Subscribers(service.ws_url, 1, replica_version, watermark)
    try:
        expect(subs.wait_event(SUBSCRIBER_READY_TIMEOUT_S), "ready")
        achieved = writer.paced(int(opts.rate * opts.latency_seconds), opts.rate)
        writer.sentinel(subs.sentinel)
        done = expect(subs.wait_event(POINT_TIMEOUT_S), "done")
    finally:
        subs.close()
    lat = sorted(done["latencies_ms"][:-1])  # the sentinel's commit is not paced
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {
        "p50_ms": q[49],
        "p99_ms": q[98],
        "max_ms": lat[-1],
        "achieved_tx_per_s": achieved,
        "commits": float(len(lat)),
    }, str(done["final_watermark"])


def run_impl(impl: str, opts: Options) -> ImplResult:
    result = ImplResult(impl)
    work = Path(tempfile.mkdtemp(prefix=f"hpd_{impl}_"))
    if impl == "ref":
        recreate_databases([REF_CVR_DB, REF_CHANGE_DB])
    elif opts.our_change_db == "postgres":
        recreate_databases([OURS_CHANGE_DB])
    # Both start from the same data: the big table and an empty load table.
    admin("TRUNCATE hpd_load", UPSTREAM_DB)
    writer = Writer()
    service = start_service(impl, work, opts.our_change_db)
    sampler = RssSampler(service.proc.pid)
    sampler.start()
    try:
        init_s = wait_ready(service, READY_TIMEOUT_S)
        result.metrics["ready_s"] = init_s
        if "init" in opts.scenarios:
            result.metrics["init_rows_per_s"] = opts.rows / init_s
            sync_ms = _service_sync_ms(service.log_path.read_text(errors="replace"))
            if sync_ms is not None:
                result.metrics["init_logged_rows_per_s"] = opts.rows / (sync_ms / 1000)
        sampler.phase = "stream"
        replica_version = asyncio.run(probe_replica_version(service.ws_url))
        watermark = replica_version
        if "throughput" in opts.scenarios:
            sentinels: list[str] = []
            before_100row = watermark
            for rows, transactions in ((1, opts.tx_1row), (100, opts.tx_100row)):
                if rows == 100:
                    before_100row = watermark
                for k in opts.subscribers:
                    profile = opts.profile_ours if impl == "ours" and (rows, k) == (1, 1) else None
                    point, watermark = run_point(
                        service,
                        sampler,
                        writer,
                        k,
                        rows,
                        transactions,
                        replica_version,
                        watermark,
                        profile,
                        sentinels,
                    )
                    for key, value in point.items():
                        result.metrics[f"tp_{rows}row_k{k}_{key}"] = value
                    print(
                        f"  {NAMES[impl]}: {rows}-row K={k}: {point['changes_per_s']:,.0f} "
                        f"changes/s (writer {point['writer_changes_per_s']:,.0f}/s, "
                        f"cpu service {point['service_cpu_s']:.1f} s, "
                        f"subscribers {point['subscriber_cpu_s']:.1f} s)",
                        flush=True,
                    )
            if "catchup" in opts.scenarios:
                # Every 100-row point's rows, stored: catch-up alone.
                catchup = run_catchup(service, replica_version, before_100row, sentinels[-1])
                for key, value in catchup.items():
                    result.metrics[f"catchup_{key}"] = value
                print(
                    f"  {NAMES[impl]}: catch-up of {catchup['rows']:,.0f} stored rows: "
                    f"{catchup['rows_per_s']:,.0f} rows/s in {catchup['elapsed_s']:.2f} s "
                    f"(subscriber CPU {catchup['subscriber_cpu_s']:.2f} s)",
                    flush=True,
                )
        if "latency" in opts.scenarios:
            lat, watermark = run_latency(service, writer, opts, replica_version, watermark)
            for key, value in lat.items():
                result.metrics[f"lat_{key}"] = value
            print(
                f"  {NAMES[impl]}: latency p50 {lat['p50_ms']:.2f} ms, "
                f"p99 {lat['p99_ms']:.2f} ms at {lat['achieved_tx_per_s']:,.0f} tx/s",
                flush=True,
            )
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"
        result.notes.append("service log tail:\n" + service.log_tail(60))
    finally:
        sampler.stop()
        stop_service(service, sampler.pids)
        writer.close()
        for phase, kib in sampler.peaks_kib.items():
            result.metrics[f"rss_{phase}_mib"] = kib / 1024
        dropped = drop_slots(APP_IDS[impl])
        result.notes.append(f"dropped slots: {dropped}")
        shutil.copy(service.log_path, Path(tempfile.gettempdir()) / f"hpd_{impl}_service.log")
        shutil.rmtree(work, ignore_errors=True)
    return result


# --------------------------------------------------------------------- report


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit in ("ms", "µs"):
        return f"{value:.2f}"
    return f"{value:,.0f}"


def report(results: dict[str, ImplResult], opts: Options) -> str:
    ours, ref = results.get("ours"), results.get("ref")
    rows: list[tuple[str, str, str, bool]] = []  # label, metric key, unit, higher is better
    if "init" in opts.scenarios:
        rows.append(
            (f"initial sync, {opts.rows:,} rows: rows/s (start→ready)", "init_rows_per_s", "", True)
        )
        rows.append(
            ("initial sync: rows/s (service's own log)", "init_logged_rows_per_s", "", True)
        )
        rows.append(("peak RSS during initial sync (MiB)", "rss_init_mib", "", False))
    if "throughput" in opts.scenarios:
        for r, n in ((1, opts.tx_1row), (100, opts.tx_100row)):
            for k in opts.subscribers:
                rows.append(
                    (
                        f"{r}-row tx, K={k}: changes/s to every subscriber ({n * r:,} changes)",
                        f"tp_{r}row_k{k}_changes_per_s",
                        "",
                        True,
                    )
                )
        for r in (1, 100):
            for k in opts.subscribers:
                rows.append(
                    (
                        f"{r}-row tx, K={k}: service CPU µs per change (all its processes)",
                        f"tp_{r}row_k{k}_service_cpu_us_per_change",
                        "µs",
                        False,
                    )
                )
    if "catchup" in opts.scenarios and "throughput" in opts.scenarios:
        rows.append(
            ("catch-up of the stored 100-row points: rows/s", "catchup_rows_per_s", "", True)
        )
    if "latency" in opts.scenarios:
        rows.append((f"latency p50 at {opts.rate:,.0f} tx/s (ms)", "lat_p50_ms", "ms", False))
        rows.append((f"latency p99 at {opts.rate:,.0f} tx/s (ms)", "lat_p99_ms", "ms", False))
    if opts.scenarios & {"throughput", "latency"}:
        rows.append(("peak RSS while streaming (MiB)", "rss_stream_mib", "", False))

    out = [
        "| scenario | ours | reference | ratio (ours/ref) | target met |",
        "|---|---:|---:|---:|:---:|",
    ]
    for label, key, unit, higher_is_better in rows:
        a = ours.metrics.get(key) if ours else None
        b = ref.metrics.get(key) if ref else None
        ratio = f"{a / b:.2f}" if a is not None and b else "—"
        if a is None or b is None:
            met = "—"
        else:
            met = "yes" if (a >= b if higher_is_better else a <= b) else "no"
        out.append(f"| {label} | {_fmt(a, unit)} | {_fmt(b, unit)} | {ratio} | {met} |")

    if "throughput" in opts.scenarios:
        out += [
            "",
            "CPU seconds per throughput point (service tree / subscriber process; 2 cores):",
            "",
            "| point | ours service | ours subscribers | ref service | ref subscribers |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in (1, 100):
            for k in opts.subscribers:
                p = f"tp_{r}row_k{k}_"
                cells = []
                for res in (ours, ref):
                    for what in ("service_cpu_s", "subscriber_cpu_s"):
                        v = res.metrics.get(p + what) if res else None
                        cells.append("—" if v is None else f"{v:.1f}")
                out.append(f"| {r}-row K={k} | " + " | ".join(cells) + " |")
    for res in (ours, ref):
        if res is not None and res.error:
            out += ["", f"**{NAMES[res.impl]} failed:** `{res.error}`"]
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Options]:
    parser = argparse.ArgumentParser(prog="bench.pg_e2e", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument(
        "--scenarios",
        default="init,throughput,catchup,latency",
        help="comma-separated: init, throughput, catchup (needs throughput), latency",
    )
    parser.add_argument("--impls", default="ours,ref", help="comma-separated, run in this order")
    parser.add_argument("--rows", type=int, help="initial-sync table rows (default 1,000,000)")
    parser.add_argument("--tx-1row", type=int, help="1-row transactions per point (20,000)")
    parser.add_argument("--tx-100row", type=int, help="100-row transactions per point (500)")
    parser.add_argument("--rate", type=float, default=1000.0, help="latency: transactions/s")
    parser.add_argument("--latency-seconds", type=float, help="latency: seconds of load (10)")
    parser.add_argument("--subscribers", default="1,16", help="K values for throughput")
    parser.add_argument("--our-change-db", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument(
        "--profile-ours",
        type=Path,
        help="write a cProfile (marshal) of ours' event loop during 1-row K=1 here",
    )
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    args = parser.parse_args(argv)
    quick = args.quick
    scenarios = {s.strip() for s in args.scenarios.split(",") if s.strip()}
    unknown = scenarios - {"init", "throughput", "catchup", "latency"}
    if unknown:
        parser.error(f"unknown scenarios: {sorted(unknown)}")
    rows = args.rows if args.rows is not None else (50_000 if quick else 1_000_000)
    opts = Options(
        scenarios=scenarios,
        rows=rows if "init" in scenarios else 0,
        tx_1row=args.tx_1row or (2_000 if quick else 20_000),
        tx_100row=args.tx_100row or (20 if quick else 500),
        rate=args.rate,
        latency_seconds=args.latency_seconds or (2.0 if quick else 10.0),
        subscribers=[int(k) for k in args.subscribers.split(",")],
        our_change_db=args.our_change_db,
        profile_ours=args.profile_ours,
    )
    return args, opts


def main(argv: list[str] | None = None) -> int:
    args, opts = parse_args(argv)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if set(impls) - set(APP_IDS):
        print(f"unknown impls: {impls}", file=sys.stderr)
        return 2
    all_dbs = [UPSTREAM_DB, REF_CVR_DB, REF_CHANGE_DB, OURS_CHANGE_DB]
    results: dict[str, ImplResult] = {}
    try:
        for app_id in APP_IDS.values():
            drop_slots(app_id)  # leftovers of an interrupted run
        recreate_databases([UPSTREAM_DB])
        seeded = seed_upstream(opts.rows)
        print(f"seeded {opts.rows:,} rows in {seeded:.1f} s", flush=True)
        for impl in impls:
            print(f"{NAMES[impl]}:", flush=True)
            results[impl] = run_impl(impl, opts)
            res = results[impl]
            if res.error:
                print(f"  {NAMES[impl]} FAILED: {res.error}", flush=True)
                for note in res.notes:
                    print("  " + note.replace("\n", "\n  "), flush=True)
    finally:
        for app_id in APP_IDS.values():
            drop_slots(app_id)
        drop_databases(all_dbs)
    table = report(results, opts)
    print()
    print(table)
    print()
    print(json.dumps({k: v.metrics for k, v in results.items()}, indent=1))
    if args.out is not None:
        args.out.write_text(table + "\n")
    return 1 if any(r.error for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
