"""One ``changestreamer serve`` process under the harness, and what an operator sees of it.

:class:`Serve` starts the real console script in a work directory of its own (so no
``.env`` is read) with the environment a deployment would give it, by PID only:
SIGKILL, SIGTERM, restart with the same settings. It remembers every process of
its tree it has seen (serve, the replica follower ``python -m
app.runtime.log_follower``, the SQLite writer ``sqlite_group.py``, litestream) so
that after a kill :meth:`orphans` can say which of them outlived their parent.

The operator's view: ``/ready`` (status and reason), ``/metrics`` lines, and the
log, which every run appends to ``serve-<run>.log``. A background thread samples
the summed RSS of the live tree every 100 ms for the peak.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from bench.pg_e2e import free_port_block, process_tree, rss_kib

__all__ = ["APP_ID", "SERVE", "Serve", "http_get", "is_gone"]

REPO = Path(__file__).resolve().parents[1]
SERVE = REPO / ".venv" / "bin" / "changestreamer"
APP_ID = "flt"
READY_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 30.0
_SETTING_PREFIXES = ("ZERO_", "CHANGESTREAMER_", "NODE_ENV")


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int | None, str]:
    """(status, body); status None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError:
        return None, ""


def is_gone(pid: int) -> bool:
    """True once ``pid`` is not running (exited, or a zombie waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class Serve:
    """See the module docstring."""

    def __init__(
        self, workdir: Path, upstream: str, env: dict[str, str], data_dir: Path | None = None
    ) -> None:
        self.workdir = workdir
        # The replica and the change DB (beside it); the logs stay in ``workdir``.
        self.data_dir = data_dir or workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port_block(2)
        self.env = {
            "NODE_ENV": "development",
            "ZERO_CHANGE_STREAMER_STARTUP_DELAY_MS": "0",
            "ZERO_UPSTREAM_DB": upstream,
            "ZERO_REPLICA_FILE": str(self.replica_file),
            "ZERO_APP_ID": APP_ID,
            "ZERO_SHARD_NUM": "0",
            "ZERO_LITESTREAM_PORT": str(self.port + 1),
            # Subscribers resume from any commit of the run: nothing is purged.
            "CHANGESTREAMER_PURGE_DELAY_SECONDS": "3600",
            # The log up to the last line before a SIGKILL (not lost in a stdio buffer).
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0
        self.seen: dict[int, str] = {}  # pid -> command line, of every run
        self.peak_rss_kib = 0
        self._log: IO[bytes] | None = None
        self._sampling = threading.Event()
        self._sampler: threading.Thread | None = None

    @property
    def replica_file(self) -> Path:
        return self.data_dir / "replica.db"

    @property
    def change_db_file(self) -> Path:
        return self.data_dir / f"{APP_ID}_0-cdc.db"

    def log_file(self, run: int | None = None) -> Path:
        return self.workdir / f"serve-{run or self.runs}.log"

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        assert not self.alive(), "already running"
        self._close_log()
        self.runs += 1
        base = {k: v for k, v in os.environ.items() if not k.startswith(_SETTING_PREFIXES)}
        self._log = self.log_file().open("wb")
        self.proc = subprocess.Popen(
            [str(SERVE), "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=self.workdir,
            env={**base, **self.env},
            stdout=self._log,
            stderr=self._log,
        )
        if self._sampler is None:
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tree(self) -> list[int]:
        """serve and its descendants now (and remembers them)."""
        if not self.alive():
            return []
        assert self.proc is not None
        pids = process_tree(self.proc.pid)
        for pid in pids:
            if pid not in self.seen:
                self.seen[pid] = _cmdline(pid)
        return pids

    def kill(self) -> list[int]:
        """SIGKILL to serve only (by PID), as an OOM kill does; returns the tree it had."""
        pids = self.tree()
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        return pids

    def terminate(self, timeout_s: float = EXIT_TIMEOUT_S) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def orphans(self, pids: list[int], timeout_s: float) -> list[str]:
        """Of ``pids`` (a killed run's tree), those still running after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = [p for p in pids if not is_gone(p)]
            if not left or time.monotonic() >= deadline:
                return [f"{p} {self.seen.get(p, '?')}" for p in left]
            time.sleep(0.05)

    def reap(self, pids: list[int]) -> None:
        """SIGKILL, by PID, to processes of this harness's serve trees still running."""
        for pid in pids:
            if pid in self.seen and not is_gone(pid):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        """Kills whatever of the trees it started is still running."""
        pids = self.tree()
        if self.alive():
            self.kill()
        self.reap([*pids, *self.seen])
        self._sampling.set()
        if self._sampler is not None:
            self._sampler.join(5)
        self._close_log()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Seconds until ``/ready`` answered 200; raises if serve exits first."""
        t0 = time.monotonic()
        while True:
            assert self.proc is not None
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"serve exited with {code} before ready:\n{self.tail()}")
            if http_get(self.url("/ready"))[0] == 200:
                self.tree()
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"serve not ready in {timeout_s} s:\n{self.tail()}")
            time.sleep(0.05)

    def wait_exit(self, timeout_s: float = EXIT_TIMEOUT_S) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    # -- what the operator sees -----------------------------------------------

    def ready(self) -> str:
        """``/ready`` as one short string: ``200``, ``503 <reason>`` or ``no answer``."""
        status, body = http_get(self.url("/ready"))
        if status is None:
            return "no answer"
        if status == 200:
            return "200"
        try:
            reason = str(json.loads(body).get("reason", ""))
        except ValueError:
            reason = body
        return f"{status} {reason}".strip()

    def metrics(self, pattern: str) -> list[str]:
        """The ``/metrics`` sample lines whose text matches ``pattern``."""
        status, body = http_get(self.url("/metrics"), timeout_s=5)
        if status != 200:
            return []
        regex = re.compile(pattern)
        return [ln for ln in body.splitlines() if not ln.startswith("#") and regex.search(ln)]

    def output(self, run: int | None = None) -> str:
        path = self.log_file(run)
        return path.read_text(errors="replace") if path.exists() else ""

    def log_line(self, pattern: str, run: int | None = None) -> str | None:
        """The first line of run ``run``'s log matching ``pattern``."""
        regex = re.compile(pattern)
        for line in self.output(run).splitlines():
            if regex.search(line):
                return line.strip()
        return None

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    # -- internals ----------------------------------------------------------

    def _sample(self) -> None:
        while not self._sampling.wait(0.1):
            pids = self.tree()
            self.peak_rss_kib = max(self.peak_rss_kib, sum(rss_kib(p) for p in pids))

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
