"""What ``/statz`` shows (and the dashboard reads): the service's stats by group, each
group bounded in time, and their text form."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import platform
import resource
import sqlite3
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from app import speedups
from app.logs import redact
from app.protocol.canonical_json import dumps
from app.replica.schema import read_replica_state
from app.streamer.service import ChangeStreamerService
from app.timeouts import within

# The admin pages log under one name, whichever module of them writes the line.
log = logging.getLogger("app.server.admin")

# A stats group that needs the database gives up after this long (a wedged
# change DB must not hang the admin endpoint).
GROUP_TIMEOUT_S = 10.0

_PROCESS_IMPORTED_AT = time.monotonic()


def render_text(groups: dict[str, dict[str, Any]]) -> str:
    """``=== group ===`` sections of ``key: value`` lines (non-strings as JSON)."""
    sections = []
    for name, values in groups.items():
        lines = [f"=== {name} ==="]
        lines += [f"{k}: {v if isinstance(v, str) else dumps(v)}" for k, v in values.items()]
        sections.append("\n".join(lines) + "\n")
    return "\n".join(sections)


async def service_stats(
    service: ChangeStreamerService | None, groups: frozenset[str] | None = None
) -> dict[str, dict[str, Any]]:
    """The ``upstream``, ``changeLog``, ``replica``, ``replication``, ``backup``,
    ``os`` and ``speedups`` groups, or those of them in ``groups``; each fails on its
    own. Only the groups asked for are computed (``upstream`` opens a connection)."""
    sources: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
        "upstream": lambda: _running(service).upstream_stats(),
        "changeLog": lambda: _change_log_stats(service),
        "replica": lambda: _replica_stats(service),
        "replication": lambda: _replication_stats(service),
        "backup": lambda: _backup_stats(service),
        "os": _os_stats_async,
        "speedups": _speedups_stats_async,
    }
    return {
        name: await _guarded(compute)
        for name, compute in sources.items()
        if groups is None or name in groups
    }


async def _guarded(compute: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    try:
        return await within(compute(), GROUP_TIMEOUT_S)
    except Exception as e:
        log.warning("a stats group failed: %s", describe_error(e))
        return {"error": describe_error(e)}


def describe_error(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _running(service: ChangeStreamerService | None) -> ChangeStreamerService:
    if service is None:
        raise RuntimeError("the change streamer is not running")
    return service


async def _change_log_stats(service: ChangeStreamerService | None) -> dict[str, Any]:
    change_log = _running(service).change_log
    writer = change_log.db.sqlite_writer
    return {
        "rows": await change_log.count(),
        "minWatermark": await change_log.min_watermark(),
        "maxWatermark": await change_log.max_watermark(),
        "bytes": await change_log.size_bytes(),
        # SQLite's group commits: their process (None: in the service itself).
        "writerProcess": None if writer is None else {"pid": writer.pid, "starts": writer.starts},
    }


async def _replica_stats(service: ChangeStreamerService | None) -> dict[str, Any]:
    path = _running(service).options.replica_file
    if path is None:
        return {"file": None}  # a service without a replica of its own
    return await asyncio.to_thread(replica_file_stats, path)


def replica_file_stats(path: str) -> dict[str, Any]:
    """The replica file as zero-cache's ``replica`` group shows it, read-only: its
    pragmas (not ``wal_checkpoint``, which would checkpoint: litestream owns
    checkpoints while it backs the file up), its versions and its files' sizes."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:

        def pragma(name: str) -> Any:
            row = conn.execute(f"PRAGMA {name}").fetchone()
            return None if row is None else row[0]

        stats: dict[str, Any] = {"file": path}
        for name in ("page count", "page size", "journal mode", "auto vacuum", "freelist count"):
            stats[name] = pragma(name.replace(" ", "_"))
        state = read_replica_state(conn)
        stats["replicaVersion"] = state.replica_version
        stats["stateVersion"] = state.state_version
    finally:
        conn.close()
    stats["db file stats"] = {
        "size": os.stat(path).st_size,
        "walSize": os.stat(path + "-wal").st_size if os.path.exists(path + "-wal") else 0,
        "mtime": os.stat(path).st_mtime,
    }
    return stats


async def _backup_stats(service: ChangeStreamerService | None) -> dict[str, Any]:
    """Backups, purge and reservations: what holds the change log's floor, and why."""
    snap = _running(service).snapshot()
    backup, purge, reservations = snap.backup, snap.purge, snap.reservations
    return {
        # Shown to operators and on the dashboard: never its credentials.
        "backupURL": redact(backup.url) if backup.url else None,
        "backupWatermark": backup.watermark,
        "coverageTarget": backup.coverage_target,
        "covered": backup.covered,
        "problem": backup.problem,
        "lagSeconds": backup.lag_s,
        "monitor": backup.monitor,
        "purge": {
            "floor": purge.floor,
            "heldBy": purge.floor_holder,
            "purgedBelow": purge.purged_below,
            "passes": purge.passes,
            "rowsDeleted": purge.rows_deleted,
        },
        "reservations": {
            "open": list(reservations.open_tasks),
            "longestSeconds": round(reservations.longest_completed_s, 3),
            "held": [
                {"taskID": r.task_id, "openSeconds": round(r.open_s, 3), "watermark": r.watermark}
                for r in reservations.held
            ],
        },
    }


