"""``changestreamer serve`` over a real Postgres upstream, run as a child process.

The fixtures here start the real console script (``.venv/bin/changestreamer serve``)
with the environment a deployment would give it, in a per-test work directory (so
no ``.env`` is read), against a scratch database named after the test. Every child
is killed by its PID in teardown, and every wait is bounded.

Helpers read the three places a test needs to look at: Postgres (rows, the slot),
the replica file (rows, ``replicationConfig`` / ``replicationState``) and the change
DB (``replicationState.lastWatermark``, ``changeLog``). The SQLite files are opened
read-only, so reading them never blocks or changes the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests import waiting
from tests.pgdb import scratch_database

REPO = Path(__file__).resolve().parents[2]
SERVE = REPO / ".venv" / "bin" / "changestreamer"
APP_ID = "hpf"
# Initial sync of a few hundred rows plus Python start-up; generous for a loaded 2-core box.
READY_TIMEOUT_S = 45.0
EXIT_TIMEOUT_S = 30.0
POLL_S = 0.05
# Variables of the test runner's environment that would change the service's settings.
_SETTING_PREFIXES = ("ZERO_", "CHANGESTREAMER_", "NODE_ENV")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Serve:
    """One ``serve`` configuration in one work directory; it can be started again
    (with the same environment) after it was killed or exited."""

    def __init__(self, workdir: Path, upstream: str, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.env = {
            "NODE_ENV": "development",
            "ZERO_CHANGE_STREAMER_STARTUP_DELAY_MS": "0",
            "ZERO_UPSTREAM_DB": upstream,
            "ZERO_REPLICA_FILE": str(self.replica_file),
            "ZERO_APP_ID": APP_ID,
            "ZERO_SHARD_NUM": "0",
            # Tests here read every stored transaction back from the change log, so
            # nothing is purged during them; test_backups sets its own delay.
            "CHANGESTREAMER_PURGE_DELAY_SECONDS": "3600",
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.runs = 0
        self._log: IO[bytes] | None = None

    @property
    def replica_file(self) -> Path:
        return self.workdir / "replica.db"

    @property
    def change_db_file(self) -> Path:
        return self.workdir / f"{APP_ID}_0-cdc.db"

    @property
    def log_file(self) -> Path:
        return self._log_file(self.runs)

    def _log_file(self, run: int) -> Path:
        return self.workdir / f"serve-{run}.log"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self._close_log()
        self.runs += 1
        base = {k: v for k, v in os.environ.items() if not k.startswith(_SETTING_PREFIXES)}
        self._log = self.log_file.open("wb")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [str(SERVE), "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=self.workdir,
            env={**base, **self.env},
            stdout=self._log,
            stderr=self._log,
        )

    def seconds_running(self) -> float:
        """Since the current (or last) run started."""
        return time.monotonic() - self.started_at

    def output(self, run: int | None = None) -> str:
        """What run ``run`` (1-based; default the current or last) wrote to stdout and stderr."""
        run = run or self.runs
        return self._log_file(run).read_text(errors="replace") if run else ""

    def _tail(self) -> str:
        return "\n".join(self.output().splitlines()[-25:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until ``/ready`` answers 200; fails at once if the process exits."""
        url = f"http://127.0.0.1:{self.port}/ready"

        async def ready() -> bool:
            assert self.proc is not None
            code = self.proc.poll()
            assert code is None, f"serve exited with {code} before ready:\n{self._tail()}"
            return await asyncio.to_thread(_http_status, url) == 200

        await waiting.eventually(
            ready, lambda: f"serve to be ready:\n{self._tail()}", timeout_s, poll_s=POLL_S * 4
        )

    async def wait_exit(self, timeout_s: float = EXIT_TIMEOUT_S) -> int:
        """The exit code; fails (and kills it) if it is still running after ``timeout_s``."""
        proc = self.proc
        assert proc is not None
        try:
            await waiting.eventually(
                lambda: proc.poll() is not None,
                lambda: f"serve to exit:\n{self._tail()}",
                timeout_s,
                poll_s=POLL_S,
            )
        except AssertionError:
            self.kill()
            raise
        return proc.returncode

    async def wait_output(self, pattern: str, timeout_s: float = READY_TIMEOUT_S) -> str:
        """The first output line matching ``pattern`` (a regex), waiting for it."""
        regex = re.compile(pattern)

        def matching() -> str | None:
            return next((line for line in self.output().splitlines() if regex.search(line)), None)

        line: str = await waiting.eventually(
            matching,
            lambda: f"a line matching {pattern!r}:\n{self._tail()}",
            timeout_s,
            poll_s=POLL_S * 2,
        )
        return line

    def kill(self) -> None:
        """SIGKILL, by PID: what a crash or an OOM kill does."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    async def terminate(self, timeout_s: float = EXIT_TIMEOUT_S) -> None:
        """SIGTERM, and checks that it was a clean shutdown.

        uvicorn re-raises the signal it caught once shutdown is complete, so a clean
        stop ends "killed by SIGTERM" (143 in a shell), after its shutdown lines.
        """
        assert self.proc is not None
        assert self.proc.poll() is None, f"serve is not running:\n{self._tail()}"
        self.proc.send_signal(signal.SIGTERM)
        code = await self.wait_exit(timeout_s)
        assert code in (0, -signal.SIGTERM), f"exit {code}:\n{self._tail()}"
        assert "Application shutdown complete" in self.output(), self._tail()

    def close(self) -> None:
        self.kill()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _http_status(url: str, timeout_s: float = 2) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


ServeFactory = Callable[..., Serve]


@pytest.fixture
def serve_factory(tmp_path: Path) -> Iterator[ServeFactory]:
    """``make(upstream, **env)`` → a :class:`Serve` (not started); all are killed after."""
    made: list[Serve] = []

    def make(upstream: str, workdir: Path | None = None, **env: str) -> Serve:
        where = workdir or tmp_path / f"serve{len(made)}"
        where.mkdir(parents=True, exist_ok=True)
        serve = Serve(where, upstream, env)
        made.append(serve)
        return serve

    yield make
    for serve in made:
        serve.close()


def _db_name(test_name: str) -> str:
    # Postgres identifiers are at most 63 bytes; the prefix keeps us apart from others.
    return ("hpf_" + re.sub(r"[^a-z0-9_]", "_", test_name.lower().removeprefix("test_")))[:60]


@pytest.fixture
async def upstream(pg_url: str, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """A scratch upstream database for this test (its slots are dropped with it)."""
    async with scratch_database(pg_url, _db_name(request.node.name)) as url:
        yield url


# -- Postgres -------------------------------------------------------------------


async def pg_execute(url: str, *statements: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for statement in statements:
            await conn.execute(statement.encode())


async def pg_rows(url: str, query: str) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(query.encode())
        return await cur.fetchall()


def lsn_int(lsn: str) -> int:
    high, low = lsn.split("/")
    return (int(high, 16) << 32) | int(low, 16)


async def app_slots(url: str) -> list[tuple[str, int | None, int | None]]:
    """This app's slots in the test's database: (name, confirmed_flush_lsn, active_pid)."""
    rows = await pg_rows(
        url,
        "SELECT slot_name, confirmed_flush_lsn::text, active_pid FROM pg_replication_slots "
        f"WHERE database = current_database() AND slot_name LIKE '{APP_ID}\\_0\\_%' "
        "ORDER BY slot_name",
    )
    return [(name, lsn_int(lsn) if lsn else None, pid) for name, lsn, pid in rows]


# -- SQLite ---------------------------------------------------------------------


@contextlib.contextmanager
def lite(path: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection; it waits out the writer's locks for a while."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        yield conn
    finally:
        conn.close()


def lite_rows(path: Path, query: str) -> list[tuple[Any, ...]]:
    with lite(path) as conn:
        return conn.execute(query).fetchall()


def replica_versions(path: Path) -> tuple[str, str]:
    """The replica's (replicaVersion, stateVersion)."""
    rows = lite_rows(
        path,
        'SELECT c."replicaVersion", s."stateVersion" FROM "_zero.replicationConfig" c '
        'JOIN "_zero.replicationState" s ON c.lock = s.lock',
    )
    assert len(rows) == 1, rows
    return rows[0][0], rows[0][1]


