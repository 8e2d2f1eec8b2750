"""Backed-up watermarks: one stream of ``{watermark, backupTimeMs, writeTimeMs}``.

Two pollers produce it (wire.md §6.5), chosen by configuration:

* ``VfsPoller`` — a backup URL is set. It reads ``_zero.replicationState`` *of the
  backup* through the litestream VFS (``vfs_worker``, a child process), so every
  watermark it yields is one a restore would really get: this is what makes purge
  and reservations safe. It probes every ``interval_s`` while the local replica is
  ahead of the last watermark read back, and not at all while they are equal.
  ``backupTimeMs`` is when the probe saw it (the upload happened at or before).
* ``ReplicaPoller`` — no backup URL. It offers the local position (the replica's
  ``stateVersion``, or for the demo source the change log's durable watermark)
  every ``interval_s``, first at once, so that purge runs in every configuration.

Both are async iterators that end when ``stop`` is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from app.backoff import Backoff
from app.child_env import child_env
from app.timeouts import within

__all__ = [
    "BackedUpWatermark",
    "LocalState",
    "ReplicaPoller",
    "VfsPoller",
    "VfsProbe",
    "read_local_state",
]

log = logging.getLogger(__name__)

PROBE_RESTART_INITIAL_S: Final = 2.0
PROBE_RESTART_MAX_S: Final = 30.0
STOP_TIMEOUT_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class BackedUpWatermark:
    watermark: str
    backup_time_ms: int
    write_time_ms: int | None = None


@dataclass(frozen=True, slots=True)
class LocalState:
    """Where the local replica (or change log) stands."""

    watermark: str
    write_time_ms: int | None = None


def read_local_state(replica_file: Path) -> LocalState | None:
    """The replica's ``stateVersion`` and ``writeTimeMs``; None if it cannot be read."""
    try:
        conn = sqlite3.connect(f"file:{replica_file}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return None
    try:
        row = conn.execute(
            'SELECT stateVersion, writeTimeMs FROM "_zero.replicationState"'
        ).fetchone()
    except sqlite3.Error:
        return None
    finally:
        conn.close()
    if row is None:
        return None
    return LocalState(str(row[0]), None if row[1] is None else int(row[1]))


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _Stoppable:
    def __init__(self) -> None:
        self._stopped = asyncio.Event()
        self._woken = asyncio.Event()

    def stop(self) -> None:
        self._stopped.set()
        self._woken.set()

    def wake(self) -> None:
        """Cuts the current wait short: the next poll happens now (something new was
        uploaded)."""
        self._woken.set()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await within(self._woken.wait(), seconds)
        if not self._stopped.is_set():
            self._woken.clear()


class ReplicaPoller(_Stoppable):
    """Offers the local position every ``interval_s`` (no backups configured)."""

    def __init__(self, read: Callable[[], LocalState | None], interval_s: float) -> None:
        super().__init__()
        self._read = read
        self._interval_s = interval_s

    async def __aiter__(self) -> AsyncIterator[BackedUpWatermark]:
        while not self._stopped.is_set():
            state = await asyncio.to_thread(self._read)
            if state is not None:
                yield BackedUpWatermark(state.watermark, _now_ms(), state.write_time_ms)
            await self._sleep(self._interval_s)


class VfsProbe:
    """The ``vfs_worker`` child: one probe at a time, restarted when it dies."""

    def __init__(
        self, replica_url: str, extension: Path, *, timeout_s: float, log_file: str | None = None
    ) -> None:
        self._replica_url = replica_url
        self._extension = extension
        self._timeout_s = timeout_s
        self._log_file = log_file
        self._proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def read(self, *, fresh: bool = False) -> LocalState:
        """The backup's state; raises ``RuntimeError`` with the reason when it cannot.

        ``fresh`` reads it through a new VFS connection (see ``vfs_worker``).
        """
        proc = await self._ensure()
        assert proc.stdin is not None
        assert proc.stdout is not None
        try:
            proc.stdin.write(b"fresh\n" if fresh else b"\n")
            await proc.stdin.drain()
            line = await within(proc.stdout.readline(), self._timeout_s)
        except (TimeoutError, ConnectionError, asyncio.CancelledError) as e:
            await self.close()  # its answer would be read as the next probe's
            if isinstance(e, asyncio.CancelledError):
                raise
            raise RuntimeError(f"the backup probe did not answer in {self._timeout_s:g} s") from e
        if not line:
            await self.close()
            raise RuntimeError("the backup probe exited")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(str(reply["error"]))
        write_time = reply.get("writeTimeMs")
        return LocalState(str(reply["watermark"]), None if write_time is None else int(write_time))

    async def _ensure(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        # The VFS reads the storage credentials (AWS_*, …) and these; nothing else of ours.
        env = child_env(storage=True)
        env["LITESTREAM_REPLICA_URL"] = self._replica_url
        env["LITESTREAM_LOG_LEVEL"] = "INFO"
        if self._log_file:
            env["LITESTREAM_LOG_FILE"] = self._log_file
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-m",
            "app.backup.vfs_worker",
            str(self._extension),
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            # The worker moves the extension's log (stdout by default) to stderr;
            # without ZERO_LITESTREAM_VFS_LOG_FILE it goes nowhere.
            stderr=asyncio.subprocess.DEVNULL,
        )
        self.starts += 1
        return self._proc

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(TimeoutError):
            await within(proc.wait(), STOP_TIMEOUT_S)


def _covered(remote: LocalState, local: LocalState | None) -> str:
    """What the backup covers *of our replica*: never more than the replica holds.

    During a takeover the destination still receives the old node's uploads, which
    may be ahead of the replica this node restored; purging to them would delete
    changes our own replica has yet to apply.
    """
    if local is not None and local.watermark < remote.watermark:
        return local.watermark
    return remote.watermark


class VfsPoller(_Stoppable):
    """Yields each new watermark read back from the backup destination."""

    def __init__(
        self,
        probe: VfsProbe,
        read_local: Callable[[], LocalState | None],
        interval_s: float,
    ) -> None:
        super().__init__()
        self._probe = probe
        self._read_local = read_local
        self._interval_s = interval_s
        self.last: LocalState | None = None
        self.failures = 0
        self.last_error: str | None = None

    async def __aiter__(self) -> AsyncIterator[BackedUpWatermark]:
        retry = Backoff(PROBE_RESTART_INITIAL_S, PROBE_RESTART_MAX_S)
        stalled = False  # the last probe saw no progress: the next one reconnects
        try:
            while not self._stopped.is_set():
                local = await asyncio.to_thread(self._read_local)
                if (
                    local is not None
                    and self.last is not None
                    and local.watermark <= self.last.watermark
                ):
                    await self._sleep(self._interval_s)  # the backup has caught up: idle
                    continue
                try:
                    remote = await self._probe.read(fresh=stalled)
                except (RuntimeError, ValueError, KeyError, OSError) as e:
                    self._failed(str(e))
                    await self._sleep(retry.next_delay())
                    continue
                retry.reset()
                self.last_error = None
                stalled = self.last is not None and remote.watermark == self.last.watermark
                if self.last is None or remote.watermark != self.last.watermark:
                    self.last = remote
                    yield BackedUpWatermark(
                        _covered(remote, local), _now_ms(), remote.write_time_ms
                    )
                await self._sleep(self._interval_s)
        finally:
            await self._probe.close()

    def _failed(self, error: str) -> None:
        self.failures += 1
        if error != self.last_error:
            # Logged when the reason changes, not on every retry: an empty
            # destination fails the same way until the first upload.
            log.warning("cannot read the backup's watermark: %s", error)
        self.last_error = error
