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
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from app.backup.config import BackupConfigError, LitestreamOptions, render
from app.child_env import child_env
from app.supervise import LOG_LEVELS, MAX_LINE, ChildSpec, SupervisedChild
from app.supervise import ChildState as RunnerState
from app.timeouts import within

__all__ = [
    "LitestreamRunner",
    "RunnerState",
    "check_version",
    "config_path",
    "remove_config",
    "run_litestream",
    "write_config",
]

log = logging.getLogger("litestream")

RESTART_INITIAL_S: Final = 1.0
RESTART_MAX_S: Final = 60.0
# A child that ran this long was healthy: the next restart waits RESTART_INITIAL_S.
STABLE_AFTER_S: Final = 60.0
STOP_TIMEOUT_S: Final = 10.0

_TEXT_LEVEL = re.compile(r"\blevel=([A-Za-z]+)")
_TEXT_TIME = re.compile(r"^time=\S+\s+")


def config_path(options: LitestreamOptions, purpose: str = "replicate") -> Path:
    """Where ``write_config`` puts the configuration for one use: beside the replica
    (``.<replica>.litestream.yml``; a restore's is ``.<replica>.litestream-restore.yml``,
    so that a restore never replaces or removes a running litestream's)."""
    tag = "" if purpose == "replicate" else f"-{purpose}"
    return options.replica_file.with_name(f".{options.replica_file.name}.litestream{tag}.yml")


def write_config(options: LitestreamOptions, purpose: str = "replicate") -> Path:
    """Renders the configuration beside the replica, readable by us only.

    The file holds whatever secrets the template names (substituted from our
    environment), so it is created 0600 with O_EXCL|O_NOFOLLOW: whatever is at its
    path first (a stale one from a crash, or a symlink someone planted) is unlinked —
    the link itself, never what it points at — and a file created in between makes
    the create fail rather than be written through. ``remove_config`` removes it
    once its process ended."""
    path = config_path(options, purpose)
    text = render(options)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def remove_config(options: LitestreamOptions, purpose: str = "replicate") -> None:
    """Removes what ``write_config`` wrote for ``purpose`` (if it is still there)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(config_path(options, purpose))


class LitestreamRunner:
    """Keeps ``litestream replicate`` running for one replica (``app.supervise``)."""

    def __init__(self, options: LitestreamOptions) -> None:
        self._options = options
        self._child = SupervisedChild(
            ChildSpec(
                name="litestream",
                log=log,
                command=self._command,
                env=options.environment,
                parse_line=parse_line,
                restart_initial_s=RESTART_INITIAL_S,
                restart_max_s=RESTART_MAX_S,
                stable_after_s=STABLE_AFTER_S,
                stop_timeout_s=STOP_TIMEOUT_S,
                start_errors=(OSError, BackupConfigError),
            )
        )

    @property
    def state(self) -> RunnerState:
        return self._child.state

    @property
    def running(self) -> bool:
        return self._child.running

    async def run(self) -> None:
        """Runs the child until ``stop``, restarting it with backoff when it exits."""
        log.info("backing up %s to %s", self._options.replica_file, self._options.backup_url)
        try:
            await self._child.run()  # litestream has no final exit code: only stop ends it
        finally:
            # litestream has read it; it holds secrets, so it does not outlive the run.
            await asyncio.to_thread(remove_config, self._options)

    async def stop(self) -> None:
        """Stops the child (SIGTERM, then SIGKILL after STOP_TIMEOUT_S)."""
        await self._child.stop()

    async def _command(self) -> list[str]:
        config = await asyncio.to_thread(write_config, self._options)
        return [
            str(self._options.executable),
            "replicate",
            "-config",
            str(config),
            "-no-expand-env",
        ]


def parse_line(line: str) -> tuple[int, str]:
    """litestream's level and message from one of its log lines (text or JSON)."""
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except ValueError:
            return logging.INFO, line
        if isinstance(record, dict):
            level = LOG_LEVELS.get(str(record.pop("level", "INFO")).upper(), logging.INFO)
            record.pop("time", None)
            msg = str(record.pop("msg", ""))
            rest = " ".join(f"{k}={v}" for k, v in record.items())
            return level, f"{msg} {rest}".strip()
        return logging.INFO, line
    if line.startswith("Error:"):  # litestream's last word before it exits
        return logging.ERROR, line
    match = _TEXT_LEVEL.search(line)
    level = LOG_LEVELS.get(match.group(1).upper(), logging.INFO) if match else logging.INFO
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
        out, _ = await within(proc.communicate(), timeout_s)
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
        code, out = await run_litestream(
            executable, ["version"], env=child_env(storage=True), timeout_s=30
        )
    except (OSError, TimeoutError) as e:
        raise BackupConfigError(f"cannot run {executable}: {e}") from None
    version = out.strip().splitlines()[-1].strip() if out.strip() else ""
    if code != 0 or not re.fullmatch(r"v?0\.5\.\d+.*", version):
        raise BackupConfigError(
            f"{executable} is litestream {version or '(unknown version)'}; "
            "backups and restores need litestream v0.5"
        )
    return version