def change_db_watermark(path: Path) -> str:
    rows = lite_rows(path, 'SELECT "lastWatermark" FROM "replicationState"')
    assert len(rows) == 1, rows
    watermark: str = rows[0][0]
    return watermark


async def eventually(
    check: Callable[[], Any], what: str, timeout_s: float = READY_TIMEOUT_S
) -> Any:
    """``tests.waiting.eventually`` with a serve's patience: a start-up takes a while."""
    return await waiting.eventually(check, what, timeout_s, poll_s=POLL_S * 2)


# -- Processes and files -----------------------------------------------------------


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def descendants(serve: Serve) -> list[tuple[int, str]]:
    """The live processes below ``serve``'s (its children and theirs)."""
    assert serve.proc is not None
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = rest.split()
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
            names[int(entry)] = head.split("(", 1)[1]
    found: list[tuple[int, str]] = []
    frontier = {serve.proc.pid}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier}
        found += [(pid, names[pid]) for pid in sorted(frontier)]
    return found


def integrity(replica: Path) -> str:
    """SQLite's verdict on the file, read-only ("ok" when whole)."""
    with sqlite3.connect(f"file:{replica}?mode=ro", uri=True) as conn:
        return str(conn.execute("PRAGMA integrity_check(1)").fetchone()[0])


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    """``path`` and everything in it made immutable (``chattr +i``): readable, but
    nothing can write there, root included (ext4)."""
    subprocess.run(["chattr", "-R", "+i", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-R", "-i", str(path)], check=True)


# -- A workload and the row-by-row comparison ------------------------------------

SCHEMA = (
    "CREATE TABLE items (id int PRIMARY KEY, n bigint NOT NULL, s text, f float8, b bool, "
    "j jsonb, ts timestamptz)",
    # One row per writer transaction: its sequence number and xid, so a lost or
    # repeated transaction is visible (item updates are idempotent to replay).
    "CREATE TABLE ledger (seq int PRIMARY KEY, xid bigint NOT NULL)",
    "INSERT INTO items SELECT g, g * 1000, 'row ' || g, g / 3.0, g % 2 = 0, "
    "jsonb_build_object('g', g, 'tags', jsonb_build_array('a', g)), "
    "'2024-01-01 00:00:00+00'::timestamptz + g * interval '1.5 ms' "
    "FROM generate_series(1, 200) g",
)
INITIAL_ITEMS = 200
# Postgres side of the comparison, in the replica's representation: booleans as
# 0/1, jsonb as its text, timestamps as exact epoch microseconds (÷ 1000 below).
_PG_ITEMS = (
    "SELECT id, n, s, f, b::int, j::text, (extract(epoch FROM ts) * 1000000)::bigint "
    "FROM items ORDER BY id"
)
_LITE_ITEMS = "SELECT id, n, s, f, b, j, ts FROM items ORDER BY id"


async def create_workload_schema(url: str) -> None:
    await pg_execute(url, *SCHEMA)


class Writer:
    """Many small transactions (insert / update / delete mixes) and one big one,
    each recording itself in ``ledger``; ``committed`` maps seq → xid once the
    commit returned."""

    def __init__(self, url: str, *, big_at: int = 25, big_rows: int = 1500, seed: int = 7) -> None:
        self.url = url
        self.big_at = big_at
        self.big_rows = big_rows
        self.rng = random.Random(seed)
        self.committed: dict[int, int] = {}
        self.ids = list(range(1, INITIAL_ITEMS + 1))
        self.next_id = 1_000_000
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts writing (again, after ``finish``: sequence numbers and ids go on)."""
        self.stop.clear()
        self.task = asyncio.create_task(self._run(), name="hpf-writer")

    def check(self) -> None:
        """Raises the writer's own failure, so a wait does not run into its timeout."""
        if self.task is not None and self.task.done() and not self.stop.is_set():
            self.task.result()
            raise AssertionError("the writer stopped early")

    async def wait_stored(self, change_db: Path, count: int, timeout_s: float = 30.0) -> None:
        """Until the change DB holds ``count`` of this writer's transactions."""

        def enough() -> bool:
            self.check()
            mine = set(self.committed.values())
            return sum(xid in mine for xid in stored_xids(change_db)) >= count

        await eventually(enough, f"{count} writer transactions in the change DB", timeout_s)

    async def finish(self, timeout_s: float = 30.0) -> None:
        self.stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, timeout_s)

    async def _run(self, max_tx: int = 100_000) -> None:
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            first = max(self.committed, default=0) + 1
            for seq in range(first, first + max_tx):
                if self.stop.is_set():
                    return
                await self._one(conn, seq)
                # Paced, not a wait: the point is many commits across kills, not
                # load on 2 cores.
                await asyncio.sleep(0.004)

    async def _one(self, conn: psycopg.AsyncConnection[Any], seq: int) -> None:
        rng = self.rng
        ids = list(self.ids)
        next_id = self.next_id
        async with conn.transaction():
            if seq == self.big_at:
                await conn.execute(
                    "INSERT INTO items SELECT g, g, repeat('big', g %% 7), g * 0.25, true, "
                    "jsonb_build_object('big', g), now() FROM generate_series(%s, %s) g",
                    (next_id, next_id + self.big_rows - 1),
                )
                ids.extend(range(next_id, next_id + self.big_rows))
                next_id += self.big_rows
            for _ in range(rng.randint(1, 3)):
                op = rng.random()
                if op < 0.45 or len(ids) < 10:
                    s = rng.choice([None, f"new {next_id}", 'é✓ "quoted" \\ tab\t', ""])
                    await conn.execute(
                        "INSERT INTO items VALUES (%s, %s, %s, %s, %s, %s, now())",
                        (
                            next_id,
                            rng.randint(-(2**62), 2**62),
                            s,
                            rng.random() * 1e6,
                            rng.random() < 0.5,
                            Jsonb({"seq": seq, "s": s}),
                        ),
                    )
                    ids.append(next_id)
                    next_id += 1
                elif op < 0.8:
                    target = rng.choice(ids)
                    await conn.execute(
                        "UPDATE items SET n = n + 1, s = %s, f = %s, b = NOT b, "
                        "j = jsonb_set(coalesce(j, '{}'), '{u}', to_jsonb(%s::int)), "
                        "ts = now() WHERE id = %s",
                        (f"u{seq}", rng.uniform(-1, 1), seq, target),
                    )
                else:
                    target = ids.pop(rng.randrange(len(ids)))
                    await conn.execute("DELETE FROM items WHERE id = %s", (target,))
            cur = await conn.execute(
                "INSERT INTO ledger VALUES (%s, pg_current_xact_id()::xid::text::bigint) "
                "RETURNING xid",
                (seq,),
            )
            row = await cur.fetchone()
            assert row is not None
        self.committed[seq] = row[0]
        self.ids = ids
        self.next_id = next_id


def _pg_item(row: tuple[Any, ...]) -> tuple[Any, ...]:
    *rest, ts_us = row
    return (*rest, None if ts_us is None else ts_us / 1000)


async def compare_with_upstream(url: str, replica: Path) -> list[str]:
    """Differences between Postgres and the replica, row by row, every column ([] = same)."""
    expected = {r[0]: _pg_item(r) for r in await pg_rows(url, _PG_ITEMS)}
    actual = {r[0]: tuple(r) for r in lite_rows(replica, _LITE_ITEMS)}
    problems = [
        f"items {key}: upstream {expected.get(key)} replica {actual.get(key)}"
        for key in sorted(expected.keys() | actual.keys())
        if expected.get(key) != actual.get(key)
    ]
    ledger = await pg_rows(url, "SELECT seq, xid FROM ledger ORDER BY seq")
    lite_ledger = lite_rows(replica, "SELECT seq, xid FROM ledger ORDER BY seq")
    if [tuple(r) for r in ledger] != lite_ledger:
        missing = sorted(set(map(tuple, ledger)) - set(lite_ledger))
        extra = sorted(set(lite_ledger) - set(map(tuple, ledger)))
        problems.append(f"ledger: missing from replica {missing[:10]}, extra {extra[:10]}")
    return problems


async def wait_until_replica_matches(url: str, replica: Path, timeout_s: float = 45.0) -> None:
    """Polls until the replica equals upstream; on timeout fails with the differences."""
    problems: list[str] = []

    async def matches() -> bool:
        nonlocal problems
        problems = await compare_with_upstream(url, replica)
        return not problems

    await waiting.eventually(
        matches,
        lambda: (
            f"the replica to match upstream; {len(problems)} differences:\n"
            + "\n".join(problems[:20])
        ),
        timeout_s,
        poll_s=0.2,
    )


def stored_xids(change_db: Path) -> list[int]:
    """The upstream xid of every transaction in the change log (one per stored begin)."""
    rows = lite_rows(change_db, 'SELECT change FROM "changeLog" WHERE pos = 0')
    return [json.loads(change)["xid"] for (change,) in rows if "xid" in json.loads(change)]


async def start_ready(upstream: str, serve_factory: ServeFactory, **env: str) -> Serve:
    """The workload schema upstream, then a serve process with ``env``, ready."""
    await create_workload_schema(upstream)
    serve = serve_factory(upstream, **env)
    serve.start()
    await serve.wait_ready()
    return serve
