"""Password-protected admin endpoints: ``/statz``, ``/profz`` (alias ``/profile``)
and ``/heapz`` (spec/wire.md §4).

**Credentials** (§4.2). HTTP Basic only; the username is ignored. Two passwords:

* the *admin* password (``ZERO_ADMIN_PASSWORD``) grants every endpoint;
* the optional *operator* password grants only endpoints declared
  ``Role.OPERATOR``: ``/statz`` and ``/dashboard``, which read what is cheap to
  read. ``/profz``, ``/profile`` and ``/heapz`` are ``Role.ADMIN``: each one slows
  the event loop for its window (a profiler on every call, a walk of
  ``gc.get_objects()``, tracemalloc), as zero-cache guards ``/heapz`` with the
  admin password. They run one at a time, all three together (409 otherwise),
  and a window ends early when its client leaves.

Without credentials, with no admin password and in development mode
(``NODE_ENV=development``) access is allowed (a warning is logged once). Otherwise
an unset admin password denies everything, and outside development the process
must refuse to start (:func:`check_startup`). Passwords are compared as SHA-256
digests with ``hmac.compare_digest``: the time taken says nothing about the
supplied password, its length included. Wrong passwords are slowed per client
address (:class:`LoginBackoff`), but the right one is never refused. A denial is
``401 Unauthorized`` with ``WWW-Authenticate: Basic realm="Statz Protected Area"``
(resp. ``"Profz"``, ``"Profile"``, ``"Heapz Protected Area"``).

**GET /statz** — stats by group (``upstream``, ``changeLog``, ``replica``,
``replication``, ``backup``, ``os``, ``speedups`` from :func:`service_stats`).
``group=`` picks groups (comma list or repeated; unknown names ignored; default
all); ``format=json`` answers ``{group: stats}`` (``pretty`` present: indented),
anything else ``text/plain``::

    === changeLog ===
    rows: 1234
    minWatermark: 0a1b2c

A group that fails to compute reports ``{"error": "..."}``; the request succeeds.

**GET /profz?seconds=N** (or ``duration=N``; an integer, clamped to 1..60 as
zero-cache clamps it, default 5; ``/profile`` is the same endpoint) — profiles the
event loop's thread with :mod:`cProfile` for N seconds (everything the service does
runs on that thread; database driver threads are not included) and answers the
``pstats`` data as an attachment ``changestreamer-<UTC timestamp>.pstats``. This is
what a view-syncer's ``/profrmz`` fetches and passes on. ``worker=`` may name
``change-streamer`` (the only worker this process profiles; any other name is a
404 with a JSON error, as zero-cache answers a worker that produced nothing). One
profile at a time (409 otherwise). Read it with::

    curl -u :$ZERO_ADMIN_PASSWORD -OJ 'http://host:4849/profz?seconds=10'
    python -m pstats changestreamer-20260101T120000Z.pstats   # then: sort cumtime / stats 30
    snakeviz changestreamer-20260101T120000Z.pstats            # a flame graph in the browser

or ``pstats.Stats(path).sort_stats("cumtime").print_stats(30)``. The file is
Python's marshal format: read it with the same Python minor version.

**GET /heapz** — what the heap holds, as text (:mod:`app.server.heap`): objects by
type, and with ``seconds=N`` (1..60) the allocations made during an N-second
``tracemalloc`` window that are still held; ``dump`` present answers that
window's full snapshot instead (``changestreamer-<UTC timestamp>.tracemalloc``,
read with ``tracemalloc.Snapshot.load``; ``seconds`` defaults to 5 then). One
window at a time (409 otherwise)::

    curl -u :$ZERO_ADMIN_PASSWORD 'http://host:4849/heapz?seconds=30'
    curl -u :$ZERO_ADMIN_PASSWORD -OJ 'http://host:4849/heapz?seconds=30&dump'
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import cProfile
import enum
import gc
import hashlib
import hmac
import json
import logging
import marshal
import math
import os
import platform
import re
import resource
import sqlite3
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from app import speedups
from app.logs import redact
from app.protocol.canonical_json import dumps
from app.replica.schema import read_replica_state
from app.server.heap import HeapBusy, HeapTracer, dump_bytes, render_report
from app.server.metric_values import latest_lag_report
from app.streamer.service import ChangeStreamerService
from app.timeouts import within

log = logging.getLogger(__name__)

STATZ_REALM = "Statz Protected Area"
PROFILE_REALM = "Profile Protected Area"
PROFZ_REALM = "Profz Protected Area"
HEAPZ_REALM = "Heapz Protected Area"
PROFILE_WORKER = "change-streamer"  # the one worker /profz profiles (zero's name for it)
STARTUP_ERROR = "ZERO_ADMIN_PASSWORD is required outside development mode (NODE_ENV=development)"

DEFAULT_PROFILE_SECONDS = 5
MAX_PROFILE_SECONDS = 60
# A stats group that needs the database gives up after this long (a wedged
# change DB must not hang the admin endpoint).
GROUP_TIMEOUT_S = 10.0

# The stats groups asked for (None: all) -> {group: stats}.
StatsSource = Callable[[frozenset[str] | None], Awaitable[dict[str, dict[str, Any]]]]

_PROCESS_IMPORTED_AT = time.monotonic()


# ----------------------------------------------------------------------
# Credentials.


class Role(enum.Enum):
    """What an endpoint requires. The admin password satisfies both."""

    OPERATOR = "operator"  # read-only endpoints
    ADMIN = "admin"  # endpoints that change state


def check_startup(admin_password: str | None, development: bool) -> str | None:
    """The error to refuse to start with, or None (spec/wire.md §4.2)."""
    if not admin_password and not development:
        return STARTUP_ERROR
    return None


class LoginBackoff:
    """Slows password guessing: per client address (the TCP peer, unless
    ``CHANGESTREAMER_TRUSTED_PROXIES`` names the proxy in front), after
    ``FREE_FAILURES`` wrong passwords in a row, a wrong password during the wait
    (1 s, doubling to 60 s) is answered 429 with ``Retry-After``, and that answer is
    held back for up to ``HOLD_S`` (at most ``MAX_HELD`` answers at once, so the
    hold pins nothing). The right password always gets in and clears the
    address: anyone may share the operator's address or proxy, and a back-off that
    refused the right password would let them keep the operator out. At most
    ``MAX_ADDRESSES`` are remembered (the least recently failed are forgotten
    first), each for ``FORGET_S`` after its last failure: bounded memory whatever
    the flood."""

    FREE_FAILURES = 10
    FIRST_WAIT_S = 1.0
    MAX_WAIT_S = 60.0
    FORGET_S = 600.0
    MAX_ADDRESSES = 4096
    HOLD_S = 2.0
    MAX_HELD = 64

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, *, hold_s: float = HOLD_S
    ) -> None:
        self._clock = clock
        self._hold_s = hold_s
        # address -> (failures in a row, monotonic time of the last one)
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.held = 0  # 429 answers being held back now
        self.wrong_total = 0  # wrong passwords since start

    async def hold(self, wait_s: float) -> None:
        """Holds a 429 back for up to ``HOLD_S`` (not at all past ``MAX_HELD``)."""
        if self.held >= self.MAX_HELD:
            return
        self.held += 1
        try:
            await asyncio.sleep(min(wait_s, self._hold_s))
        finally:
            self.held -= 1

    def wait_s(self, address: str) -> float:
        """Seconds ``address`` must still wait before its password is checked."""
        entry = self._failures.get(address)
        if entry is None:
            return 0.0
        failures, last = entry
        now = self._clock()
        if now - last >= self.FORGET_S:
            del self._failures[address]
            return 0.0
        return max(0.0, last + self._wait_after(failures) - now)

    def failed(self, address: str) -> None:
        self.wrong_total += 1
        failures = self._failures.pop(address, (0, 0.0))[0] + 1
        self._failures[address] = (failures, self._clock())
        if failures == self.FREE_FAILURES + 1:
            log.warning(
                "%d wrong admin passwords in a row from %s: slowing it down", failures, address
            )
        while len(self._failures) > self.MAX_ADDRESSES:
            self._failures.popitem(last=False)

    def succeeded(self, address: str) -> None:
        self._failures.pop(address, None)

    def _wait_after(self, failures: int) -> float:
        extra = failures - self.FREE_FAILURES
        if extra <= 0:
            return 0.0
        return float(min(self.MAX_WAIT_S, self.FIRST_WAIT_S * 2 ** min(extra - 1, 16)))


class AdminAuth:
    """Checks Basic credentials against the admin and operator passwords.

    Empty passwords count as unset (as an empty ``ZERO_ADMIN_PASSWORD`` does).
    Wrong passwords are slowed down per client address (:class:`LoginBackoff`).
    """

    def __init__(
        self,
        admin_password: str | None,
        operator_password: str | None,
        development: bool,
        *,
        backoff: LoginBackoff | None = None,
    ) -> None:
        self._admin = admin_password.encode() if admin_password else None
        self._operator = operator_password.encode() if operator_password else None
        self._development = development
        self._warned = False
        if self._operator is not None and self._admin is None:
            log.warning(
                "ZERO_OPERATOR_PASSWORD has no effect without ZERO_ADMIN_PASSWORD: %s",
                "admin pages are open without credentials (development mode)"
                if development
                else "admin pages are closed",
            )
        self.backoff = backoff or LoginBackoff()

    def allows(self, authorization: str | None, role: Role) -> bool:
        """Whether an ``Authorization`` header value grants an endpoint requiring ``role``."""
        # An empty password is none, as in zero-cache (curl -u ":$UNSET_VARIABLE").
        supplied = _basic_password(authorization) or None
        if supplied is None and self._admin is None and self._development:
            if not self._warned:
                self._warned = True
                log.warning(
                    "no ZERO_ADMIN_PASSWORD set: admin endpoints are open (development mode)"
                )
            return True
        if self._admin is None or supplied is None:
            return False
        candidates = [self._admin]
        if role is Role.OPERATOR and self._operator is not None:
            candidates.append(self._operator)
        granted = False
        for expected in candidates:  # no short cut: every candidate is compared
            granted |= _constant_time_equal(supplied, expected)
        return granted

    async def denial(self, request: Request, realm: str, role: Role) -> Response | None:
        """None if ``request`` may proceed, else the 401 (or, for a wrong password
        while its address must wait after too many, the 429) to answer."""
        address = request.client.host if request.client is not None else ""
        authorization = request.headers.get("authorization")
        if self.allows(authorization, role):
            if authorization is not None:
                self.backoff.succeeded(address)
            return None
        wait_s = self.backoff.wait_s(address)
        if authorization is not None:  # a challenge-less first request is no guess
            self.backoff.failed(address)
        if wait_s > 0:
            await self.backoff.hold(wait_s)
            return PlainTextResponse(
                "Too many wrong passwords; retry later",
                status_code=429,
                headers={"Retry-After": str(math.ceil(wait_s))},
            )
        return PlainTextResponse(
            "Unauthorized",
            status_code=401,
            headers={"WWW-Authenticate": f'Basic realm="{realm}"'},
        )


def _basic_password(authorization: str | None) -> bytes | None:
    """The password of a Basic ``Authorization`` value; None if absent or malformed."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, colon, password = decoded.partition(b":")
    if not colon:
        return None
    del user  # ignored, as in the reference
    return password


