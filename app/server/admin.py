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
address and password (:class:`LoginBackoff`): once an address must wait, its
passwords are held or refused (429) unchecked until the wait is over. A denial is
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
import json
import logging
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from app.protocol.canonical_json import dumps
from app.server.admin_auth import AdminAuth, Role
from app.server.heap import HeapBusy, HeapTracer, dump_bytes, render_report
from app.server.profiler import LoopProfiler, ProfilerBusy
from app.server.statz import describe_error, render_text

log = logging.getLogger(__name__)

STATZ_REALM = "Statz Protected Area"
PROFILE_REALM = "Profile Protected Area"
PROFZ_REALM = "Profz Protected Area"
HEAPZ_REALM = "Heapz Protected Area"
PROFILE_WORKER = "change-streamer"  # the one worker /profz profiles (zero's name for it)

DEFAULT_PROFILE_SECONDS = 5
MAX_PROFILE_SECONDS = 60
# The stats groups asked for (None: all) -> {group: stats}.
StatsSource = Callable[[frozenset[str] | None], Awaitable[dict[str, dict[str, Any]]]]


# ----------------------------------------------------------------------
# Profiling.


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
            return JSONResponse({"error": f"collecting stats failed: {describe_error(e)}"}, 500)
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
