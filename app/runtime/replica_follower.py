"""The service's own replica, kept current from the change log by a child process.

``ReplicaFollower`` runs ``python -m app.runtime.log_follower`` (see there for what
it does and why it is a process that reads the log rather than a subscriber) under
``app.supervise``: restarted with backoff when it exits, stopped with the service.
``notify`` passes the newest durable commit watermark to it as a line on its stdin, at
most every ``NOTIFY_INTERVAL_S``: a commit reaches the replica within about that
long, and at a thousand commits a second the child wakes fifty times, not a
thousand (each wake-up is a read and a replica commit, and on two cores its CPU
competes with the fan-out's latency). While it is behind, lines are dropped rather
than buffered (it reads ``lastWatermark`` itself then).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from app.child_env import child_env
from app.runtime.log_follower import CHANGE_DB_ENV, EXIT_RESYNC, POLL_S
from app.storage.engine import Shard, parse_change_db_url, reader_target
from app.supervise import LOG_LEVELS, ChildSpec, ChildState, SupervisedChild

__all__ = ["ReplicaFollower"]

log = logging.getLogger("app.replica.follower")

RESTART_INITIAL_S: Final = 0.5
RESTART_MAX_S: Final = 30.0
# Unread notification bytes past which we stop writing more (the child is behind).
MAX_BUFFERED: Final = 4096
NOTIFY_INTERVAL_S: Final = 0.02
# A child that ran this long after failures is well again (/ready, restart backoff).
STABLE_AFTER_S: Final = 10.0
# Failures in a row after which /ready says the follower crash-loops.
CRASH_LOOP_AFTER: Final = 3


class ReplicaFollower:
    """Keeps ``replica_file`` applied up to the change log's ``lastWatermark``."""

    def __init__(
        self,
        replica_file: Path,
        change_db_url: str,
        shard: Shard,
        *,
        log_level: str = "warning",
        poll_s: float = POLL_S,
        lock_fd: int | None = None,
        litestream: bool = False,
    ) -> None:
        """``lock_fd``: the replica's lock, which the child holds too while it runs
        (app/runtime/replica_lock.py); ``litestream``: litestream backs the replica up,
        so the child never checkpoints it (``app.replica.schema.open_replica``)."""
        self._litestream = litestream
        self.replica_file = replica_file
        self._poll_s = poll_s
        self._newest = ""  # the newest durable watermark not yet written to the child
        self._notify_at: asyncio.TimerHandle | None = None
        # Resolved here, once: the child opens it without the engines' URL parsing.
        self._log_target = reader_target(parse_change_db_url(change_db_url))
        self._shard = shard
        self._log_level = log_level
        self._child = SupervisedChild(
            ChildSpec(
                name="replica follower",
                log=log,
                command=self._command,
                env=self._env,
                parse_line=parse_line,
                restart_initial_s=RESTART_INITIAL_S,
                restart_max_s=RESTART_MAX_S,
                stable_after_s=STABLE_AFTER_S,
                stop_timeout_s=10.0,
                final_exit_codes=frozenset({EXIT_RESYNC}),
                pass_fds=() if lock_fd is None else (lock_fd,),
            )
        )

    @property
    def state(self) -> ChildState:
        return self._child.state

    def problem(self) -> str | None:
        """``/ready``'s reason while the follower crash-loops: the replica (and with it
        the backup) no longer follows the change log."""
        return self._child.problem(crash_loop_after=CRASH_LOOP_AFTER)

    def notify(self, watermark: str) -> None:
        """A commit is durable in the change log (called on the event loop; never waits)."""
        self._newest = watermark
        if self._notify_at is None:
            self._notify_at = asyncio.get_running_loop().call_later(
                NOTIFY_INTERVAL_S, self._write_newest
            )

    def _write_newest(self) -> None:
        self._notify_at = None
        self._child.send(self._newest.encode("ascii") + b"\n", max_buffered=MAX_BUFFERED)

    async def run(self) -> bool:
        """Keeps the child running until ``stop`` (False), or until it says the change
        log cannot bring the replica forward (True: it must be re-synced)."""
        return await self._child.run() == EXIT_RESYNC

    async def stop(self) -> None:
        if self._notify_at is not None:
            self._notify_at.cancel()
            self._notify_at = None
        await self._child.stop()

    async def _command(self) -> Sequence[str]:
        return [
            sys.executable,
            "-m",
            "app.runtime.log_follower",
            "--replica",
            str(self.replica_file),
            "--app-id",
            self._shard.app_id,
            "--shard-num",
            str(self._shard.shard_num),
            "--log-level",
            self._log_level,
            "--poll-seconds",
            str(self._poll_s),
            *(["--no-checkpoints"] if self._litestream else []),
        ]

    def _env(self) -> dict[str, str]:
        # The child reads where the log is (its only secret) and no settings: its
        # options come in argv (app/child_env.py).
        return child_env(python=True, extra={CHANGE_DB_ENV: self._log_target})


def parse_line(line: str) -> tuple[int, str, str | None]:
    """The child logs JSON lines (``app.logs``): their level, message and traceback
    if any (logged as a traceback of ours: ``app.supervise.log_child_line``).
    Anything else (a traceback printed before its logging was set up) is a warning."""
    try:
        record = json.loads(line) if line.startswith("{") else None
    except ValueError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("message"), str):
        return logging.WARNING, line, None
    level = LOG_LEVELS.get(str(record.get("level")), logging.WARNING)
    exc = record.get("exc")
    return level, record["message"], str(exc) if exc else None
