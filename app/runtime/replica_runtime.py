"""A service over an upstream with a replica file of its own (Postgres or custom).

Both upstreams sync ``ZERO_REPLICA_FILE`` first and then stream; the service's
change log is what keeps that file current afterwards: a replica follower (a child
process reading the change log, :mod:`app.runtime.replica_follower`) applies it,
so backups copy a current file and ``changestreamer replicate`` can start from one.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from app.config import Settings
from app.replica.schema import ReplicaState
from app.runtime.options import streamer_options, task_id
from app.runtime.replica_follower import ReplicaFollower
from app.sources.base import ChangeSource
from app.stop_signals import AutoResetSignal
from app.storage import ChangeDb, Replication, SubscriptionState
from app.storage.engine import Shard
from app.streamer.service import ChangeStreamerService

__all__ = ["ReplicaRuntime", "UpstreamSetupError", "service_over_replica"]


class UpstreamSetupError(Exception):
    """The upstream or the replica cannot be used; the message says what to do."""


@dataclass(slots=True)
class ReplicaRuntime:
    service: ChangeStreamerService
    replica: ReplicaState
    replica_file: Path
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def start_backup(
        self,
        change_db_url: str,
        shard: Shard,
        *,
        log_level: str = "warning",
        lock_fd: int | None = None,
        litestream: bool = False,
    ) -> ReplicaFollower:
        """Keeps the replica file current from the change log in a child process, from
        now on: before this node owns the log it follows the owner's writes (a node
        about to take over brings its restored replica, and so its backup, forward
        first); it stops with the service."""
        follower = ReplicaFollower(
            self.replica_file,
            change_db_url,
            shard,
            log_level=log_level,
            lock_fd=lock_fd,
            litestream=litestream,
        )
        service = self.service
        service.durable_listeners.append(follower.notify)

        async def follow() -> None:
            stopped = asyncio.ensure_future(service.stopped.wait())
            run = asyncio.ensure_future(follower.run())
            await asyncio.wait({run, stopped}, return_when=asyncio.FIRST_COMPLETED)
            await follower.stop()
            if await run:
                # As a backup subscriber that is behind the log would: reset.
                service.fail(
                    AutoResetSignal(
                        f"the change log cannot bring replica {self.replica_file} forward"
                    )
                )
            stopped.cancel()

        task = asyncio.create_task(follow(), name="replica-follower")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return follower

    async def wait_closed(self) -> None:
        """Returns once what ``start_backup`` started has stopped (after the service)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def service_over_replica(
    settings: Settings,
    db: ChangeDb,
    source: ChangeSource,
    replica: ReplicaState,
    publications: Sequence[str],
    *,
    address: str,
    restore_s: float = 0.0,
    backup_path: str | None = None,
    task: str | None = None,
) -> ChangeStreamerService:
    """The service over ``source``, its change DB tied to ``replica`` first (kept, or
    reset when it belongs to another replica: ``ensureReplicationConfig``).
    ``restore_s``: how long restoring ``replica`` from the backup took, until now;
    ``backup_path``: where this node backs up, under the backup URL; ``task``: this
    node's task ID (default: the settings', else a random one)."""
    replication = Replication(db)
    await replication.ensure_config(
        SubscriptionState(
            replica.replica_version, tuple(sorted(publications)), replica.state_version
        ),
        auto_reset=settings.auto_reset,
    )
    durable = await replication.state()
    assert durable is not None
    task = task or task_id(settings)
    return ChangeStreamerService(
        db=db,
        source=source,
        task_id=task,
        address=address,
        replica_version=replica.replica_version,
        durable_watermark=durable.last_watermark,
        options=dataclasses.replace(
            streamer_options(settings, backup_path=backup_path), restore_s=restore_s
        ),
        taking_over=durable.owner not in (None, "", task),
    )