def _constant_time_equal(supplied: bytes, expected: bytes) -> bool:
    # Digests are of one length whatever was supplied, so neither the comparison's
    # time nor an early length check says how long the password is.
    return hmac.compare_digest(hashlib.sha256(supplied).digest(), hashlib.sha256(expected).digest())


# ----------------------------------------------------------------------
# Profiling.


class ProfilerBusy(Exception):
    """A profile is already being captured."""


class LoopProfiler:
    """Captures cProfile data of the calling (event loop) thread, one capture at a time."""

    def __init__(self) -> None:
        self._busy = False

    @property
    def busy(self) -> bool:
        return self._busy

    async def capture(
        self, seconds: float, window: Callable[[float], Awaitable[object]] = asyncio.sleep
    ) -> bytes:
        """Profiles for ``seconds`` (``window(seconds)`` is the wait, which may end
        early); returns the data in ``pstats`` (marshal) format."""
        if self._busy:
            raise ProfilerBusy("a profile is already being captured")
        self._busy = True
        try:
            profiler = cProfile.Profile()
            try:
                profiler.enable()
            except ValueError as e:  # another profiler owns the thread
                raise ProfilerBusy(str(e)) from e
            try:
                await window(seconds)
            finally:
                profiler.disable()
            profiler.create_stats()
            # What Profile.dump_stats writes, without a temporary file.
            return marshal.dumps(profiler.stats)
        finally:
            self._busy = False


