"""Liveness, readiness and the keepalive drain (spec/wire.md §2.1, §2.2, §4.3).

* ``GET /`` answers ``200 OK`` whenever the process answers at all: liveness.
* ``GET /ready`` asks the ``ready`` callable: ``200 {"ready": true}`` or ``503
  {"ready": false, "reason": ...}``, for Kubernetes readiness probes. It is not
  in 1.9.0 (where "listening" meant ready); no zero-cache client calls it.
* ``GET /keepalive`` answers ``200 OK``. With a keepalive timeout, the first
  request arms a :class:`KeepaliveMonitor` that checks every ``timeout/4``; once
  no heartbeat arrived for at least the timeout it calls ``on_keepalive_expired``
  once (the command line makes that a graceful drain, like the reference's
  SIGTERM to itself). An orchestrator that stops sending heartbeats is taking
  the task out of service.

The monitor's task is owned by the router: it is cancelled by ``stop()`` and by
the router's lifespan, which FastAPI merges into the app's on ``include_router``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class KeepaliveMonitor:
    """Calls ``on_expired`` once no heartbeat arrived for ``timeout_s`` seconds.

    Idle until the first ``heartbeat``; ``clock`` (monotonic seconds) and
    ``sleep`` are injectable so tests can drive time by hand.
    """

    def __init__(
        self,
        timeout_s: float,
        on_expired: Callable[[], None],
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"keepalive timeout must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._on_expired = on_expired
        self._clock = clock
        self._sleep = sleep
        self._last_heartbeat = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self.expired = False

    @property
    def armed(self) -> bool:
        return self._task is not None

    def heartbeat(self, headers: Mapping[str, str] | None = None) -> None:
        """Records a heartbeat; the first one starts the monitor."""
        self._last_heartbeat = self._clock()
        if self._task is not None or self._stopped:
            return
        log.info(
            "first keepalive received (timeout %.3fs); headers: %s",
            self.timeout_s,
            _loggable(headers or {}),
        )
        self._task = asyncio.get_running_loop().create_task(self._run(), name="keepalive-monitor")

    async def _run(self) -> None:
        interval = self.timeout_s / 4
        while True:
            await self._sleep(interval)
            silent_s = self._clock() - self._last_heartbeat
            if silent_s >= self.timeout_s:
                break
        self.expired = True
        log.warning("no keepalive for %.3fs (timeout %.3fs): draining", silent_s, self.timeout_s)
        try:
            self._on_expired()
        except Exception:
            log.exception("the keepalive expiry callback failed")

    async def stop(self) -> None:
        """Cancels the monitor (if armed); later heartbeats do not re-arm it."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _loggable(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: "<redacted>" if k.lower() in _SECRET_HEADERS else v for k, v in headers.items()}


_SECRET_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})


class HealthRouter(APIRouter):
    """The health routes, and the keepalive monitor they own (``None`` if disabled)."""

    def __init__(self, monitor: KeepaliveMonitor | None) -> None:
        @asynccontextmanager
        async def lifespan(_: Any) -> AsyncIterator[None]:
            try:
                yield
            finally:
                await self.stop()

        super().__init__(lifespan=lifespan)
        self.keepalive_monitor = monitor

    async def stop(self) -> None:
        if self.keepalive_monitor is not None:
            await self.keepalive_monitor.stop()


def health_router(
    *,
    ready: Callable[[], tuple[bool, str]],
    keepalive_timeout_s: float | None,
    on_keepalive_expired: Callable[[], None],
    clock: Clock = time.monotonic,
    sleep: Sleep = asyncio.sleep,
) -> HealthRouter:
    """``GET /``, ``GET /keepalive`` and ``GET /ready``.

    ``ready()`` returns ``(True, "")`` or ``(False, reason)``; if it raises, the
    service is reported not ready with the error as the reason.
    """
    monitor = (
        KeepaliveMonitor(keepalive_timeout_s, on_keepalive_expired, clock=clock, sleep=sleep)
        if keepalive_timeout_s is not None
        else None
    )
    router = HealthRouter(monitor)

    # HEAD too: load balancers probe with it (the server sends no body).
    @router.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    async def health() -> str:
        return "OK"

    @router.api_route("/keepalive", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    async def keepalive(request: Request) -> str:
        if monitor is not None:
            monitor.heartbeat(request.headers)
        return "OK"

    @router.api_route("/ready", methods=["GET", "HEAD"])
    async def readiness() -> JSONResponse:
        try:
            is_ready, reason = ready()
        except Exception as e:
            log.warning("the readiness check failed: %s", e)
            is_ready, reason = False, f"readiness check failed: {e}"
        if is_ready:
            return JSONResponse({"ready": True})
        return JSONResponse({"ready": False, "reason": reason}, status_code=503)

    return router
