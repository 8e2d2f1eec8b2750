"""The service's own replica, kept current by an in-process ``backup`` subscriber.

The replica file initial sync created is the one backups copy (litestream), so the
service applies its own change stream to it, exactly as a remote replicator would:
subscribe at the replica's state version, apply each transaction, ack after applying.
In process it skips the websocket: messages come from the subscriber's
:class:`~app.streamer.downstream.Downstream` channel as the same JSON text.

If the subscription ends (the service dropped it, e.g. too far behind) it resumes
from the replica's watermark after a bounded backoff; it stops with the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any, Final

from app.protocol import canonical_json
from app.protocol.downstream import DownstreamError, DownstreamStatus, parse_downstream_message
from app.protocol.messages import Begin, Commit, Data, Rollback
from app.replica.errors import ReplicaError
from app.replica.replicator import ReplicaMessage, Replicator
from app.sources.backoff import Backoff
from app.streamer.downstream import DownstreamClosed
from app.streamer.service import ChangeStreamerService, SubscriberContext

__all__ = ["BACKUP_SUBSCRIBER_ID", "BackupReplicator"]

log = logging.getLogger(__name__)

BACKUP_SUBSCRIBER_ID: Final = "backup-replicator"
PROTOCOL_VERSION: Final = 6
# Messages applied per hop to the replica's writer thread, at most.
MAX_BATCH: Final = 1_000
WAIT_FOR_SERVICE_S: Final = 0.05


class BackupReplicator:
    def __init__(self, service: ChangeStreamerService, replica_file: Path) -> None:
        self._service = service
        self._file = replica_file
        self._backoff = Backoff(0.05, 5.0)
        self.commits = 0
        self.watermark: str | None = None

    async def run(self) -> None:
        """Applies the stream until the service stops."""
        service = self._service
        while not service.stopped.is_set():
            if not service.running:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(service.stopped.wait(), WAIT_FOR_SERVICE_S)
                continue
            try:
                await self._follow()
            except ReplicaError as e:
                log.error("backup replicator: %s", e)
            except Exception:
                log.exception("backup replicator failed")
            delay = self._backoff.next_delay()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(service.stopped.wait(), delay)

    async def _follow(self) -> None:
        async with Replicator(self._file, mode="backup") as replicator:
            self.watermark = replicator.watermark
            downstream = self._service.subscribe(
                SubscriberContext(
                    protocol_version=PROTOCOL_VERSION,
                    id=BACKUP_SUBSCRIBER_ID,
                    mode="backup",
                    replica_version=replicator.replica_version,
                    watermark=replicator.watermark,
                    initial=True,
                )
            )
            try:
                while True:
                    try:
                        batch = [await downstream.get()]
                    except DownstreamClosed:
                        log.info(
                            "backup replicator: subscription closed (%s); resuming from %s",
                            downstream.close_reason,
                            replicator.watermark,
                        )
                        return
                    # Whatever else is queued goes in the same hop to the writer thread.
                    while len(batch) < MAX_BATCH and (more := downstream.get_nowait()) is not None:
                        batch.append(more)
                    applied: list[ReplicaMessage] = []
                    for text in batch:
                        message = _message(canonical_json.loads(text))
                        if isinstance(message, DownstreamError):
                            downstream.ack_next()  # the service waits for it before closing
                            raise ReplicaError(f"the service refused the backup replica: {message}")
                        applied.append(message)
                    results = await replicator.apply_batch(applied)
                    for _ in batch:
                        downstream.ack_next()
                    if results:
                        self.commits += len(results)
                        self.watermark = results[-1].watermark
                        self._backoff.reset()
            finally:
                downstream.close()


def _message(value: Any) -> DownstreamStatus | DownstreamError | Begin | Data | Commit | Rollback:
    """A downstream message from our own service's JSON.

    The service validated these on the way in, so the data plane skips a second
    validation; status and error messages take the checked path.
    """
    kind = value[0]
    if kind == "data":
        body = value[1]
        return Data(body, body["tag"])
    if kind == "begin":
        return Begin(value[1], value[2]["commitWatermark"], bool(value[1].get("skipAck")))
    if kind == "commit":
        return Commit(value[1], value[2]["watermark"])
    if kind == "rollback":
        return Rollback(value[1])
    return parse_downstream_message(value)
