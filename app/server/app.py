"""The FastAPI application: health endpoints, the admin pages and the replication
websockets. It only routes: the node's lifecycle (the coverage gate, the start-up
delay, the takeover, retiring, ``/ready``) is ``app.runtime.lifecycle``'s, which the
app's lifespan runs beside the server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from app.runtime.lifecycle import NodeLifecycle
from app.server.admin import admin_router
from app.server.admin_auth import AdminAuth
from app.server.dashboard import dashboard_router
from app.server.health import health_router
from app.server.http_protocol import PendingLimits
from app.server.metrics import metrics_router
from app.server.replication import router as replication_router
from app.server.statz import service_stats
from app.storage import ChangeDb
from app.streamer.service import ChangeStreamerService


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
    lifecycle: NodeLifecycle | None = None,
    auth: AdminAuth | None = None,
    keepalive_timeout_s: float | None = None,
    on_keepalive_expired: Callable[[], None] | None = None,
    connection_limits: PendingLimits | None = None,
) -> FastAPI:
    """The app over a migrated change DB (disposed at shutdown) and its service.

    Pass the ``service``, or a ``service_factory`` that builds it on the server's
    event loop at start-up (its database pools and futures belong to that loop), and
    the node's ``lifecycle`` (by default one with a start-up delay of 0 that does not
    stop the server). A ``lifecycle`` without a service is a node that serves nothing
    (one that starts retired).
    """
    holder = ServiceHolder(service)
    auth = auth or AdminAuth(None, None, development=True)
    node = lifecycle or NodeLifecycle(startup_delay_s=0.0)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        runner = None
        if service_factory is not None:
            holder.service = await service_factory()
        if holder.service is not None:
            if not node.attached:  # a factory attaches it with its own checks
                node.attach(holder.service)
            runner = asyncio.create_task(node.run(), name="node-lifecycle")
        try:
            yield
        finally:
            await node.stop()
            if runner is not None:
                with contextlib.suppress(BaseException):
                    await runner
            await feed.aclose()
            await db.dispose()

    # No OpenAPI document: it would list every route to anyone, without a password.
    app = FastAPI(
        title="changestreamer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )

    dashboard, feed = dashboard_router(
        auth,
        lambda: holder.service,
        node.readiness,
        draining=connection_limits.draining if connection_limits is not None else None,
    )

    async def stats(groups: frozenset[str] | None) -> dict[str, dict[str, Any]]:
        found = await service_stats(holder.service, groups)
        if groups is None or "node" in groups:
            found = {"node": node.stats(), **found}
        return found

    app.include_router(
        health_router(
            ready=node.readiness,
            keepalive_timeout_s=keepalive_timeout_s or None,
            on_keepalive_expired=on_keepalive_expired or (lambda: None),
        )
    )
    app.include_router(admin_router(auth, stats))
    app.include_router(dashboard)
    app.include_router(metrics_router(lambda: holder.service, connection_limits=connection_limits))
    if service is not None or service_factory is not None:
        app.include_router(replication_router(holder.get, node.refusal))
    return app
