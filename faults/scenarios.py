"""The faults, each a seeded loop under write load, and the figures each one yields.

Every fault runs in an :class:`Environment` of its own: a fresh ``flt_<fault>``
database, ``serve`` (initial sync of the empty tables, then streaming), the seeded
:class:`~faults.upstream.Writer` and :data:`FOLLOWERS` resuming followers. One
iteration waits for a seeded number of upstream commits (so faults land at
different points of the stream), injects the fault at ``t0``, and measures the
recovery: seconds from ``t0`` until every follower has received the first
transaction committed after ``t0``. Meanwhile ``/ready`` is sampled every 100 ms.

After the loop the writer stops, every follower must receive every ``seq``
Postgres holds, and the oracle (:mod:`faults.oracle`) counts lost and duplicated
transactions per follower and compares each follower's rows and the replica file
with Postgres, row by row.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import psycopg

from faults import oracle
from faults.service import APP_ID, Serve
from faults.subscriber import Follower, changes_url, flood, stalled, wrong_ack
from faults.upstream import PG_URL, Writer, pg_rows, scratch_database

T = TypeVar("T")

__all__ = ["FAST", "FAULTS", "FULL_ONLY", "Environment", "FaultResult", "run_fault"]

FOLLOWERS = 3
GRACE_S = 2
RECOVERY_TIMEOUT_S = 60.0
CATCH_UP_TIMEOUT_S = 90.0
ORPHAN_TIMEOUT_S = 10.0
# The faulty subscriber's own deadline: the grace period plus generous slack.
DROP_TIMEOUT_S = GRACE_S + 30.0


@dataclass
class FaultResult:
    fault: str
    iterations: int = 0
    lost: int = 0
    duplicated: int = 0
    recoveries: list[float] = field(default_factory=list)
    # Seconds from a faulty subscriber's connect until the server had dropped it.
    drops: list[float] = field(default_factory=list)
    # Seconds from a backup destination writable again until the backup caught up.
    backup_catch_ups: list[float] = field(default_factory=list)
    ready: Counter[str] = field(default_factory=Counter)
    metrics: list[str] = field(default_factory=list)
    log_line: str = ""
    orphans: list[str] = field(default_factory=list)
    peak_rss_kib: int = 0
    row_problems: list[str] = field(default_factory=list)
    replica_problems: list[str] = field(default_factory=list)
    notes: Counter[str] = field(default_factory=Counter)
    # The fault's own expectation not met (e.g. a faulty subscriber never dropped).
    fault_problems: list[str] = field(default_factory=list)
    skipped: str = ""
    seconds: float = 0.0
    transactions: int = 0
    # True once the oracle ran (after a fault that did not recover, it does not).
    verified: bool = False

    @property
    def ok(self) -> bool:
        return (
            self.verified
            and self.lost == 0
            and self.duplicated == 0
            and not self.orphans
            and not self.fault_problems
            and not self.row_problems
            and not self.replica_problems
        )

    def recovery(self) -> tuple[float, float] | None:
        if not self.recoveries:
            return None
        return statistics.median(self.recoveries), max(self.recoveries)


class ReadyWatch:
    """Samples ``/ready`` every 100 ms while open, counting its answers in ``answers``
    (the result's counter, so a stuck iteration keeps what was seen)."""

    def __init__(self, serve: Serve, answers: Counter[str]) -> None:
        self.serve = serve
        self.answers = answers
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ReadyWatch:
        self._task = asyncio.create_task(self._run(), name="flt-ready-watch")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while True:
            self.answers[await asyncio.to_thread(self.serve.ready)] += 1
            await asyncio.sleep(0.1)  # the sampling period


@dataclass
class Environment:
    """A running upstream + serve + writer + followers; see the module docstring."""

    url: str
    db_name: str
    serve: Serve
    writer: Writer
    followers: list[Follower]
    replica_version: str
    rng: random.Random

    def sub_url(self, sub_id: str) -> str:
        return changes_url(
            self.serve.port, sub_id, self.replica_version, self.replica_version, False
        )

    async def load(self, low: int = 5, high: int = 40) -> None:
        """Until the writer has committed a seeded number of further transactions."""
        target = self.writer.last_seq + self.rng.randint(low, high)
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while self.writer.last_seq < target:
            self.writer.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the writer did not reach seq {target}")
            await self.writer.first_commit_after(time.monotonic(), RECOVERY_TIMEOUT_S)

    async def recovery_since(self, t0: float, effective: float | None = None) -> float:
        """Seconds from ``t0`` until every follower got the first transaction committed
        after the fault took effect (``effective``, default ``t0``)."""
        seq = await self.writer.first_commit_after(effective or t0, RECOVERY_TIMEOUT_S)
        times = [await f.wait_seq(seq, RECOVERY_TIMEOUT_S) for f in self.followers]
        return max(times) - t0

    async def restart_ready(self) -> None:
        self.serve.start()
        await asyncio.to_thread(self.serve.wait_ready)
        for f in self.followers:
            f.port = self.serve.port


def _replica_version(path: Path) -> str:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        row = conn.execute('SELECT "replicaVersion" FROM "_zero.replicationConfig"').fetchone()
    finally:
        conn.close()
    return str(row[0])


@contextlib.asynccontextmanager
async def environment(
    fault: str,
    seed: int,
    workdir: Path,
    env: dict[str, str] | None = None,
    data_dir: Path | None = None,
) -> AsyncIterator[Environment]:
    db_name = f"flt_{fault}"
    async with scratch_database(db_name) as url:
        serve = Serve(
            workdir,
            url,
            {
                "ZERO_CHANGE_STREAMER_FLOW_CONTROL_SLOW_SUBSCRIBER_GRACE_PERIOD_SECONDS": str(
                    GRACE_S
                ),
                **(env or {}),
            },
            data_dir,
        )
        writer = Writer(url, seed)
        followers: list[Follower] = []
        try:
            serve.start()
            await asyncio.to_thread(serve.wait_ready)
            version = _replica_version(serve.replica_file)
            followers = [
                Follower(f"flt-follower-{i}", serve.port, version) for i in range(FOLLOWERS)
            ]
            for f in followers:
                f.start()
            writer.start()
            yield Environment(
                url, db_name, serve, writer, followers, version, random.Random(seed + 1)
            )
        finally:
            with contextlib.suppress(Exception):
                await writer.stop()
            for f in followers:
                await f.stop()
            await asyncio.to_thread(serve.close)


async def verify(env: Environment, result: FaultResult) -> None:
    """Stops the writer; every follower and the replica must then equal Postgres."""
    await env.writer.stop()
    truth = await oracle.snapshot(env.url)
    result.transactions = len(truth.seqs)
    if truth.seqs:
        for f in env.followers:
            await f.wait_seq(truth.seqs[-1], CATCH_UP_TIMEOUT_S)
    for f in env.followers:
        counts = oracle.stream_counts(f, truth)
        result.lost += len(counts.lost)
        result.duplicated += len(counts.duplicated)
        if counts.lost or counts.duplicated:
            result.row_problems.append(
                f"{f.name}: lost seq {counts.lost[:10]}, duplicated seq {counts.duplicated[:10]}"
            )
        result.row_problems.extend(oracle.row_differences(f, truth)[:10])
    if env.serve.alive():
        result.replica_problems = await oracle.wait_replica_matches(
            env.url, env.serve.replica_file, CATCH_UP_TIMEOUT_S
        )
    else:
        result.replica_problems = ["serve is not running: the replica was not compared"]
    result.peak_rss_kib = env.serve.peak_rss_kib
    result.verified = True


def _first_log_line(serve: Serve, pattern: str) -> str:
    for run in range(1, serve.runs + 1):
        line = serve.log_line(pattern, run)
        if line:
            return line
    return ""


# -- the faults -------------------------------------------------------------------


async def sigkill(env: Environment, result: FaultResult, iterations: int) -> None:
    """SIGKILL serve (only serve: its children must notice and exit), restart at once."""
    for _ in range(iterations):
        await env.load()
        async with ReadyWatch(env.serve, result.ready):
            t0 = time.monotonic()
            tree = env.serve.kill()
            dead = time.monotonic()
            children = tree[1:]
            result.notes[f"tree of {len(tree)} processes killed"] += 1
            restart = asyncio.create_task(env.restart_ready())
            orphans = await asyncio.to_thread(env.serve.orphans, children, ORPHAN_TIMEOUT_S)
            await restart
            result.orphans.extend(orphans)
            env.serve.reap([int(o.split()[0]) for o in orphans])
            result.recoveries.append(await env.recovery_since(t0, dead))
        result.iterations += 1
    result.metrics = env.serve.metrics(r"changestreamer_(running|transactions_total|lag_seconds)")
    result.log_line = _first_log_line(env.serve, r"is ahead of the durable change log")
    result.log_line = result.log_line or _first_log_line(env.serve, r"replicating slot .* from")


# This run's slot in pg_replication_slots (as ``s``); the parameter is its database.
_RUNS_SLOT = f"s.slot_name LIKE '{APP_ID}\\_0\\_%%' AND s.database = %s"


async def walsender(env: Environment, result: FaultResult, iterations: int) -> None:
    """pg_terminate_backend on the walsender of this run's slot."""
    for _ in range(iterations):
        await env.load()
        async with ReadyWatch(env.serve, result.ready):
            t0 = time.monotonic()
            ended = await pg_rows(
                PG_URL,
                "SELECT active_pid, pg_terminate_backend(active_pid) FROM pg_replication_slots s "
                f"WHERE {_RUNS_SLOT} AND active_pid IS NOT NULL",
                (env.db_name,),
            )
            result.notes[f"walsenders terminated: {len(ended)}"] += 1
            for pid, _ in ended:
                await _wait_for_async(partial(_backend_gone, pid), "the walsender to exit", 30)
            result.recoveries.append(await env.recovery_since(t0, time.monotonic()))
        result.iterations += 1
    result.metrics = env.serve.metrics(r"changestreamer_(running|lag_seconds)")
    result.log_line = _first_log_line(env.serve, r"change stream failed")


async def _backend_gone(pid: int) -> bool:
    rows = await pg_rows(PG_URL, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,))
    return not rows


