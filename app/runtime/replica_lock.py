"""One ``serve`` per replica file, and none beside a child another one left behind.

``serve`` takes an exclusive ``flock`` on ``<replica>.lock`` before it touches the
replica and holds it for its life. The children that write the replica or back it up
(the replica follower, litestream) inherit the lock's descriptor, so the lock stays
taken while any of them runs, even if ``serve`` itself was killed by SIGKILL and a
child outlived it: a new ``serve`` then waits a bounded time for them to end and, if
they do not, refuses to start with one line naming them (a second litestream writing
beside the first is how a backup gets corrupted). The kernel drops the lock when the
last holder ends, however it ends: nothing stale is left to clean up.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

__all__ = ["LOCK_SUFFIX", "ReplicaLock", "ReplicaLockedError", "held_replica"]

LOCK_SUFFIX: Final = ".lock"
# How long a start waits for the children of a previous run to end (the follower
# finishes its batch, litestream is being killed by the parent-death signal).
WAIT_S: Final = 10.0
POLL_S: Final = 0.1
# Processes named in a refusal, at most.
MAX_NAMED: Final = 5


class ReplicaLockedError(Exception):
    """Another process holds the replica; the message names it (one line)."""


class ReplicaLock:
    def __init__(self, replica_file: Path) -> None:
        self.path = replica_file.with_name(replica_file.name + LOCK_SUFFIX)
        self._fd: int | None = None

    @property
    def fd(self) -> int:
        """The descriptor children inherit (``pass_fds``) to keep the lock held."""
        if self._fd is None:
            raise RuntimeError(f"{self.path} is not locked")
        return self._fd

    def acquire(self, wait_s: float = WAIT_S) -> None:
        """Takes the lock, waiting up to ``wait_s`` for its holders to end; raises
        ``ReplicaLockedError`` (holders named) or ``OSError`` (cannot create it)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise ReplicaLockedError(self._refusal()) from None
                    time.sleep(POLL_S)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _refusal(self) -> str:
        holders = _holders(self.path)
        named = ", ".join(f"pid {pid} ({name})" for pid, name in holders[:MAX_NAMED])
        return (
            f"the replica {self.path.with_suffix('')} is in use by another process"
            f"{': ' + named if named else ''} (it holds {self.path}); stop it first"
        )


@contextlib.contextmanager
def held_replica(replica_file: Path, wait_s: float = 0.0) -> Iterator[str | None]:
    """The lock for a command that writes ``replica_file`` (``restore``,
    ``replicate``): yields None while it holds it, or the one-line refusal when
    another process does (or the lock cannot be made)."""
    lock = ReplicaLock(replica_file)
    try:
        lock.acquire(wait_s)
    except ReplicaLockedError as e:
        yield str(e)
        return
    except OSError as e:
        yield f"cannot lock the replica: {lock.path}: {e.strerror}"
        return
    try:
        yield None
    finally:
        lock.release()


def _holders(path: Path) -> list[tuple[int, str]]:
    """The processes with ``path`` open (Linux's /proc; empty elsewhere)."""
    found: list[tuple[int, str]] = []
    target = str(path.resolve())
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return found
    for pid in sorted(pids):
        if pid == os.getpid():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            links = os.listdir(fd_dir)
        except OSError:
            continue
        for link in links:
            try:
                if os.readlink(f"{fd_dir}/{link}") == target:
                    found.append((pid, _name(pid)))
                    break
            except OSError:
                continue
    return found


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"
