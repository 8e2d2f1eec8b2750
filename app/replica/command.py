"""``changestreamer replicate URL --replica FILE``: a standalone serving replica.

Follows a change-streamer into an existing replica file (a copy of the service's
replica, e.g. ``sqlite3 replica.db ".backup copy.db"``, or one restored from a backup):
subscribes at the file's state version, applies every transaction, acks after
applying, and reconnects with backoff until interrupted. A replica the change-streamer
can no longer serve (another replica version, or older than its change log) ends the
command with exit code 3 and says so: it must be copied or restored again.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from app.client import ChangeStreamerClient
from app.replica.errors import ReplicaError, ResyncRequiredError
from app.replica.runner import run_replicator

__all__ = ["add_replicate_arguments", "run_replicate"]

log = logging.getLogger(__name__)

DEFAULT_URL = "ws://127.0.0.1:4849"


def add_replicate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url",
        nargs="?",
        default=os.environ.get("ZERO_CHANGE_STREAMER_URI") or DEFAULT_URL,
        help=f"change-streamer URI (default ZERO_CHANGE_STREAMER_URI or {DEFAULT_URL})",
    )
    parser.add_argument(
        "--replica", required=True, type=Path, help="the replica file to keep current"
    )
    parser.add_argument(
        "--id", dest="subscriber_id", help="subscriber id (default replicate-<pid>)"
    )
    parser.add_argument(
        "--task-id",
        help="the task whose snapshot reservation this subscription ends (after a restore)",
    )
    parser.add_argument(
        "--protocol-version",
        type=int,
        choices=(6, 7),
        default=6,
        help="6: /replication/v6/changes, one message a frame; 7: /subscribe, batch frames",
    )
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="default info",
    )


def run_replicate(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    replica: Path = args.replica
    if not replica.exists():
        print(
            f"changestreamer replicate: {replica} does not exist; start from a copy of the "
            "service's replica file or a restored backup",
            file=sys.stderr,
        )
        return 2
    try:
        asyncio.run(
            _replicate(
                args.url,
                replica,
                args.subscriber_id or f"replicate-{os.getpid()}",
                args.task_id,
                protocol_version=args.protocol_version,
            )
        )
    except ResyncRequiredError as e:
        print(f"changestreamer replicate: {e}", file=sys.stderr)
        return 3
    except ReplicaError as e:
        print(f"changestreamer replicate: {e}", file=sys.stderr)
        return 1
    return 0


async def _replicate(
    url: str,
    replica: Path,
    subscriber_id: str,
    task_id: str | None,
    *,
    protocol_version: int,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    commits = 0

    def count(_: object) -> None:
        nonlocal commits
        commits += 1
        if commits % 1000 == 0:
            log.info("replicated %d transactions", commits)

    log.info("replicating %s into %s", url, replica)
    await run_replicator(
        url,
        replica,
        subscriber_id=subscriber_id,
        stop=stop,
        task_id=task_id,
        on_commit=count,
        client=ChangeStreamerClient(url, protocol_version=protocol_version),
    )
    log.info("stopped after %d transactions", commits)