async def _wait_for_async(
    check: Callable[[], Awaitable[bool]], what: str, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s} s")
        await asyncio.sleep(0.02)


async def _subscribers_active(env: Environment) -> int | None:
    lines = await asyncio.to_thread(
        env.serve.metrics, r'^changestreamer_subscribers\{state="active"\}'
    )
    return int(float(lines[0].split()[-1])) if lines else None


async def _wait_dropped(env: Environment, timeout_s: float) -> bool:
    """Until only the followers are connected again; False if that took too long."""
    deadline = time.monotonic() + timeout_s
    while (await _subscribers_active(env) or 0) > len(env.followers):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _stall(env: Environment, result: FaultResult, iterations: int, live: bool) -> None:
    for i in range(iterations):
        await env.load()
        async with ReadyWatch(env.serve, result.ready):
            # Live: at the followers' position, so it is in the forwarder's flow control
            # at once. Catch-up: at the replica version, so the whole change log is
            # still to be read from the change DB when it stops reading.
            watermark = env.followers[0].watermark if live else env.replica_version
            sub = stalled(
                changes_url(
                    env.serve.port, f"flt-stalled-{i}", env.replica_version, watermark, False
                )
            )
            await sub.open()
            t0 = time.monotonic()
            result.recoveries.append(await env.recovery_since(t0))
            if i == 0:
                result.metrics = env.serve.metrics(
                    r"changestreamer_(subscribers|subscriber_max_backlog|flow_control)"
                )
            if await _wait_dropped(env, DROP_TIMEOUT_S):
                result.drops.append(time.monotonic() - t0)
                closed = await sub.drain(DROP_TIMEOUT_S)
                result.notes[f"dropped ({closed.describe().rsplit(' after ', 1)[0]})"] += 1
            else:
                result.fault_problems.append(
                    f"stalled subscriber {i} still connected {DROP_TIMEOUT_S:.0f} s after it "
                    f"connected (grace period {GRACE_S} s)"
                )
                await sub.close()
        result.iterations += 1
    result.log_line = _first_log_line(env.serve, r"(disconnecting|dropping) subscriber flt-stalled")


