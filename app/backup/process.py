"""litestream as a supervised child: run it, fold its log into ours, restart it.

``LitestreamRunner.run`` starts ``litestream replicate -config <rendered>
-no-expand-env`` and keeps it running until ``stop``: when the child exits it is
started again after a backoff (1 s doubling to 60 s, back to 1 s once a child ran
for a minute). Every line the child prints is logged under ``litestream`` at the
level litestream gave it (text or JSON log format), so one log shows both.

``run_litestream`` runs one short command (``restore``, ``version``) with a time
limit, for the restore path and the start-up check.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from app.backup.config import BackupConfigError, LitestreamOptions, render
from app.sources.backoff import Backoff

__all__ = [
    "LitestreamRunner",
    "RunnerState",
    "check_version",
    "run_litestream",
    "write_config",
]

log = logging.getLogger("litestream")

RESTART_INITIAL_S: Final = 1.0
RESTART_MAX_S: Final = 60.0
# A child that ran this long was healthy: the next restart waits RESTART_INITIAL_S.
STABLE_AFTER_S: Final = 60.0
STOP_TIMEOUT_S: Final = 10.0
# Longest log line we read from the child; longer ones are cut.
MAX_LINE: Final = 64 * 1024
RECENT_LINES: Final = 20

_LEVELS: Final = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
}
_TEXT_LEVEL = re.compile(r"\blevel=([A-Za-z]+)")
_TEXT_TIME = re.compile(r"^time=\S+\s+")


def write_config(options: LitestreamOptions) -> Path:
    """Renders the configuration beside the replica (``.<replica>.litestream.yml``)."""
    path = options.replica_file.with_name(f".{options.replica_file.name}.litestream.yml")
    text = render(options)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


@dataclass(slots=True)
class RunnerState:
    """What /statz and /metrics say about the child."""

    pid: int | None = None
    starts: int = 0
    last_exit: int | None = None
    last_exit_at: float | None = None
    recent_errors: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT_LINES))


class LitestreamRunner:
    """Keeps ``litestream replicate`` running for one replica."""

    def __init__(self, options: LitestreamOptions) -> None:
        self._options = options
        self.state = RunnerState()
        self._stopped = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def run(self) -> None:
        """Runs the child until ``stop``, restarting it with backoff when it exits."""
        backoff = Backoff(RESTART_INITIAL_S, RESTART_MAX_S)
        while not self._stopped.is_set():
            started = time.monotonic()
            try:
                code = await self._run_once()
            except (OSError, BackupConfigError) as e:
                log.error("cannot start litestream: %s", e)
                self.state.recent_errors.append(str(e))
                code = None
            if self._stopped.is_set():
                return
            if time.monotonic() - started >= STABLE_AFTER_S:
                backoff.reset()
            delay = backoff.next_delay()
            log.warning("litestream exited (code %s); restarting in %.0f s", code, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), delay)

    async def stop(self) -> None:
        """Stops the child (SIGTERM, then SIGKILL after STOP_TIMEOUT_S)."""
        self._stopped.set()
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def _run_once(self) -> int:
        config = await asyncio.to_thread(write_config, self._options)
        proc = await asyncio.create_subprocess_exec(
            str(self._options.executable),
            "replicate",
            "-config",
            str(config),
            "-no-expand-env",
            env=self._options.environment(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            limit=MAX_LINE,
            start_new_session=True,  # a ^C to serve reaches us, and we stop it in order
        )
        self._proc = proc
        self.state.pid = proc.pid
        self.state.starts += 1
        log.info(
            "litestream started (pid %d), backing up to %s", proc.pid, self._options.backup_url
        )
        assert proc.stdout is not None
        try:
            await self._relay(proc.stdout)
            code = await proc.wait()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        self.state.last_exit = code
        self.state.last_exit_at = time.time()
        self.state.pid = None
        return code

    async def _relay(self, stream: asyncio.StreamReader) -> None:
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line over MAX_LINE: skip what is left of it
                raw = await stream.read(MAX_LINE)
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            level, text = parse_line(line)
            if level >= logging.WARNING:
                self.state.recent_errors.append(text)
            log.log(level, "%s", text)


def parse_line(line: str) -> tuple[int, str]:
    """litestream's level and message from one of its log lines (text or JSON)."""
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except ValueError:
            return logging.INFO, line
        if isinstance(record, dict):
            level = _LEVELS.get(str(record.pop("level", "INFO")).upper(), logging.INFO)
            record.pop("time", None)
            msg = str(record.pop("msg", ""))
            rest = " ".join(f"{k}={v}" for k, v in record.items())
            return level, f"{msg} {rest}".strip()
        return logging.INFO, line
    if line.startswith("Error:"):  # litestream's last word before it exits
        return logging.ERROR, line
    match = _TEXT_LEVEL.search(line)
    level = _LEVELS.get(match.group(1).upper(), logging.INFO) if match else logging.INFO
    text = _TEXT_TIME.sub("", line)
    if match:
        text = text.replace(match.group(0) + " ", "", 1)
    return level, text


async def run_litestream(
    executable: Path,
    args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout_s: float,
) -> tuple[int, str]:
    """Runs one litestream command; its exit code and output (cut to the last 64 KiB)."""
    proc = await asyncio.create_subprocess_exec(
        str(executable),
        *args,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out[-MAX_LINE:].decode("utf-8", "replace")


async def check_version(executable: Path) -> str:
    """The executable's version; BackupConfigError unless it is litestream v0.5."""
    try:
        code, out = await run_litestream(executable, ["version"], timeout_s=30)
    except (OSError, TimeoutError) as e:
        raise BackupConfigError(f"cannot run {executable}: {e}") from None
    version = out.strip().splitlines()[-1].strip() if out.strip() else ""
    if code != 0 or not re.fullmatch(r"v?0\.5\.\d+.*", version):
        raise BackupConfigError(
            f"{executable} is litestream {version or '(unknown version)'}; "
            "backups and restores need litestream v0.5"
        )
    return version
