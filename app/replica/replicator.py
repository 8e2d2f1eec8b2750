"""Drives a :class:`~app.replica.writer.ReplicaWriter` from a stream of downstream messages.

:class:`Replicator` takes the messages a subscriber receives (the types of
:mod:`app.client.subscription`: status, begin, data, commit, rollback) and applies
each upstream transaction as one SQLite transaction. It works on any async iterable
of those messages: a websocket :class:`~app.client.subscription.Subscription` or an
in-process stream.

Acks. The replicator consumes the next message only after the previous one is fully
applied; a commit is durable before the replicator asks for what follows it. With the
client's rule ("message N is acked when N+1 is requested") an ack therefore never
runs ahead of the replica.

Batches, no thread. The writer runs on the caller's event loop, a batch at a time
(``Subscription.batches``: what has arrived, at most a thousand messages). A batch is a
few milliseconds of work, so pings and acks wait no longer than that, and a hop to a
worker thread per batch cost more than it saved: in the replica follower's process it
was a third of the CPU (waking the loop from the thread; py-spy, decision 36). If a
batch fails, :meth:`Replicator.close` rolls back whatever transaction was left open.

A change the writer rejects (:class:`~app.replica.errors.ReplicaError`) ends
:meth:`Replicator.consume` with that error, the transaction rolled back: applying
the stream further would skip a change. ``control`` messages (in-process streams
straight from a change source) mean the replica must be re-synced.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from app.protocol.messages import Begin, Commit, Control, Data, Rollback, Status
from app.protocol.subscription_messages import DownstreamStatus
from app.replica.errors import ReplicaError, ResyncRequiredError
from app.replica.writer import CommitResult, ReplicaWriter, WriterMode

__all__ = ["ReplicaMessage", "Replicator"]

log = logging.getLogger(__name__)

ReplicaMessage = DownstreamStatus | Status | Begin | Data | Commit | Rollback | Control


class Replicator:
    """Applies downstream messages to one replica file.

    Use as ``async with Replicator(path) as replicator: await replicator.consume(batches)``.
    ``on_commit`` is called (on the event loop) after every durable commit.
    """

    def __init__(
        self,
        replica_file: str | Path,
        *,
        mode: WriterMode = "serving",
        on_commit: Callable[[CommitResult], None] | None = None,
        checkpoints: bool = True,
    ) -> None:
        """``checkpoints=False``: litestream backs the file up and owns its checkpoints."""
        self._path = replica_file
        self._mode: WriterMode = mode
        self._checkpoints = checkpoints
        self._on_commit = on_commit
        self._writer: ReplicaWriter | None = None
        self.commits = 0

    async def open(self) -> None:
        if self._writer is None:
            self._writer = ReplicaWriter(self._path, mode=self._mode, checkpoints=self._checkpoints)

    async def close(self) -> None:
        """Rolls back an open transaction and closes the file (idempotent)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def writer(self) -> ReplicaWriter:
        if self._writer is None:
            raise ReplicaError("the replicator is not open")
        return self._writer

    @property
    def watermark(self) -> str:
        """The last applied commit watermark: where a subscription resumes."""
        return self.writer.state_version

    @property
    def replica_version(self) -> str:
        return self.writer.replica_version

    @property
    def in_transaction(self) -> bool:
        return self.writer.in_transaction

    async def apply_batch(self, messages: Sequence[ReplicaMessage]) -> list[CommitResult]:
        """Applies several messages; the commits' results. The batch's complete
        transactions go into one SQLite commit. On an error the commits before it stay
        applied (``watermark`` says where).
        """
        results = self._apply_all(list(messages))
        for result in results:
            self.commits += 1
            if self._on_commit is not None:
                self._on_commit(result)
        return results

    def _apply_all(self, messages: list[ReplicaMessage]) -> list[CommitResult]:
        writer = self.writer
        results: list[CommitResult] = []
        try:
            self._apply_grouped(writer, messages, results)
        finally:
            # The batch's complete transactions are written in one SQLite commit, also
            # when a later one failed (it was rolled back alone).
            if not writer.in_transaction:
                writer.flush()
        return results

    def _apply_grouped(
        self, writer: ReplicaWriter, messages: list[ReplicaMessage], results: list[CommitResult]
    ) -> None:
        last_commit = max((i for i, m in enumerate(messages) if isinstance(m, Commit)), default=-1)
        for i, message in enumerate(messages):
            if isinstance(message, Data):
                writer.apply(message.body)
            elif isinstance(message, Begin):
                if i > last_commit:
                    # This transaction ends in a later batch: write the group now, so
                    # every commit of this batch is durable when the batch is acked.
                    writer.flush()
                writer.begin(message.commit_watermark, message.body)
            elif isinstance(message, Commit):
                results.append(writer.commit(message.watermark, message.body, flush=False))
            elif isinstance(message, Rollback):
                writer.abort()
            elif isinstance(message, DownstreamStatus | Status):
                pass  # nothing to apply (the replica keeps no lag report)
            elif isinstance(message, Control):
                writer.abort()
                raise ResyncRequiredError(
                    f"the change source requires a re-sync ({message.tag}): "
                    f"{message.message or 'no message'}"
                )
            else:
                raise ReplicaError(f"unexpected message {message!r}")

    async def consume(self, batches: AsyncIterable[Sequence[ReplicaMessage]]) -> int:
        """Applies batches of messages (``Subscription.batches``: whatever has arrived)
        until the stream ends; returns the number of commits. One hop to the writer
        thread per batch, and its complete transactions in one SQLite commit.

        A transaction still open when the stream ends (or fails) is rolled back: the
        next subscription resends it whole.
        """
        commits = 0
        try:
            async for batch in batches:
                commits += len(await self.apply_batch(batch))
        finally:
            if self._writer is not None:
                self._writer.abort()
        return commits