async def stalled_subscriber(env: Environment, result: FaultResult, iterations: int) -> None:
    """A live subscriber that stops reading (and so never acks) after connecting."""
    await _stall(env, result, iterations, live=True)


async def stalled_in_catchup(env: Environment, result: FaultResult, iterations: int) -> None:
    """A subscriber that stops reading while it is caught up from the change log."""
    await _stall(env, result, iterations, live=False)


async def wrong_ack_subscriber(env: Environment, result: FaultResult, iterations: int) -> None:
    """A subscriber that acks frame 2 before frame 1."""
    for i in range(iterations):
        await env.load()
        async with ReadyWatch(env.serve, result.ready):
            t0 = time.monotonic()
            closed = await wrong_ack(env.sub_url(f"flt-wrongack-{i}"), DROP_TIMEOUT_S)
            result.recoveries.append(await env.recovery_since(t0))
        result.notes[f"dropped ({closed.describe().rsplit(' after ', 1)[0]})"] += 1
        result.iterations += 1
    result.metrics = env.serve.metrics(r"changestreamer_subscribers")
    result.log_line = _first_log_line(env.serve, r"closing stream: unexpected ack")


FLOOD_FRAMES = 5000
FLOOD_FRAME_BYTES = 1024


async def flooding_subscriber(env: Environment, result: FaultResult, iterations: int) -> None:
    """A subscriber that sends thousands of 1 KiB text frames without reading."""
    for i in range(iterations):
        await env.load()
        async with ReadyWatch(env.serve, result.ready):
            t0 = time.monotonic()
            closed = await flood(
                env.sub_url(f"flt-flood-{i}"), FLOOD_FRAMES, FLOOD_FRAME_BYTES, DROP_TIMEOUT_S
            )
            result.recoveries.append(await env.recovery_since(t0))
        result.notes[
            f"dropped ({closed.describe().rsplit(' after ', 1)[0]}, {closed.frames_sent} frames in)"
        ] += 1
        result.iterations += 1
    result.metrics = env.serve.metrics(r"changestreamer_subscribers")
    result.log_line = _first_log_line(env.serve, r"closing stream: error parsing ack")


