"""``GET /dashboard``: a read-only live page of the streamer, behind the admin or
operator password (the same rules and backoff as ``/statz``, ``admin.py``).

* ``/dashboard`` — the page (``static/dashboard.html`` with its CSS and JS, and
  uPlot for the charts, vendored: it works offline);
* ``/dashboard/events`` — server-sent events, a JSON snapshot about every second
  (``dashboard_feed.py``: one computation shared by at most a few streams);
* ``/dashboard/snapshot`` — one snapshot, for ``curl``;
* ``/dashboard/static/<file>`` — the page's files (a fixed list).

A snapshot has no values of its own: it is what ``/metrics`` reads
(``MetricValues``, ``metric_values.py``: totals, the change log's cached size,
lags, backlogs, the Postgres slots' WAL), ``/statz``'s ``replication`` and
``backup`` groups (``service_stats``: subscribers, the purge floor, backups,
reservations), the service's snapshot (``app/streamer/snapshot.py``: the
upstream's type and last commit) and ``/ready``'s answer, arranged by what the
page shows::

    time, running, ready {ok, reason}, errors {group: message}
    stream       transactions, changes, durableWatermark, replicaVersion,
                 storerQueuedBytes, backlogBytes, eventLoopLagMs,
                 flowControl {waits {mode: n}, waitSeconds}
    subscribers  [{id, taskID, mode, state, protocolVersion, watermark, acked,
                   bufferedBytes, pendingMessages, lagMs, lagTransactions,
                   missedReleases, lagging, catchingUp, catchUp {from, to, progress}}]
                 (lagTransactions: sent, not acked; lagMs: how long the oldest durable
                 commit it has not acked has been durable)
    upstream     type, lastCommit, lastCommitAgeSeconds, lagSeconds, lagReport,
                 slots [{slot, retainedWalBytes, unconfirmedWalBytes}] (Postgres)
    changeLog    rows, bytes, minWatermark, maxWatermark, purge {floor, heldBy, …}
    backup       url, watermark, lagSeconds, writeLagSeconds, coverageTarget,
                 covered, problem, gate {open, reason}, litestream, probeError
    reservations open [{taskID, openSeconds, watermark}], longestSeconds
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from importlib import resources
from typing import Any, Final

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.protocol.canonical_json import dumps
from app.protocol.lexi import watermark_fraction
from app.server.admin_auth import AdminAuth, Role
from app.server.dashboard_feed import MAX_LIFETIME_S, SnapshotFeed
from app.server.metric_values import MetricValues, StreamerReadings
from app.server.statz import service_stats
from app.streamer.service import ChangeStreamerService
from app.streamer.snapshot import ServiceSnapshot
from app.timeouts import within

__all__ = ["DASHBOARD_REALM", "dashboard_router", "dashboard_snapshot"]

DASHBOARD_REALM: Final = "Dashboard Protected Area"
# The page's files, by name (nothing else is served from the package).
STATIC_FILES: Final = {
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "uPlot.LICENSE": "text/plain; charset=utf-8",
}
_GROUPS: Final = frozenset({"replication", "backup"})
# The change log's min/max watermark: indexed lookups, bounded anyway.
QUERY_TIMEOUT_S: Final = 5.0
_SLOT_METRICS: Final = {
    "changestreamer_slot_retained_wal_bytes": "retainedWalBytes",
    "changestreamer_slot_unconfirmed_wal_bytes": "unconfirmedWalBytes",
}
_PAGE_HEADERS: Final = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
}

ReadyCheck = Callable[[], tuple[bool, str]]


async def dashboard_snapshot(
    service: ChangeStreamerService | None,
    values: MetricValues,
    ready: ReadyCheck,
    wall_s: float,
) -> dict[str, Any]:
    """What the page shows at ``wall_s`` (module docstring)."""
    is_ready, reason = ready()
    readings = (await values.read_fresh()).streamer
    groups = await service_stats(service, _GROUPS)
    errors = {name: group["error"] for name, group in groups.items() if "error" in group}
    replication = {} if "replication" in errors else groups["replication"]
    backup = {} if "backup" in errors else groups["backup"]
    monitor = backup.get("monitor") or {}
    reservations = backup.get("reservations") or {}
    change_log: dict[str, Any] = {"purge": backup.get("purge")}
    upstream: dict[str, Any] = {}
    if service is not None and readings is not None:
        change_log |= await _change_log(service, readings, errors)
    snap = service.snapshot() if service is not None else None
    if snap is not None and readings is not None:
        upstream = _upstream(snap, readings)
    return {
        "time": round(wall_s * 1000),
        "running": snap is not None and snap.running,
        "ready": {"ok": is_ready, "reason": reason or None},
        "errors": errors,
        "stream": {
            "taskID": replication.get("taskID"),
            "replicaVersion": replication.get("replicaVersion"),
            "durableWatermark": replication.get("durableWatermark"),
            "eventLoopLagMs": replication.get("eventLoopLagMs"),
            **(_stream(readings) if readings is not None else {}),
        },
        "subscribers": [_subscriber(row) for row in replication.get("subscriberDetails", [])],
        "upstream": upstream,
        "changeLog": change_log,
        "backup": {
            "url": backup.get("backupURL"),
            "watermark": backup.get("backupWatermark"),
            "lagSeconds": _rounded(readings.backup_lag_s if readings else None),
            "writeLagSeconds": _rounded(readings.backup_write_lag_s if readings else None),
            "coverageTarget": backup.get("coverageTarget"),
            "covered": backup.get("covered"),
            "problem": backup.get("problem"),
            # What /ready asks of the backups: one that covers the replica, not wedged.
            "gate": {
                "open": backup.get("covered") is True and backup.get("problem") is None,
                "reason": None if is_ready else reason,
            },
            "litestream": monitor.get("litestream"),
            "probeError": monitor.get("probeError"),
        },
        "reservations": {
            "open": reservations.get("held", []),
            "longestSeconds": reservations.get("longestSeconds"),
        },
    }


def _stream(r: StreamerReadings) -> dict[str, Any]:
    waits = r.flow_control_waits
    return {
        "transactions": r.transactions,
        "changes": r.changes,
        "storerQueuedBytes": r.storer_queued_bytes,
        "backlogBytes": r.backlog_bytes,
        "pendingMessages": r.pending_messages,
        "flowControl": {
            "waits": {mode: reading.count for mode, reading in waits.items()},
            "waitSeconds": round(sum(reading.sum for reading in waits.values()), 3),
        },
    }


def _upstream(snap: ServiceSnapshot, r: StreamerReadings) -> dict[str, Any]:
    by_slot: dict[str, dict[str, Any]] = {}
    for metric in r.source:  # the change source's own metrics: the Postgres slots
        key = _SLOT_METRICS.get(metric.name)
        if key is None:
            continue
        for labels, value in metric.samples:
            slot = labels.get("slot", "")
            by_slot.setdefault(slot, {"slot": slot})[key] = value
    return {
        "type": snap.upstream_type,
        "lastCommit": snap.durable_watermark,
        "lastCommitAgeSeconds": _rounded(snap.last_commit_age_s),
        "lagSeconds": _rounded(r.lag_s),
        "lagReport": snap.lag_report,
        "slots": [by_slot[name] for name in sorted(by_slot)],
    }


async def _change_log(
    service: ChangeStreamerService, r: StreamerReadings, errors: dict[str, str]
) -> dict[str, Any]:
    log = service.change_log
    try:
        low = await within(log.min_watermark(), QUERY_TIMEOUT_S)
        high = await within(log.max_watermark(), QUERY_TIMEOUT_S)
    except Exception as e:
        errors["changeLog"] = f"{type(e).__name__}: {e}"
        low = high = None
    return {
        "rows": r.change_log_rows,
        "bytes": r.change_log_bytes,
        "minWatermark": low,
        "maxWatermark": high,
    }


def _subscriber(row: dict[str, Any]) -> dict[str, Any]:
    """A ``/statz`` subscriber row with its catch-up progress (0..1)."""
    catch_up = dict(row.get("catchUp") or {})
    catch_up["progress"] = (
        watermark_fraction(catch_up.get("from"), catch_up.get("to"), row.get("watermark"))
        if row.get("catchingUp")
        else 1.0
    )
    return {**row, "catchUp": catch_up}


def _rounded(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


def dashboard_router(
    auth: AdminAuth,
    service_getter: Callable[[], ChangeStreamerService | None],
    ready: ReadyCheck,
    *,
    feed_interval_s: float = 1.0,
    max_streams: int = 4,
    change_log_rows_ttl_s: float = 5.0,
    draining: asyncio.Event | None = None,
    wall_clock: Callable[[], float] = time.time,
    stream_lifetime_s: float = MAX_LIFETIME_S,
) -> tuple[APIRouter, SnapshotFeed]:
    """The routes, and the feed behind ``/dashboard/events`` (the app stops it).
    ``draining``: the server's ``PendingLimits.draining``, which ends the streams."""
    router = APIRouter()
    values = MetricValues(
        service_getter,
        change_log_rows_ttl_s=change_log_rows_ttl_s,
        change_log_timeout_s=QUERY_TIMEOUT_S,
        wall_clock=wall_clock,
    )

    async def snapshot() -> dict[str, Any]:
        return await dashboard_snapshot(service_getter(), values, ready, wall_clock())

    feed = SnapshotFeed(
        snapshot,
        interval_s=feed_interval_s,
        max_streams=max_streams,
        draining=draining,
        max_lifetime_s=stream_lifetime_s,
    )

    @router.get("/dashboard")
    async def page(request: Request) -> Response:
        denied = await auth.denial(request, DASHBOARD_REALM, Role.OPERATOR)
        if denied is not None:
            return denied
        return Response(
            _static("dashboard.html"), media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS
        )

    @router.get("/dashboard/events")
    async def events(request: Request) -> Response:
        denied = await auth.denial(request, DASHBOARD_REALM, Role.OPERATOR)
        if denied is not None:
            return denied
        return feed.response()

    @router.get("/dashboard/snapshot")
    async def one_snapshot(request: Request) -> Response:
        denied = await auth.denial(request, DASHBOARD_REALM, Role.OPERATOR)
        if denied is not None:
            return denied
        body = dumps(await snapshot())
        return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})

    @router.get("/dashboard/static/{name}")
    async def static(request: Request, name: str) -> Response:
        denied = await auth.denial(request, DASHBOARD_REALM, Role.OPERATOR)
        if denied is not None:
            return denied
        media_type = STATIC_FILES.get(name)
        if media_type is None:
            return JSONResponse({"error": "not found"}, status_code=404)
        return Response(
            _static(name), media_type=media_type, headers={"Cache-Control": "private, max-age=300"}
        )

    return router, feed


_CACHE: dict[str, bytes] = {}


def _static(name: str) -> bytes:
    """A file of ``app/server/static`` (package data), read once."""
    data = _CACHE.get(name)
    if data is None:
        data = _CACHE[name] = (resources.files("app.server") / "static" / name).read_bytes()
    return data
