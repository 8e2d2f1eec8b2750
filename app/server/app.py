"""The FastAPI application.

For now it serves the health endpoints over an open change DB; the replication
websockets arrive with the service core (see the README's status section).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from app.storage import ChangeDb


def create_app(db: ChangeDb) -> FastAPI:
    """The app over an already migrated change DB, which it disposes at shutdown."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await db.dispose()

    app = FastAPI(title="changestreamer", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.get("/", response_class=PlainTextResponse)
    async def health() -> str:
        return "OK"

    @app.get("/keepalive", response_class=PlainTextResponse)
    async def keepalive() -> str:
        return "OK"

    return app