def _move_aside(path: Path) -> list[tuple[Path, Path]]:
    moved = []
    for suffix in ("", "-wal", "-shm"):
        p = Path(str(path) + suffix)
        if p.exists():
            aside = Path(str(p) + ".flt-aside")
            p.rename(aside)
            moved.append((aside, p))
    return moved


async def change_db_garbage(env: Environment, result: FaultResult, iterations: int) -> None:
    """A garbage file where the change DB is at start; then the real one is put back."""
    serve = env.serve
    for i in range(iterations):
        await env.load()
        async with ReadyWatch(serve, result.ready):
            t0 = time.monotonic()
            code = await asyncio.to_thread(serve.terminate)
            stopped = time.monotonic()
            result.notes[f"clean stop: exit {code}"] += 1
            moved = _move_aside(serve.change_db_file)
            serve.change_db_file.write_bytes(random.Random(i).randbytes(8192))
            serve.start()
            code = await asyncio.to_thread(serve.wait_exit)
            errors = [ln for ln in serve.output().splitlines() if ln.startswith("changestreamer: ")]
            result.notes[f"start on garbage: exit {code}, {len(errors)} error line(s)"] += 1
            if errors and not result.log_line:
                result.log_line = errors[0]
            serve.change_db_file.unlink()
            for aside, original in moved:
                aside.rename(original)
            await env.restart_ready()
            result.recoveries.append(await env.recovery_since(t0, stopped))
        result.iterations += 1
    result.metrics = env.serve.metrics(r"changestreamer_(running|change_log_rows)")


