"""Initial sync from a custom change source into a new replica file (spec/source.md §4.2).

1. The source's stream is opened without ``lastWatermark``/``replicaVersion``.
2. The source sends exactly one transaction. Its commit watermark becomes the
   **replicaVersion**: at its ``begin`` the replica's metadata is created at that
   version, then its changes (``create-table``, ``create-index``, ``insert``s) are
   applied by :class:`~app.replica.writer.ReplicaWriter` — the writer that applies
   the change log to the replica afterwards, so a table is built the same way
   whether it arrives now or later. ``status`` frames are ignored; ``reset-required``
   raises :class:`~app.storage.AutoResetSignal`; anything else (a rollback, a second
   ``begin``, the stream ending first) fails the sync.
3. After the commit the replica must hold the tables zero's sync logic reads
   (:mod:`app.replica.required_tables`). The socket is closed; the initial
   transaction is not acked (zero does not ack it either).

The replica is built in ``<file>.syncing`` and renamed into place only when complete,
so a failed sync leaves no half-made replica. The watermark rules of §2.4 hold here
too (the stream checks them, :mod:`app.sources.custom_rules`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from app.protocol.canonical_json import dumps
from app.protocol.messages import Begin, Commit, Control, Data, Status
from app.replica.catalog import load_tables
from app.replica.errors import ReplicaError
from app.replica.required_tables import missing_required_table
from app.replica.schema import (
    ReplicaState,
    init_replica,
    open_replica,
    read_replica_state,
    remove_replica_files,
    set_state_version,
)
from app.replica.writer import ReplicaWriter
from app.sources.custom import CustomChangeSource, CustomChangeStream
from app.stop_signals import AutoResetSignal

__all__ = ["CustomSyncError", "custom_initial_sync"]

log = logging.getLogger(__name__)

# How much of an unexpected message an error shows.
_PREVIEW_CHARS: Final = 200


class CustomSyncError(Exception):
    """The initial sync cannot complete; the message says why (one line)."""


async def custom_initial_sync(
    source: CustomChangeSource,
    replica_file: Path,
    *,
    app_id: str,
    shard_num: int,
    publications: Sequence[str],
) -> ReplicaState:
    """Builds ``replica_file`` from the source's first transaction (module docstring).

    Raises :class:`CustomSyncError`, :class:`~app.sources.base.ChangeSourceError`
    (connection, bad frame, broken watermark rule) or ``AutoResetSignal``.
    """
    started = time.monotonic()
    staging = replica_file.with_name(replica_file.name + ".syncing")
    remove_replica_files(staging)
    try:
        stream = await source.start_initial_sync()
        try:
            changes = await _apply_first_transaction(
                stream, staging, publications, source.description
            )
        finally:
            await stream.close()
        _finish(staging, app_id, shard_num)
        state = read_replica_state(staging)
    except BaseException:
        remove_replica_files(staging)
        raise
    remove_replica_files(replica_file)
    os.replace(staging, replica_file)
    log.info(
        "initial sync from custom change source %s done: %d changes in %.1f s, replica version %s",
        source.description,
        changes,
        time.monotonic() - started,
        state.replica_version,
    )
    return state


async def _apply_first_transaction(
    stream: CustomChangeStream, staging: Path, publications: Sequence[str], description: str
) -> int:
    """Applies the stream's one transaction; returns its number of changes."""
    writer: ReplicaWriter | None = None
    changes = 0
    try:
        async for message in stream:
            kind = type(message)
            if kind is Status:
                continue
            if kind is Control:
                assert isinstance(message, Control)
                raise AutoResetSignal(message.message or "auto-reset signaled by change source")
            if kind is Begin and writer is None:
                assert isinstance(message, Begin)
                version = message.commit_watermark
                log.info("initial sync at replica version %s", version)
                writer = _new_replica(staging, version, publications)
                writer.begin(version, message.body)
            elif kind is Data and writer is not None:
                assert isinstance(message, Data)
                writer.apply(message.body)
                changes += 1
                if changes % 10_000 == 0:
                    log.info("initial sync: %d changes applied", changes)
            elif kind is Commit and writer is not None:
                assert isinstance(message, Commit)
                writer.commit(message.watermark, message.body)
                return changes
            else:
                text = dumps(message.as_list())
                if len(text) > _PREVIEW_CHARS:
                    text = text[:_PREVIEW_CHARS] + "..."
                raise CustomSyncError(
                    f"unexpected message during the initial sync (it must be one "
                    f"transaction: begin, data..., commit): {text}"
                )
        raise CustomSyncError(
            f"custom change source {description} ended the stream before the initial sync's commit"
        )
    except ReplicaError as e:
        raise CustomSyncError(f"cannot apply the initial sync: {e}") from e
    finally:
        if writer is not None:
            writer.close()


def _new_replica(path: Path, replica_version: str, publications: Sequence[str]) -> ReplicaWriter:
    """An empty replica at ``replica_version``, and a writer to apply its first transaction."""
    conn = open_replica(path, create=True)
    try:
        init_replica(conn, replica_version, publications, _server_context())
        # init_replica puts the file at replica_version, and the writer applies only
        # transactions after a replica's state version. The first transaction *is* at
        # replica_version (its rows get _0_version = replica_version, like every
        # initially synced row): so the file starts before every version ("" sorts
        # first) and that transaction's commit moves it to replica_version. Nobody
        # sees the staging file in between.
        set_state_version(conn, "")
    finally:
        conn.close()
    # "backup" writes no "_zero.changeLog2" entries (but for backfills, which custom
    # sources cannot send): zero's change processor in its initial-sync mode does the same.
    return ReplicaWriter(path, mode="backup")


def _finish(path: Path, app_id: str, shard_num: int) -> None:
    """Checks the required tables, then gathers the planner's statistics."""
    conn = open_replica(path)
    try:
        problem = missing_required_table(load_tables(conn), app_id, shard_num)
        if problem is not None:
            raise CustomSyncError(
                f"the custom change source's initial sync is incomplete: {problem}"
            )
        # zero analyzes a freshly synced replica; its query planner uses the statistics.
        conn.execute("ANALYZE")
    finally:
        conn.close()


def _server_context() -> dict[str, Any]:
    """Stored as the replica's ``initialSyncContext`` (zero: for debugging)."""
    return {
        "app": "changestreamer",
        "upstream": "custom",
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
    }
