"""The service's own replica, applied from the change log (a child process of ``serve``).

    python -m app.runtime.log_follower --replica FILE      (started by serve)

The replica file initial sync created is the one backups copy, so it has to follow
the change stream. It follows the **change log**, not the fan-out: every committed
transaction is in the log before upstream is acked, so reading ``(replica's
stateVersion, lastWatermark]`` from it and applying that is the whole job. The log
holds what the service validated on the way in, as the change objects' JSON; each
batch of rows becomes begin/data/commit messages for
:class:`~app.replica.replicator.Replicator`, which writes the batch's complete
transactions in one SQLite commit.

Why a process, and why the log (docs/architecture.md, decision 36): applying rows is
Python and SQLite work that holds a GIL — in the service's process it was about a
third of the event loop's CPU — and as a subscriber it also cost a socket's framing,
parsing and acks, and its pace held back the fan-out's flow control. Here it runs on
the other core, reads rows in batches (no framing, no acks), and nobody waits for it:
what may not be purged before it is applied is guarded by the purge floor, which
never passes the replica's position (the backup watermark).

Wake-ups: ``serve`` writes the newest durable commit watermark as a line on our
stdin, at most every ``NOTIFY_INTERVAL_S`` (so a burst of commits is one wake-up and
one replica commit); we also read ``lastWatermark`` every ``POLL_S`` in case a line
was skipped (the parent drops lines while we are behind rather than buffer them).
stdin's EOF means the parent is gone, even by SIGKILL: we stop rather than live on as
an orphan. SIGTERM
stops us after the batch being applied.

Exit codes: 0 stopped; 3 the change log cannot bring this replica forward (another
replica version, or the log was purged past the replica): it must be re-synced or
restored; 1 anything else (a change the writer rejects).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Final

from app.logs import configure_logging
from app.protocol.canonical_json import loads
from app.protocol.messages import Begin, Commit, Data
from app.protocol.pieces import join_text
from app.replica.errors import ReplicaError, ResyncRequiredError
from app.replica.replicator import ReplicaMessage, Replicator
from app.storage.log_reader import LogReader, StoredRow, open_log_reader
from app.storage.shard import Shard
from app.timeouts import within

__all__ = ["CHANGE_DB_ENV", "messages_from_rows", "run"]

log = logging.getLogger("app.replica.follower")

# Where to read the log (``engine.reader_target``) comes in the environment, not argv
# (it may hold a password).
CHANGE_DB_ENV: Final = "CHANGESTREAMER_FOLLOWER_CHANGE_DB"
POLL_S: Final = 1.0
READ_BATCH: Final = 2_000
EXIT_RESYNC: Final = 3


def messages_from_rows(rows: list[StoredRow]) -> list[ReplicaMessage]:
    """Change-log rows (whole transactions, or parts of one) as replicator messages."""
    out: list[ReplicaMessage] = []
    # One parse for the batch: per call, the exact-number checks of ``loads`` cost
    # more than parsing a small row.
    # The log is read without pieces_over: every change is a str (join_text costs
    # nothing then; this is a child process, where a join would not stall serve).
    bodies = loads("[" + ",".join([join_text(row[2]) for row in rows]) + "]")
    for (watermark, _pos, _change, _precommit), body in zip(rows, bodies, strict=True):
        tag = body["tag"]
        if tag == "begin":
            out.append(Begin(body, watermark, body.get("skipAck") is True))
        elif tag == "commit":
            out.append(Commit(body, watermark))
        else:
            out.append(Data(body, tag))
    return out


class LogFollower:
    def __init__(
        self, reader: LogReader, replicator: Replicator, *, poll_s: float = POLL_S
    ) -> None:
        self._poll_s = poll_s
        # Reads block this loop, which has nothing else to do meanwhile (the stdin
        # reader waits for us anyway); a read is one short SELECT.
        self._reader = reader
        self._replicator = replicator
        self.notified = ""  # the newest durable watermark the parent told us of
        self.wake = asyncio.Event()

    def check(self) -> None:
        """Refuses a change log of another replica version."""
        found = self._reader.replica_version()
        version = self._replicator.replica_version
        if found != version:
            raise ResyncRequiredError(
                f"the change log is for replica version {found or 'none'}, the replica is {version}"
            )

    async def catch_up(self) -> int:
        """Applies what the log holds past the replica; the number of commits applied."""
        target = self.notified
        if not target or target <= self._replicator.watermark:
            target = self._reader.last_watermark() or ""
        start = self._replicator.watermark
        if target <= start:
            return 0
        found = start == self._replicator.replica_version
        commits = 0
        for rows in self._reader.read(start, target, READ_BATCH):
            if not found:
                if rows[0][0] != start:
                    raise ResyncRequiredError(
                        f"the replica is at {start}, but the change log starts at {rows[0][0]}"
                    )
                found = True
            # The rows of the replica's own last transaction are already applied.
            fresh = rows if rows[0][0] != start else [r for r in rows if r[0] != start]
            if fresh:
                commits += len(await self._replicator.apply_batch(messages_from_rows(fresh)))
        return commits

    async def run(self, stop: asyncio.Event) -> None:
        self.check()
        log.info("following the change log into the replica from %s", self._replicator.watermark)
        while not stop.is_set():
            await self.catch_up()
            self.wake.clear()
            if self.notified > self._replicator.watermark:
                continue  # a notification came in while applying: no wait
            with contextlib.suppress(TimeoutError):
                await within(_first(self.wake, stop), self._poll_s)


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _read_notifications(
    loop: asyncio.AbstractEventLoop, fd: int, follower: LogFollower, stop: asyncio.Event
) -> None:
    """Watermark lines from the parent wake the follower; EOF stops it."""
    pending = b""

    def readable() -> None:
        nonlocal pending
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            log.info("the service is gone: stopping")
            stop.set()
            return
        lines = (pending + data).split(b"\n")
        pending = lines.pop()[-256:]  # a partial line (bounded)
        newest = max((line.strip() for line in lines), default=b"")
        if newest:
            follower.notified = max(follower.notified, newest.decode("ascii", "replace"))
            follower.wake.set()

    loop.add_reader(fd, readable)


async def run(
    replica: Path, target: str, shard: Shard, *, poll_s: float = POLL_S, checkpoints: bool = True
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    reader = open_log_reader(target, shard)
    try:
        async with Replicator(replica, mode="backup", checkpoints=checkpoints) as replicator:
            follower = LogFollower(reader, replicator, poll_s=poll_s)
            _read_notifications(loop, sys.stdin.fileno(), follower, stop)
            await follower.run(stop)
    finally:
        reader.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.runtime.log_follower")
    parser.add_argument("--replica", required=True, type=Path)
    parser.add_argument("--app-id", required=True)
    parser.add_argument("--shard-num", required=True, type=int)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--poll-seconds", type=float, default=POLL_S)
    # litestream backs the replica up: it does every checkpoint (schema.open_replica).
    parser.add_argument("--no-checkpoints", action="store_true")
    args = parser.parse_args(argv)
    # JSON whatever ZERO_LOG_FORMAT says: the parent reads these lines
    # (replica_follower.parse_line) and logs them again in its own format.
    configure_logging(args.log_level, "json")
    target = os.environ.get(CHANGE_DB_ENV)
    if not target:
        print(f"log_follower: {CHANGE_DB_ENV} is not set", file=sys.stderr)
        return 2
    try:
        asyncio.run(
            run(
                args.replica,
                target,
                Shard(args.app_id, args.shard_num),
                poll_s=args.poll_seconds,
                checkpoints=not args.no_checkpoints,
            )
        )
    except ResyncRequiredError as e:
        log.error("the replica must be re-synced: %s", e)
        return EXIT_RESYNC
    except ReplicaError as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