def _litestream(serve: Serve) -> int | None:
    for pid in serve.tree()[1:]:
        if "litestream" in serve.seen.get(pid, "") and " replicate" in serve.seen[pid]:
            return pid
    return None


def _new_litestream(serve: Serve, old: int) -> int | None:
    pid = _litestream(serve)
    return pid if pid != old else None


async def litestream_killed(env: Environment, result: FaultResult, iterations: int) -> None:
    """SIGKILL to serve's litestream child (by PID); serve must notice and carry on."""
    serve = env.serve
    for _ in range(iterations):
        await env.load()
        pid = await _wait_for(lambda: _litestream(serve), "a litestream child", 60)
        async with ReadyWatch(serve, result.ready):
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            result.recoveries.append(await env.recovery_since(t0))
            new = await _wait_for(partial(_new_litestream, serve, pid), "a new litestream", 60)
            result.notes[f"litestream restarted after kill: {new != pid}"] += 1
            ready_after = await _wait_for(
                lambda: serve.ready() == "200" or None, "/ready 200 again", 60
            )
            result.notes[f"/ready back to 200: {ready_after}"] += 1
        result.iterations += 1
    result.metrics = serve.metrics(r"changestreamer_backup")
    result.log_line = _first_log_line(serve, r"litestream exited")


def _fill(path: Path) -> int:
    """Writes ``path`` until the file system is full; the bytes written."""
    written = 0
    with path.open("wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 512):
            block = b"\0" * chunk
            while True:
                try:
                    f.write(block)
                except OSError:
                    break
                written += chunk
    return written


DISK_FULL_COMMITS = 40


async def disk_full(env: Environment, result: FaultResult, iterations: int) -> None:
    """The file system of the replica and change DB full (a 20 MiB tmpfs) while the
    writer commits :data:`DISK_FULL_COMMITS` transactions; then the space is freed.
    Recovery here is measured from freeing the space."""
    serve = env.serve
    filler = serve.data_dir / "filler"
    for _ in range(iterations):
        await env.load()
        async with ReadyWatch(serve, result.ready):
            written = await asyncio.to_thread(_fill, filler)
            result.notes[f"filled {written >> 20} MiB"] += 1
            target = env.writer.last_seq + DISK_FULL_COMMITS
            while env.writer.last_seq < target:
                await env.writer.first_commit_after(time.monotonic(), RECOVERY_TIMEOUT_S)
            code = None if serve.alive() else serve.proc.returncode if serve.proc else None
            result.notes["serve kept running while full" if code is None else f"exit {code}"] += 1
            filler.unlink()
            t0 = time.monotonic()
            if not serve.alive():
                await env.restart_ready()
            result.recoveries.append(await env.recovery_since(t0))
        result.iterations += 1
    result.metrics = serve.metrics(r"changestreamer_(running|storer_queued_bytes|change_log_rows)")
    result.log_line = _first_log_line(serve, r"disk is full")


@contextlib.contextmanager
def _tmpfs(where: Path, size: str = "20m") -> Iterator[bool]:
    """A tmpfs mounted at ``where`` (True), or False if this process cannot mount."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(where)], capture_output=True)


async def _wait_for(check: Callable[[], T | None], what: str, timeout_s: float) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await asyncio.to_thread(check)
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s} s")
        await asyncio.sleep(0.05)


async def _pg_accepts() -> bool:
    try:
        async with await psycopg.AsyncConnection.connect(PG_URL, connect_timeout=2) as c:
            await c.execute(b"SELECT 1")
        return True
    except psycopg.OperationalError:
        return False


async def postgres_restart(env: Environment, result: FaultResult, iterations: int) -> None:
    """``pg_ctlcluster 15 main restart`` (the shared server: full command only)."""
    for _ in range(iterations):
        await env.load()
        async with ReadyWatch(env.serve, result.ready):
            t0 = time.monotonic()
            await asyncio.to_thread(
                subprocess.run,
                ["pg_ctlcluster", "15", "main", "restart"],
                check=True,
                capture_output=True,
                timeout=120,
            )
            deadline = time.monotonic() + 60
            while not await _pg_accepts():
                if time.monotonic() > deadline:
                    raise TimeoutError("Postgres does not accept connections after restart")
                await asyncio.sleep(0.1)
            back = time.monotonic()
            result.notes[f"Postgres back in {back - t0:.0f} s"] += 1
            result.recoveries.append(await env.recovery_since(t0, back))
        result.iterations += 1
        if not env.serve.alive():
            result.notes["serve exited"] += 1
            await env.restart_ready()
    result.metrics = env.serve.metrics(r"changestreamer_(running|lag_seconds)")
    result.log_line = _first_log_line(env.serve, r"change stream failed \(connection failed")


# Steps of the wall clock (CLOCK_REALTIME), seconds from true time, as an NTP step or
# an operator's ``date -s`` makes them; the monotonic clock runs on undisturbed.
CLOCK_OFFSETS = (3600, -3600, 86400, -86400, 300, -300)
# After each step, how long to keep watching for a late effect (a timer that fires
# on the wrong clock would drop a follower within a grace period or so).
CLOCK_SETTLE_S = GRACE_S + 1.0


def faketime_library() -> Path | None:
    """libfaketime's shared object (Debian's ``faketime`` package), if installed."""
    for found in sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1")):
        return found
    return None


def _set_clock_offset(path: Path, offset_s: int) -> None:
    """The offset libfaketime reads at every clock call (``FAKETIME_NO_CACHE``),
    replaced atomically so that no call reads a half-written file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{offset_s:+d}\n")
    tmp.replace(path)


