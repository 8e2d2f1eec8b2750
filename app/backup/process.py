"""litestream as a supervised child: run it, fold its log into ours, restart it.

``LitestreamRunner.run`` starts ``litestream replicate -config <rendered>
-no-expand-env`` and keeps it running until ``stop``: when the child exits it is
started again after a backoff (1 s doubling to 60 s, back to 1 s once a child ran
for a minute). Every line the child prints is logged under ``litestream`` at the
level litestream gave it (text or JSON log format), so one log shows both.

``sync`` forces an upload of what the replica holds now, through litestream's
control socket (``POST /sync`` with ``wait``): a node proves at start that its own
destination holds its replica without waiting for the backup interval (zero's
default is 15 minutes). The socket lives in a private directory of its own (a Unix
socket's path must be short), removed with the run.

The child is started with the kernel's parent-death signal and inherits the
replica's lock (``app/supervise.py``), so it never outlives ``serve`` unnoticed.

``run_litestream`` runs one short command (``restore``, ``version``) with a time
limit, for the restore path and the start-up check.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

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
# How long a forced sync may take (litestream's own ``timeout``), and reading its answer.
SYNC_TIMEOUT_S: Final = 60.0
MAX_REPLY: Final = 64 * 1024
# The longest run that stays down, or crash-loop, before /ready says so.
DOWN_AFTER_S: Final = 60.0

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

    def __init__(self, options: LitestreamOptions, *, pass_fds: tuple[int, ...] = ()) -> None:
        """``pass_fds``: what the child inherits (the replica's lock)."""
        self._socket_dir = Path(tempfile.mkdtemp(prefix="changestreamer-ls-"))
        self._options = options = dataclasses.replace(
            options, socket_path=self._socket_dir / "control.sock"
        )
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
                pass_fds=pass_fds,
                parent_death_signal=True,
            )
        )

    @property
    def state(self) -> RunnerState:
        return self._child.state

    @property
    def running(self) -> bool:
        return self._child.running

    @property
    def pid(self) -> int | None:
        return self._child.state.pid

    def problem(self) -> str | None:
        """``/ready``'s reason while litestream crash-loops or has been down for long."""
        return self._child.problem(down_after_s=DOWN_AFTER_S)

    async def run(self) -> None:
        """Runs the child until ``stop``, restarting it with backoff when it exits."""
        log.info("backing up %s to %s", self._options.replica_file, self._options.backup_url)
        try:
            await self._child.run()  # litestream has no final exit code: only stop ends it
        finally:
            # litestream has read it; it holds secrets, so it does not outlive the run.
            await asyncio.to_thread(remove_config, self._options)
            await asyncio.to_thread(shutil.rmtree, self._socket_dir, True)

    async def sync(self, timeout_s: float = SYNC_TIMEOUT_S) -> int:
        """Uploads what the replica holds now and waits for the destination to have
        it; the transaction ID replicated. Raises ``RuntimeError`` saying why not
        (litestream not running yet, an upload that failed)."""
        socket_path = self._options.socket_path
        assert socket_path is not None
        if not self.running:
            raise RuntimeError("litestream is not running")
        body = json.dumps(
            {"path": str(self._options.replica_file), "wait": True, "timeout": int(timeout_s)}
        ).encode()
        request = (
            b"POST /sync HTTP/1.1\r\nHost: litestream\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        try:
            reader, writer = await within(asyncio.open_unix_connection(str(socket_path)), 5.0)
        except (OSError, TimeoutError) as e:
            raise RuntimeError(f"litestream's control socket does not answer: {e}") from None
        try:
            writer.write(request)
            reply = await within(_read_reply(reader), timeout_s + 5.0)
        except (OSError, TimeoutError) as e:
            raise RuntimeError(f"litestream's sync did not answer: {e!r}") from None
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        status, answer = _http_reply(reply)
        if status != 200:
            raise RuntimeError(f"litestream's sync failed: {answer.get('error') or status}")
        return int(answer.get("replicated_txid") or 0)

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


async def _read_reply(reader: asyncio.StreamReader) -> bytes:
    """The whole reply (the server closes the connection after it), ``MAX_REPLY`` at most."""
    reply = b""
    while len(reply) < MAX_REPLY:
        chunk = await reader.read(MAX_REPLY - len(reply))
        if not chunk:
            break
        reply += chunk
    return reply


def _http_reply(reply: bytes) -> tuple[int, dict[str, Any]]:
    """An HTTP/1.1 reply's status and JSON body (``{}`` when it has none)."""
    head, _, body = reply.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0, {"error": "not an HTTP reply"}
    try:
        parsed = json.loads(body) if body.strip() else {}
    except ValueError:
        parsed = {"error": body[:200].decode("utf-8", "replace")}
    return status, parsed if isinstance(parsed, dict) else {}


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
        # What it writes (a restore: every replicated row) is for our user only,
        # its temporary files too (app/private_files.py).
        umask=0o077,
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
