"""The dashboard's live feed: one snapshot per interval, shared by a few SSE streams.

While at least one ``/dashboard/events`` stream is open, one task (the feed's)
computes a snapshot every ``interval_s`` and keeps only the newest. Each stream
sends the newest snapshot it has not sent yet, so a client that reads slowly skips
snapshots instead of queueing them: nothing here grows with time or with a stalled
reader (what waits for its socket is bounded by the transport's buffer). At most
``max_streams`` are open at once (one more is refused); the task stops with the
last stream, and every stream ends once ``draining`` is set (the server shuts
down), its client goes (Starlette cancels the response), or it has run for
``max_lifetime_s``: the browser's EventSource reconnects by itself ``RETRY_MS``
later, through the password check again, and a client that keeps the slots
cannot hold them for longer than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from app.protocol.canonical_json import dumps
from app.timeouts import within

__all__ = ["SnapshotFeed"]

log = logging.getLogger(__name__)

# The browser's EventSource reconnects this long after a stream ended.
RETRY_MS = 2000
# A stream ends after this long (the page reconnects): long enough that a watcher
# sees a reconnect rarely, short enough that a held slot comes back.
MAX_LIFETIME_S = 300.0


class SnapshotFeed:
    """Computes snapshots (``compute``: a JSON-able dict) while streams are open."""

    def __init__(
        self,
        compute: Callable[[], Awaitable[dict[str, Any]]],
        *,
        interval_s: float = 1.0,
        max_streams: int = 4,
        timeout_s: float = 5.0,
        draining: asyncio.Event | None = None,
        max_lifetime_s: float = MAX_LIFETIME_S,
    ) -> None:
        self._max_lifetime_s = max_lifetime_s
        self._compute = compute
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._draining = draining or asyncio.Event()
        self.max_streams = max_streams
        self.streams = 0
        self._version = 0
        self._latest = b""
        self._fresh = False  # ``_latest`` was computed by the running task
        self._changed: asyncio.Event | None = None  # replaced at every new snapshot
        self._task: asyncio.Task[None] | None = None

    @property
    def computing(self) -> bool:
        """Whether the task that computes snapshots runs (only while streams are open)."""
        return self._task is not None and not self._task.done()

    def response(self) -> _StreamResponse:
        """A ``text/event-stream`` response that holds a stream slot while it runs
        (503 when none is free)."""
        return _StreamResponse(self)

    def _acquire(self) -> bool:
        if self.streams >= self.max_streams:
            return False
        self.streams += 1
        if self._task is None:
            self._fresh = False
            self._task = asyncio.create_task(self._produce(), name="dashboard feed")
        return True

    async def aclose(self) -> None:
        """Stops the task (at shutdown; streams still open end with it)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _release(self) -> None:
        self.streams -= 1
        if self.streams == 0 and self._task is not None:
            # Nobody watches: stop computing. The feed owns the task; it ends at
            # its next await.
            self._task.cancel()
            self._task = None

    async def _produce(self) -> None:
        while not self._draining.is_set():
            try:
                body = dumps(await within(self._compute(), self._timeout_s)).encode()
            except Exception as e:
                log.warning("dashboard: computing a snapshot failed: %r", e)
                body = dumps({"error": f"computing the snapshot failed: {e!r}"}).encode()
            self._publish(body)
            with contextlib.suppress(TimeoutError):
                await within(self._draining.wait(), self._interval_s)
        self._publish(b"")  # wakes the streams, which end

    def _publish(self, body: bytes) -> None:
        self._version += 1
        self._latest = body
        self._fresh = True
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    async def _events(self) -> AsyncGenerator[bytes, None]:
        if self._draining.is_set():
            return
        yield f"retry: {RETRY_MS}\n\n".encode()
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + self._max_lifetime_s
        # The newest snapshot at once, unless it is older than this run of the task.
        sent = self._version - 1 if self._fresh else self._version
        while loop.time() < ends_at:
            while self._version <= sent:
                if self._changed is None:
                    self._changed = asyncio.Event()
                left_s = ends_at - loop.time()
                if left_s <= 0:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left_s)
            sent = self._version
            if self._draining.is_set():
                return
            yield b"data: " + self._latest + b"\n\n"


class _StreamResponse(StreamingResponse):
    """The feed's events; takes its slot when it starts and gives it back however
    it ends."""

    def __init__(self, feed: SnapshotFeed) -> None:
        self._events = feed._events()
        super().__init__(
            self._events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )
        self._feed = feed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._feed._acquire():
            await self._events.aclose()
            busy = PlainTextResponse(
                f"at most {self._feed.max_streams} dashboard streams at once; retry later",
                status_code=503,
                headers={"Retry-After": str(RETRY_MS // 1000)},
            )
            await busy(scope, receive, send)
            return
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._feed._release()