def _connections(env: Environment) -> int:
    return sum(f.connections for f in env.followers)


def _no_reconnects(env: Environment, result: FaultResult, before: int, what: str) -> None:
    """A healthy follower must never be dropped because of the fault."""
    again = _connections(env) - before
    if again:
        ends = [e for f in env.followers for e in f.ends[-2:]]
        result.fault_problems.append(f"{what}: followers reconnected {again} time(s) ({ends})")


async def clock_jump(env: Environment, result: FaultResult, iterations: int) -> None:
    """The wall clock of serve's whole tree steps by minutes, hours or a day, forward
    and back (libfaketime, ``CLOCK_REALTIME`` only); every other step returns it to
    true time. Nothing may drop, stall or go unready."""
    clock_file = _clock_file(env.serve.workdir)
    offset = 0
    for _ in range(iterations):
        await env.load()
        new = 0 if offset else env.rng.choice(CLOCK_OFFSETS)
        before = _connections(env)
        async with ReadyWatch(env.serve, result.ready):
            t0 = time.monotonic()
            _set_clock_offset(clock_file, new)
            result.recoveries.append(await env.recovery_since(t0))
            await _wait_for_async(
                partial(_serve_clock_is, env, new), f"serve's clock at {new:+d} s", 30
            )
            await asyncio.sleep(CLOCK_SETTLE_S)
        result.notes[f"wall clock stepped {new - offset:+d} s"] += 1
        _no_reconnects(env, result, before, f"clock step {new - offset:+d} s")
        offset = new
        result.iterations += 1
    result.metrics = env.serve.metrics(
        r"changestreamer_(backup_wedged|backup_lag_seconds|backup_write_lag|lag_seconds)"
    )
    result.log_line = _first_log_line(env.serve, r"clock|backup wedged|dropping subscriber") or ""


async def _serve_clock_is(env: Environment, offset_s: int) -> bool:
    """True once serve's own wall clock is ``offset_s`` from Postgres' (±30 s), read
    from the time serve stamps on its standby status updates (``reply_time``)."""
    rows = await pg_rows(
        PG_URL,
        "SELECT extract(epoch FROM r.reply_time - now()) FROM pg_stat_replication r "
        "JOIN pg_replication_slots s ON s.active_pid = r.pid "
        f"WHERE {_RUNS_SLOT}",
        (env.db_name,),
    )
    return any(abs(float(skew) - offset_s) < 30 for (skew,) in rows if skew is not None)