async def _replication_stats(service: ChangeStreamerService | None) -> dict[str, Any]:
    s = _running(service)
    config = await s.replication.config()
    state = await s.replication.state()
    snap = s.snapshot()
    waits = snap.flow_control_waits
    return {
        "replicaVersion": config.replica_version if config else snap.replica_version,
        "publications": list(config.publications) if config else None,
        "resetRequired": config.reset_required if config else None,
        "lastWatermark": state.last_watermark if state else None,
        "owner": state.owner if state else None,
        "ownerAddress": state.owner_address if state else None,
        "taskID": snap.task_id,
        "running": snap.running,
        "durableWatermark": snap.durable_watermark,
        "transactions": snap.transactions,
        "changes": snap.changes,
        "storerQueuedBytes": snap.storer_queued_bytes,
        # How late the event loop ran what was due: now, and the worst of the last
        # 10 s and 60 s.
        "eventLoopLagMs": {
            "latest": round(snap.loop_lag.latest_s * 1000, 1),
            "max10s": round(snap.loop_lag.max_10s_s * 1000, 1),
            "max60s": round(snap.loop_lag.max_60s_s * 1000, 1),
        },
        "subscribers": {"active": snap.active_subscribers, "queued": snap.queued_subscribers},
        "subscriberDetails": [
            {
                "id": sub.id,
                "taskID": sub.task_id,
                "mode": sub.mode,
                "state": sub.state,
                "protocolVersion": sub.protocol_version,
                "watermark": sub.watermark,
                "acked": sub.acked,
                "catchingUp": sub.catching_up,
                # The range the catch-up reads (``to`` is None until the read starts).
                "catchUp": {"from": sub.catchup_from, "to": sub.catchup_to},
                "backlogMessages": sub.backlog_messages,
                "bufferedBytes": sub.buffered_bytes,
                "pendingMessages": sub.pending_messages,
                # Transactions sent and not acked, and how long the oldest durable
                # commit it has not acked has been durable.
                "lagTransactions": sub.unacked_commits,
                "lagMs": round(sub.ack_lag_s * 1000),
                "missedReleases": sub.missed_releases,
                "lagging": sub.lagging,
            }
            for sub in snap.subscribers
        ],
        "flowControl": {
            "waits": {mode: reading.count for mode, reading in waits.items()},
            "waitSeconds": sum(reading.sum for reading in waits.values()),
        },
        "lagReport": snap.lag_report,
    }


async def _os_stats_async() -> dict[str, Any]:
    return os_stats()


def os_stats() -> dict[str, Any]:
    """The process and host: pid, uptime, memory, CPU time, load, Python, its collector."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    max_rss = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "pid": os.getpid(),
        "uptimeSeconds": round(_process_uptime_s(), 3),
        "rssBytes": _current_rss_bytes(),
        "maxRssBytes": max_rss,
        "userCpuSeconds": round(usage.ru_utime, 3),
        "systemCpuSeconds": round(usage.ru_stime, 3),
        "threads": threading.active_count(),
        # The collector's settings (`serve` raises the first, app/runtime/gc_tuning.py),
        # objects frozen at start-up, and passes run per generation.
        "gcThresholds": list(gc.get_threshold()),
        "gcFrozenObjects": gc.get_freeze_count(),
        "gcCollections": [generation["collections"] for generation in gc.get_stats()],
        "loadAverage": load,
        "cpuCount": os.cpu_count(),
        "pythonVersion": platform.python_version(),
        "pythonImplementation": platform.python_implementation(),
        "platform": platform.platform(),
    }


async def _speedups_stats_async() -> dict[str, Any]:
    return speedups_stats()


def speedups_stats() -> dict[str, Any]:
    """Which C helpers run (app/speedups.py): the start-up log's summary, then each
    helper's name → whether its C version (not its pure-Python twin) is in use."""
    return {"summary": speedups.summary(), **speedups.active()}


def _current_rss_bytes() -> int | None:
    """VmRSS from /proc (Linux); None elsewhere."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _process_uptime_s() -> float:
    """Since the process started (Linux /proc), else since this module was imported."""
    try:
        with open("/proc/self/stat", encoding="ascii", errors="replace") as f:
            # Field 22 (starttime, clock ticks after boot); the command name
            # (field 2) may hold spaces, so count from its closing parenthesis.
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            boot_uptime = float(f.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, boot_uptime - started)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _PROCESS_IMPORTED_AT
