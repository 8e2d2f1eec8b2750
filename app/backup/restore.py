"""Restoring a replica from its litestream backup.

``restore_replica`` runs ``litestream restore`` into ``<replica>.restoring``,
checks what arrived is a whole, consistent replica (``PRAGMA integrity_check``: a
restore of a torn backup is refused, not used — litestream's maintainers ask for
the check too) and, when asked, of the expected replica version and no older than
a watermark, and only then renames it over the replica file — a failed or
interrupted restore leaves the old file (or none) in place, never half a database.
Failed attempts are retried a bounded number of times (a live destination moves
on between them); a destination with no backup is not a failure (``None``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from app.backup.config import LitestreamOptions
from app.backup.process import remove_config, run_litestream, write_config
from app.progress import Job, ProgressView
from app.replica.errors import ReplicaError
from app.replica.schema import ReplicaState, read_replica_state, remove_replica_files

__all__ = ["RestoreError", "Restored", "restore_replica"]

log = logging.getLogger(__name__)

ATTEMPTS: Final = 3
RETRY_DELAY_S: Final = 5.0
# One restore's time limit; a large replica over a slow link needs long.
RESTORE_TIMEOUT_S: Final = 6 * 3600.0
PROGRESS_POLL_S: Final = 0.5


class RestoreError(Exception):
    """The backup cannot be restored, or is not the one wanted; one line says why."""


@dataclass(frozen=True, slots=True)
class Restored:
    state: ReplicaState
    seconds: float
    bytes: int


async def restore_replica(
    options: LitestreamOptions,
    *,
    replica_version: str | None = None,
    min_watermark: str | None = None,
    attempts: int = ATTEMPTS,
    retry_delay_s: float = RETRY_DELAY_S,
    timeout_s: float = RESTORE_TIMEOUT_S,
) -> Restored | None:
    """Restores ``options.replica_file`` from ``options.backup_url``; None if no backup."""
    target = options.replica_file
    staging = target.with_name(target.name + ".restoring")
    for attempt in range(1, attempts + 1):
        started = time.monotonic()
        try:
            async with _restore_progress(target, staging):
                found = await _restore_once(options, staging, timeout_s)
            if found:  # a live destination moves on: a torn restore is worth another try
                await asyncio.to_thread(_check_whole, staging, options.backup_url)
        except RestoreError as e:
            if attempt == attempts:
                raise
            log.warning(
                "restore attempt %d of %d failed: %s; retrying in %.0f s",
                attempt,
                attempts,
                e,
                retry_delay_s,
            )
            await asyncio.sleep(retry_delay_s)
            continue
        if not found:
            return None
        state = await asyncio.to_thread(
            _check, staging, options.backup_url, replica_version, min_watermark
        )
        size = staging.stat().st_size
        remove_replica_files(target)
        os.replace(staging, target)
        seconds = time.monotonic() - started
        log.info(
            "restored %s (%d bytes, replica version %s at %s) from %s in %.1f s",
            target,
            size,
            state.replica_version,
            state.state_version,
            options.backup_url,
            seconds,
        )
        return Restored(state, seconds, size)
    raise AssertionError("unreachable: the last attempt raises or returns")


async def _restore_once(options: LitestreamOptions, staging: Path, timeout_s: float) -> bool:
    remove_replica_files(staging)
    # The configuration names the replica's real path (restore looks the database
    # up by it); the output goes to the staging file.
    config = await asyncio.to_thread(write_config, options, "restore")
    args = [
        "restore",
        "-config",
        str(config),
        "-no-expand-env",
        "-if-replica-exists",
        "-parallelism",
        str(options.restore_parallelism),
        "-o",
        str(staging),
        str(options.replica_file),
    ]
    try:
        code, output = await run_litestream(
            options.executable, args, env=options.environment(), timeout_s=timeout_s
        )
    except TimeoutError:
        remove_replica_files(staging)
        raise RestoreError(f"litestream restore did not finish in {timeout_s:.0f} s") from None
    except OSError as e:
        raise RestoreError(f"cannot run {options.executable}: {e}") from None
    finally:
        _remove_leftovers(staging)
        # The configuration was for this one run (a replicating litestream writes its
        # own), and it holds secrets.
        remove_config(options, "restore")
    if code != 0:
        remove_replica_files(staging)
        last = output.strip().splitlines()[-1] if output.strip() else "(no output)"
        raise RestoreError(f"litestream restore exited with code {code}: {last}")
    return os.path.exists(staging)  # noqa: ASYNC240 - one stat, after a long child


# Problems integrity_check reports, at most (the first one is the message).
_INTEGRITY_ROWS = 5


def _check_whole(staging: Path, url: str) -> None:
    """Refuses a restored file that is not a whole database (``RestoreError``)."""
    problem = _integrity_problem(staging)
    if problem is not None:
        remove_replica_files(staging)
        raise RestoreError(
            f"the backup restored from {url} is not a consistent database: {problem}"
        )


def _check(
    staging: Path, url: str, replica_version: str | None, min_watermark: str | None
) -> ReplicaState:
    try:
        state = read_replica_state(staging)
    except ReplicaError as e:
        remove_replica_files(staging)
        raise RestoreError(f"the backup at {url} is not a replica: {e}") from None
    if replica_version is not None and state.replica_version != replica_version:
        remove_replica_files(staging)
        raise RestoreError(
            f"the backup at {url} is of replica version {state.replica_version}, "
            f"not {replica_version}"
        )
    if min_watermark is not None and state.state_version < min_watermark:
        remove_replica_files(staging)
        raise RestoreError(
            f"the backup at {url} is at {state.state_version}, "
            f"older than the change log's start {min_watermark}"
        )
    return state


def _integrity_problem(path: Path) -> str | None:
    """SQLite's first integrity complaint about ``path`` (read-only), or None."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as e:
        return str(e)
    try:
        rows = conn.execute(f"PRAGMA integrity_check({_INTEGRITY_ROWS})").fetchall()
    except sqlite3.DatabaseError as e:
        return str(e)
    finally:
        conn.close()
    found = [" ".join(str(row[0]).split()) for row in rows if row[0] != "ok"]
    return "; ".join(found)[:300] if found else None


def _remove_leftovers(staging: Path) -> None:
    # litestream writes "<output>.tmp" (and its WAL) before renaming it.
    for name in (f"{staging}.tmp", f"{staging}.tmp-wal", f"{staging}.tmp-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)


@contextlib.asynccontextmanager
async def _restore_progress(target: Path, staging: Path) -> AsyncIterator[None]:
    """Shows a restore that takes a while (app/progress.py): litestream reports
    nothing, so the job is the size of the file it writes as it grows (its total is
    unknown: the backup's size is not listed cheaply on every storage). litestream
    writes ``<staging>.tmp`` and renames it to ``staging`` at the end."""
    job = Job(f"restore of {target.name}", unit="bytes")
    written = (Path(f"{staging}.tmp"), staging)

    async def watch() -> None:
        while True:
            for path in written:
                with contextlib.suppress(OSError):
                    job.done = path.stat().st_size  # a stat per tick: cheap
                    break
            await asyncio.sleep(PROGRESS_POLL_S)

    watcher = asyncio.create_task(watch(), name="restore-progress")
    try:
        async with ProgressView([job]):
            yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