# Longer than the grace period and the first-ack window's slack, shorter than a
# client's ping timeout: every timer of serve is due at once when it resumes.
PAUSE_S = 2 * GRACE_S + 1.0


async def pause(env: Environment, result: FaultResult, iterations: int) -> None:
    """SIGSTOP serve for :data:`PAUSE_S`, then SIGCONT (a VM or container freeze, a
    long stall): to serve the monotonic clock jumps forward by that much, and every
    timer fires together with the acks that waited in its sockets."""
    serve = env.serve
    assert serve.proc is not None
    for _ in range(iterations):
        await env.load()
        before = _connections(env)
        async with ReadyWatch(serve, result.ready):
            t0 = time.monotonic()
            serve.proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(PAUSE_S)
            serve.proc.send_signal(signal.SIGCONT)
            resumed = time.monotonic()
            result.recoveries.append(await env.recovery_since(t0, resumed) - (resumed - t0))
            await asyncio.sleep(CLOCK_SETTLE_S)
        result.notes[f"paused {PAUSE_S:.0f} s"] += 1
        _no_reconnects(env, result, before, "pause")
        result.iterations += 1
    result.metrics = serve.metrics(r"changestreamer_(subscribers|flow_control_waits)")
    result.log_line = _first_log_line(serve, r"dropping subscriber|held up") or ""


# How long the backup destination stays read-only each time.
UNWRITABLE_S = 10.0
BACKUP_CAUGHT_UP_S = 2.0


def _remount(where: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(where)], check=True, capture_output=True)


def _backup_lag(serve: Serve) -> float | None:
    lines = serve.metrics(r"^changestreamer_backup_lag_seconds ")
    return float(lines[0].split()[-1]) if lines else None


async def litestream_unwritable(env: Environment, result: FaultResult, iterations: int) -> None:
    """The backup destination (a tmpfs) remounted read-only for :data:`UNWRITABLE_S`
    while the writer commits, then writable again: streaming must not notice, and the
    backup must catch up by itself."""
    serve = env.serve
    backup = _backup_dir(serve.workdir)
    for _ in range(iterations):
        await env.load()
        await _wait_for(lambda: _litestream(serve), "a litestream child", 60)
        async with ReadyWatch(serve, result.ready):
            t0 = time.monotonic()
            await asyncio.to_thread(_remount, backup, "ro")
            try:
                result.recoveries.append(await env.recovery_since(t0))
                await asyncio.sleep(UNWRITABLE_S)
                lag = await asyncio.to_thread(_backup_lag, serve)
                result.notes[f"backup lag while read-only {_bucket(lag)}"] += 1
            finally:
                await asyncio.to_thread(_remount, backup, "rw")
            writable = time.monotonic()
            await _wait_for(
                lambda: (_backup_lag(serve) or 0.0) < BACKUP_CAUGHT_UP_S or None,
                "the backup to catch up",
                RECOVERY_TIMEOUT_S,
            )
            result.backup_catch_ups.append(time.monotonic() - writable)
        result.iterations += 1
    result.metrics = serve.metrics(r"changestreamer_backup")
    result.log_line = _first_log_line(serve, r"litestream.*(read-only|error|ERROR)") or ""


def _bucket(lag: float | None) -> str:
    if lag is None:
        return "unknown"
    return f"≥ {int(lag // 5) * 5} s"


FAULTS: dict[str, Callable[[Environment, FaultResult, int], Awaitable[None]]] = {
    "sigkill": sigkill,
    "walsender": walsender,
    "stalled_subscriber": stalled_subscriber,
    "stalled_in_catchup": stalled_in_catchup,
    "wrong_ack": wrong_ack_subscriber,
    "flood": flooding_subscriber,
    "change_db_garbage": change_db_garbage,
    "litestream_killed": litestream_killed,
    "disk_full": disk_full,
    "postgres_restart": postgres_restart,
    "clock_jump": clock_jump,
    "pause": pause,
    "litestream_unwritable": litestream_unwritable,
}
FAST = (
    "sigkill",
    "walsender",
    "stalled_subscriber",
    "stalled_in_catchup",
    "wrong_ack",
    "flood",
    "change_db_garbage",
    "clock_jump",
    "pause",
)
FULL_ONLY = ("postgres_restart",)


