"""Plain HTTP against an app on loopback, for the admin, health and metrics tests."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from email.message import Message
from typing import Any

import uvicorn
from fastapi import FastAPI

from tests.waiting import eventually

from .conftest import free_port

# No proxies: the tests talk to 127.0.0.1 only.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@asynccontextmanager
async def serve(app: FastAPI, **options: Any) -> AsyncIterator[str]:
    """Runs ``app`` under uvicorn on a free loopback port (``options``: more of
    uvicorn's ``Config``); yields its base URL."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started or task.done(), "uvicorn to start", 20)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)


@dataclass
class Reply:
    status: int
    headers: Message
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self) -> Any:
        return json.loads(self.body)


def _fetch(url: str, headers: dict[str, str], method: str = "GET") -> Reply:
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with _OPENER.open(request, timeout=90) as r:
            return Reply(r.status, r.headers, r.read())
    except urllib.error.HTTPError as e:
        with e:
            return Reply(e.code, e.headers, e.read())


async def http_get(url: str, headers: dict[str, str] | None = None) -> Reply:
    """GET in a worker thread (urllib blocks); error statuses are returned, not raised."""
    return await asyncio.to_thread(_fetch, url, headers or {})


async def http_head(url: str) -> Reply:
    """HEAD, as ``http_get``."""
    return await asyncio.to_thread(_fetch, url, {}, "HEAD")