async def _client_left(request: Request) -> None:
    """Returns once the client has disconnected (a GET's body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _window_of(request: Request) -> Callable[[float], Awaitable[None]]:
    """A wait of ``seconds`` that ends early when ``request``'s client leaves: a
    capture nobody will read must not slow the loop, nor hold the one slot."""

    async def window(seconds: float) -> None:
        left = asyncio.ensure_future(_client_left(request))
        try:
            await asyncio.wait({left}, timeout=seconds)
        finally:
            left.cancel()

    return window


def _busy_error(profiler: LoopProfiler, heap: HeapTracer) -> JSONResponse | None:
    """409 while a profile or a heap window runs: one at a time, of either kind."""
    if profiler.busy:
        return JSONResponse({"error": "a profile is already being captured"}, status_code=409)
    if heap.busy:
        return JSONResponse({"error": "a heap tracing window is already open"}, status_code=409)
    return None


_SECONDS = re.compile(r"[0-9]{1,9}")


def profile_seconds(raw: str | None, default: int = DEFAULT_PROFILE_SECONDS) -> int | None:
    """``raw`` as a number of seconds clamped to 1..MAX_PROFILE_SECONDS (zero-cache
    clamps); ``default`` when absent; None when it is not a plain integer."""
    if raw is None:
        return default
    if not _SECONDS.fullmatch(raw):
        return None
    return max(1, min(MAX_PROFILE_SECONDS, int(raw)))


def _seconds_error(name: str, default: int) -> JSONResponse:
    return JSONResponse(
        {
            "error": f"{name} must be an integer (clamped to 1..{MAX_PROFILE_SECONDS}; "
            f"default {default})"
        },
        status_code=400,
    )


# ----------------------------------------------------------------------
# Routes.


def admin_router(
    auth: AdminAuth,
    stats: StatsSource,
    *,
    profiler: LoopProfiler | None = None,
    heap: HeapTracer | None = None,
) -> APIRouter:
    """``GET /statz`` (``Role.OPERATOR``), ``/profz`` (and ``/profile``) and ``/heapz``
    (``Role.ADMIN``: they cost the loop while they run)."""
    router = APIRouter()
    loop_profiler = profiler or LoopProfiler()
    heap_tracer = heap or HeapTracer()

    @router.get("/statz")
    async def statz(request: Request) -> Response:
        denied = await auth.denial(request, STATZ_REALM, Role.OPERATOR)
        if denied is not None:
            return denied
        params = request.query_params
        requested = _requested_groups(params.getlist("group"))
        try:
            groups = await stats(requested)
        except Exception as e:
            log.exception("collecting stats failed")
            return JSONResponse({"error": f"collecting stats failed: {_describe(e)}"}, 500)
        if requested is not None:
            groups = {name: values for name, values in groups.items() if name in requested}
        if params.get("format") == "json":
            if "pretty" in params:
                body = json.dumps(groups, indent=2, ensure_ascii=False)
            else:
                body = dumps(groups)
            return Response(body, media_type="application/json")
        return PlainTextResponse(render_text(groups))

    async def profile(request: Request, realm: str) -> Response:
        denied = await auth.denial(request, realm, Role.ADMIN)
        if denied is not None:
            return denied
        params = request.query_params
        name = "duration" if "duration" in params and "seconds" not in params else "seconds"
        seconds = profile_seconds(params.get(name))
        if seconds is None:
            return _seconds_error(name, DEFAULT_PROFILE_SECONDS)
        worker = params.get("worker")
        if worker is not None and worker != PROFILE_WORKER:
            return JSONResponse(
                {
                    "error": f"no profile from worker {worker!r}: this process profiles "
                    f"{PROFILE_WORKER!r}"
                },
                status_code=404,
            )
        busy = _busy_error(loop_profiler, heap_tracer)
        if busy is not None:
            return busy
        started = datetime.now(UTC)
        try:
            data = await loop_profiler.capture(seconds, _window_of(request))
        except ProfilerBusy as e:
            return JSONResponse({"error": str(e)}, status_code=409)
        filename = f"changestreamer-{started.strftime('%Y%m%dT%H%M%SZ')}.pstats"
        return _attachment(data, filename)

    @router.get("/profz")
    async def profz(request: Request) -> Response:
        return await profile(request, PROFZ_REALM)

    @router.get("/profile")
    async def profile_alias(request: Request) -> Response:
        return await profile(request, PROFILE_REALM)

    @router.get("/heapz")
    async def heapz(request: Request) -> Response:
        denied = await auth.denial(request, HEAPZ_REALM, Role.ADMIN)
        if denied is not None:
            return denied
        params = request.query_params
        dump = "dump" in params
        default = DEFAULT_PROFILE_SECONDS if dump else 0
        raw = params.get("seconds")
        seconds = default if raw is None else profile_seconds(raw)
        if seconds is None:
            return _seconds_error("seconds", default)
        busy = _busy_error(loop_profiler, heap_tracer)
        if busy is not None:
            return busy
        started = datetime.now(UTC)
        try:
            snapshot = await heap_tracer.snapshot(seconds, _window_of(request))
        except HeapBusy as e:
            return JSONResponse({"error": str(e)}, status_code=409)
        if dump:
            assert snapshot is not None  # seconds >= 1 when dumping
            filename = f"changestreamer-{started.strftime('%Y%m%dT%H%M%SZ')}.tracemalloc"
            return _attachment(await asyncio.to_thread(dump_bytes, snapshot), filename)
        return PlainTextResponse(render_report(snapshot, seconds))

    return router


def _attachment(data: bytes, filename: str) -> Response:
    return Response(
        data,
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )


def _requested_groups(values: list[str]) -> frozenset[str] | None:
    names = frozenset(n.strip() for v in values for n in v.split(",") if n.strip())
    return names or None


def render_text(groups: dict[str, dict[str, Any]]) -> str:
    """``=== group ===`` sections of ``key: value`` lines (non-strings as JSON)."""
    sections = []
    for name, values in groups.items():
        lines = [f"=== {name} ==="]
        lines += [f"{k}: {v if isinstance(v, str) else dumps(v)}" for k, v in values.items()]
        sections.append("\n".join(lines) + "\n")
    return "\n".join(sections)


# ----------------------------------------------------------------------
# The stats of a change-streamer.


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
        log.warning("a stats group failed: %s", _describe(e))
        return {"error": _describe(e)}


def _describe(error: BaseException) -> str:
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
    s = _running(service)
    purger = s.purger
    return {
        # Shown to operators and on the dashboard: never its credentials.
        "backupURL": redact(s.options.backup_url) if s.options.backup_url else None,
        "backupWatermark": s.backup_watermark,
        "coverageTarget": s.coverage_target,
        "covered": s.backup_covered,
        "problem": s.backup_problem,
        "lagSeconds": s.backup_lag_seconds(),
        "monitor": s.backup_state.stats() if s.backup_state is not None else None,
        "purge": {
            "floor": purger.floor,
            "heldBy": purger.floor_holder,
            "purgedBelow": purger.purged_watermark or None,
            "passes": purger.passes,
            "rowsDeleted": purger.deleted,
        },
        "reservations": {
            "open": s.reservations.open_tasks,
            "longestSeconds": round(s.reservations.longest_completed_s, 3),
            "held": [
                {"taskID": r.task_id, "openSeconds": round(r.open_s, 3), "watermark": r.watermark}
                for r in s.reservations.open_reservations()
            ],
        },
    }


async def _replication_stats(service: ChangeStreamerService | None) -> dict[str, Any]:
    s = _running(service)
    config = await s.replication.config()
    state = await s.replication.state()
    forwarder = s.forwarder
    subscribers = [
        *(("active", sub) for sub in forwarder.active),
        *(("queued", sub) for sub in forwarder.queued),
    ]
    return {
        "replicaVersion": config.replica_version if config else s.replica_version,
        "publications": list(config.publications) if config else None,
        "resetRequired": config.reset_required if config else None,
        "lastWatermark": state.last_watermark if state else None,
        "owner": state.owner if state else None,
        "ownerAddress": state.owner_address if state else None,
        "taskID": s.task_id,
        "running": s.running,
        "durableWatermark": s.storer.durable,
        "transactions": s.transactions,
        "changes": s.changes,
        "storerQueuedBytes": s.storer.queued_bytes,
        # How late the event loop ran what was due: now, and the worst of the last
        # 10 s and 60 s.
        "eventLoopLagMs": {
            "latest": round(s.loop_lag.latest_s * 1000, 1),
            "max10s": round(s.loop_lag.max_s(10.0) * 1000, 1),
            "max60s": round(s.loop_lag.max_s() * 1000, 1),
        },
        "subscribers": {"active": len(forwarder.active), "queued": len(forwarder.queued)},
        "subscriberDetails": [
            {
                "id": sub.id,
                "taskID": sub.task_id,
                "mode": sub.mode,
                "state": state_name,
                "protocolVersion": sub.protocol_version,
                "watermark": sub.watermark,
                "acked": sub.acked,
                "catchingUp": sub.backlogged,
                # The range the catch-up reads (``to`` is None until the read starts).
                "catchUp": {"from": sub.catchup_from, "to": sub.catchup_to},
                "backlogMessages": sub.backlog_size,
                "bufferedBytes": sub.buffered_bytes,
                "pendingMessages": sub.downstream.pending,
                # Transactions sent and not acked, and how long the oldest durable
                # commit it has not acked has been durable.
                "lagTransactions": sub.unacked_commits,
                "lagMs": round(s.durable_wait_s(sub.acked) * 1000),
                "missedReleases": sub.missed_releases,
                "lagging": sub.lagging_since is not None,
            }
            for state_name, sub in subscribers
        ],
        "flowControl": {
            "waits": dict(forwarder.stats.waits),
            "waitSeconds": forwarder.stats.wait_seconds,
        },
        "lagReport": latest_lag_report(s),
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