def _litestream_binary() -> bool:
    return (
        shutil.which("litestream") is not None
        or (Path(__file__).resolve().parents[1] / ".venv" / "bin" / "litestream").exists()
    )


def _backup_dir(workdir: Path) -> Path:
    return workdir / "backup"


def _clock_file(workdir: Path) -> Path:
    return workdir / "faketime"


def _litestream_env(workdir: Path) -> dict[str, str]:
    backup = _backup_dir(workdir)
    backup.mkdir(parents=True, exist_ok=True)
    return {
        "ZERO_LITESTREAM_BACKUP_URL": f"file://{backup}",
        "ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES": "0.005",
        "ZERO_LITESTREAM_VFS_PROBE_INTERVAL_MS": "100",
        "ZERO_LITESTREAM_LOG_LEVEL": "info",
        "ZERO_TASK_ID": "flt-rm",
    }


def _prepare(
    fault: str, where: Path, stack: contextlib.ExitStack
) -> tuple[dict[str, str], Path | None] | str:
    """The fault's extra settings and data directory, or why it cannot run here."""
    needs_root = fault in ("disk_full", "litestream_unwritable")
    uses_litestream = fault in ("litestream_killed", "litestream_unwritable", "clock_jump")
    if uses_litestream and not _litestream_binary():
        return "no litestream binary"
    if needs_root and os.geteuid() != 0:
        return "needs root (to mount a tmpfs)"
    if fault == "disk_full":
        data_dir = where / "data"
        if not stack.enter_context(_tmpfs(data_dir)):
            return "cannot mount a tmpfs"
        return {}, data_dir
    if fault == "litestream_unwritable":
        if not stack.enter_context(_tmpfs(_backup_dir(where), "64m")):
            return "cannot mount a tmpfs"
        return _litestream_env(where), None
    if fault == "litestream_killed":
        return _litestream_env(where), None
    if fault == "clock_jump":
        library = faketime_library()
        if library is None:
            return "no libfaketime (Debian package faketime)"
        where.mkdir(parents=True, exist_ok=True)
        _set_clock_offset(_clock_file(where), 0)
        return {
            **_litestream_env(where),
            "LD_PRELOAD": str(library),
            "FAKETIME_TIMESTAMP_FILE": str(_clock_file(where)),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }, None
    return {}, None


async def run_fault(
    fault: str, iterations: int, seed: int, workdir: Path | None = None
) -> FaultResult:
    """One fault's seeded loop in a fresh environment, verified by the oracle."""
    result = FaultResult(fault)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        where = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="flt_")))
        where = where / fault
        prepared = _prepare(fault, where, stack)
        if isinstance(prepared, str):
            result.skipped = prepared
            return result
        env_extra, data_dir = prepared
        async with environment(fault, seed, where, env_extra, data_dir) as env:
            try:
                await FAULTS[fault](env, result, iterations)
                await verify(env, result)
            except TimeoutError as e:
                # No recovery: what the operator would see of the stuck service.
                serve = env.serve
                stage = (
                    f"iteration {result.iterations + 1}"
                    if result.iterations < iterations
                    else "the final catch-up"
                )
                result.fault_problems.append(f"{stage}: {e}")
                result.fault_problems.append(
                    f"then: serve {'running' if serve.alive() else 'exited'}, "
                    f"/ready {serve.ready()}, last log line: {serve.tail(1)[:240]}"
                )
                result.metrics = serve.metrics(
                    r"changestreamer_(running|lag_seconds|storer_queued_bytes|transactions_total)"
                )
                result.peak_rss_kib = serve.peak_rss_kib
    result.seconds = time.monotonic() - started
    return result
