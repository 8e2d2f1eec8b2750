"""The FastAPI application: health endpoints and the replication websockets.

The app owns the service's lifetime, the takeover's order (docs/architecture.md,
decision 52):

1. **gated**: with backups configured, the change log is not taken over before a
   backup covers this node's replica (the coverage gate); ``/ready`` says what it
   waits for;
2. **delay**: then ``/ready`` answers 200 — on purpose before this node owns the
   log, so that the routing layer knows it when the old owner lets go, as zero
   does — and the change stream (which takes over the change log and the
   upstream) starts after ``startup_delay_s``, or at once when the first serving
   subscriber or snapshot reservation arrives: that proves the load balancer
   routes to this task (spec/wire.md §2.6);
3. **owner** until another node takes the log over; then **retired**: the stream
   has stopped (nothing more is stored, acked or purged) and its subscribers were
   closed, so they find the new owner; the server stays up, ``/ready`` answers 503
   saying who owns the log, and the process waits to be stopped (an orchestrator
   that restarted an exited process would bring the old node back as the newest).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app.server.admin import admin_router
from app.server.admin_auth import AdminAuth
from app.server.dashboard import dashboard_router
from app.server.health import health_router
from app.server.http_protocol import PendingLimits
from app.server.metrics import metrics_router
from app.server.replication import router as replication_router
from app.server.statz import service_stats
from app.storage import ChangeDb, OwnershipLostError
from app.streamer.service import ChangeStreamerService

log = logging.getLogger(__name__)


class ServiceHolder:
    """The app's service, which may only be built once the event loop runs."""

    def __init__(self, service: ChangeStreamerService | None = None) -> None:
        self.service = service

    def get(self) -> ChangeStreamerService:
        if self.service is None:
            raise RuntimeError("the change streamer is not running")
        return self.service


def create_app(
    db: ChangeDb,
    service: ChangeStreamerService | None = None,
    *,
    service_factory: Callable[[], Awaitable[ChangeStreamerService]] | None = None,
    startup_delay_s: float = 15.0,
    on_service_exit: Callable[[], None] | None = None,
    auth: AdminAuth | None = None,
    keepalive_timeout_s: float | None = None,
    on_keepalive_expired: Callable[[], None] | None = None,
    connection_limits: PendingLimits | None = None,
    on_retired: Callable[[OwnershipLostError], None] | None = None,
    retired: str | None = None,
) -> FastAPI:
    """The app over a migrated change DB (disposed at shutdown) and its service.

    Pass the ``service``, or a ``service_factory`` that builds it on the server's
    event loop at start-up (its database pools and futures belong to that loop).
    ``on_retired`` hears of the takeover that retired this node; ``retired`` (and no
    service) is a node that starts retired: ``/ready`` answers 503 with it.
    """
    holder = ServiceHolder(service)
    auth = auth or AdminAuth(None, None, development=True)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        runner = None
        if service_factory is not None:
            holder.service = await service_factory()
        service = holder.service
        if service is not None:
            runner = asyncio.create_task(
                _run(service, startup_delay_s, on_service_exit, on_retired),
                name="change-streamer",
            )
        try:
            yield
        finally:
            if service is not None:
                await service.stop()
            if runner is not None:
                with contextlib.suppress(BaseException):
                    await runner
            await feed.aclose()
            await db.dispose()

    # No OpenAPI document: it would list every route to anyone, without a password.
    app = FastAPI(
        title="changestreamer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )

    def ready() -> tuple[bool, str]:
        # Ready = the streamer is about to take the change log over or owns it and,
        # with backups configured, a backup covers the replica (a restoring
        # view-syncer needs that; the takeover waits for it too).
        if retired is not None:
            return False, retired
        current = holder.service
        if current is None:
            return False, "the change streamer is not running"
        lost = current.failure
        if isinstance(lost, OwnershipLostError):
            return False, retired_reason(lost)
        if current.stopped.is_set():
            return False, "the change streamer is not running"
        backups = current.backups
        problem = backups.problem()
        if problem is not None:
            return False, problem
        if not backups.covered():
            return False, _waiting_for(backups.coverage_target)
        return True, ""

    dashboard, feed = dashboard_router(
        auth,
        lambda: holder.service,
        ready,
        draining=connection_limits.draining if connection_limits is not None else None,
    )

    app.include_router(
        health_router(
            ready=ready,
            keepalive_timeout_s=keepalive_timeout_s or None,
            on_keepalive_expired=on_keepalive_expired or on_service_exit or (lambda: None),
        )
    )
    app.include_router(admin_router(auth, lambda groups: service_stats(holder.service, groups)))
    app.include_router(dashboard)
    app.include_router(metrics_router(lambda: holder.service, connection_limits=connection_limits))
    if service is not None or service_factory is not None:
        app.include_router(replication_router(holder.get))
    return app


def retired_reason(lost: OwnershipLostError) -> str:
    """``/ready``'s reason on a node another one took the change log from."""
    return f"retired: the change log is owned by {lost.owner}"


def _waiting_for(target: str | None) -> str:
    if target is None:
        return "waiting for the first backup of the replica"
    return f"waiting for a backup that covers the replica at {target}"


async def _run(
    service: ChangeStreamerService,
    startup_delay_s: float,
    on_exit: Callable[[], None] | None,
    on_retired: Callable[[OwnershipLostError], None] | None,
) -> None:
    if not await _gated(service):
        return
    started = asyncio.ensure_future(service.serving_started.wait())
    stopped = asyncio.ensure_future(service.stopped.wait())
    try:
        await asyncio.wait(
            {started, stopped}, timeout=startup_delay_s, return_when="FIRST_COMPLETED"
        )
    finally:
        started.cancel()
        stopped.cancel()
    if service.stopped.is_set():
        return
    retiring = False
    try:
        await service.run()
    except OwnershipLostError as e:
        # Retired, not exited: see the module's docstring.
        retiring = True
        log.warning("%s; this node serves nothing more and waits to be stopped", e)
        if on_retired is not None:
            on_retired(e)
    except Exception:
        log.exception("the change streamer stopped with an error")
        raise
    finally:
        # Without its streamer the process serves nothing useful: the server
        # stops too (the command line passes a callback that shuts uvicorn down).
        if on_exit is not None and not retiring:
            on_exit()


async def _gated(service: ChangeStreamerService) -> bool:
    """Waits for the coverage gate (or the service's stop: then False)."""
    backups = service.backups
    if backups.covered():
        return True
    log.info("the change log is taken over once the backup covers the replica")
    covered = asyncio.ensure_future(backups.wait_covered())
    stopped = asyncio.ensure_future(service.stopped.wait())
    try:
        await asyncio.wait({covered, stopped}, return_when="FIRST_COMPLETED")
    finally:
        covered.cancel()
        stopped.cancel()
    return not service.stopped.is_set()
