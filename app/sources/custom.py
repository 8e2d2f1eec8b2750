"""The custom change source: a websocket client of a source's ``/changes/v0/stream``.

Protocol (spec/source.md §4.1, §4.3): the configured URL is used as given, with its
query string kept and ``appID``, ``shardNum``, ``publications`` (once per publication),
``lastWatermark`` and ``replicaVersion`` added. Credentials in the URL become HTTP
Basic auth. Every inbound text frame is one JSON change-source message; every
outbound text frame is one upstream ack (``["status", ..., {"watermark": W}]``).

One connection is one :class:`CustomChangeStream`. Reconnecting (with backoff) is the
service's job: a stream that ends or fails is closed and a new one started from the
durable watermark. A stream also fails (and closes with 1008) when the source breaks
the watermark rules of spec/source.md §2.4 (:mod:`app.sources.custom_rules`): the
service then reconnects from what is stored, so nothing of the offending transaction
is kept and nothing before it is lost.

The initial sync (spec/source.md §4.2) opens the same stream without
``lastWatermark``/``replicaVersion`` (:meth:`CustomChangeSource.start_initial_sync`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK, WebSocketException
from websockets.frames import CloseCode

from app.protocol.canonical_json import dumps, loads
from app.protocol.messages import (
    ChangeSourceMessage,
    MessageValidationError,
    parse_change_source_message,
)
from app.sources.base import BackfillRequest, ChangeSource, ChangeSourceError, ChangeStream
from app.sources.coalescing import CoalescingSender
from app.sources.custom_rules import StreamRules
from app.sources.liveness import Liveness

__all__ = ["CustomChangeSource", "CustomChangeStream", "close_reason", "stream_url"]

log = logging.getLogger(__name__)

# A close frame's payload is at most 125 bytes, two of which hold the code.
MAX_CLOSE_REASON_BYTES: Final = 123
# zero's `ws` client accepts messages up to its default maxPayload (100 MiB); websockets'
# default of 1 MiB would reject large rows that zero accepts.
DEFAULT_MAX_MESSAGE_BYTES: Final = 100 * 2**20

_SCHEMES: Final = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}


def stream_url(
    url: str,
    *,
    app_id: str,
    shard_num: int,
    publications: Sequence[str],
    last_watermark: str | None,
    replica_version: str | None,
) -> str:
    """The URL a stream connects to: ``url`` with the protocol's query parameters added.

    ``appID``, ``shardNum``, ``lastWatermark`` and ``replicaVersion`` replace a parameter
    of the same name already in the URL; ``publications`` are appended, one per
    publication. The last two are left out when ``last_watermark`` is None (initial sync).
    ``http``/``https`` URLs are turned into ``ws``/``wss`` as zero's client does.
    """
    parts = urlsplit(url)
    scheme = _SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise ValueError(f"custom change source URL must be ws:// or wss://, got {parts.scheme!r}")
    if not parts.hostname:
        raise ValueError("custom change source URL has no host")
    if parts.fragment:
        raise ValueError("custom change source URL must not have a #fragment")
    params = parse_qsl(parts.query, keep_blank_values=True)
    _set_param(params, "appID", app_id)
    _set_param(params, "shardNum", str(shard_num))
    params.extend(("publications", pub) for pub in publications)
    if last_watermark is not None:
        if replica_version is None:
            raise ValueError("replica_version is required with last_watermark")
        _set_param(params, "lastWatermark", last_watermark)
        _set_param(params, "replicaVersion", replica_version)
    # Form encoding (space as "+"), as a JS URLSearchParams writes it.
    query = urlencode(params, safe="*")
    return urlunsplit((scheme, parts.netloc, parts.path, query, ""))


def _set_param(params: list[tuple[str, str]], key: str, value: str) -> None:
    # URLSearchParams.set: the first occurrence takes the value, later ones go.
    indexes = [i for i, (k, _) in enumerate(params) if k == key]
    if not indexes:
        params.append((key, value))
        return
    params[indexes[0]] = (key, value)
    for i in reversed(indexes[1:]):
        del params[i]


def _split_credentials(url: str) -> tuple[str, str | None]:
    """``url`` without its user info, and the ``Authorization`` value built from it.

    The credentials are sent exactly as written in the URL (percent-escapes are not
    decoded) and a missing password is an empty one: that is what zero's ``ws``
    client sends, so a source written against zero sees the same header.
    websockets' own handling decodes them and refuses a user without a password.
    """
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return url, None
    user, _, password = userinfo.partition(":")
    token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    bare = urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment))
    return bare, f"Basic {token}"


def _describe(url: str) -> str:
    """The URL without credentials and query (which may hold an API key), for messages."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def close_reason(text: str) -> str:
    """``text`` cut to fit a close frame (at most 123 UTF-8 bytes, whole characters)."""
    raw = text.encode()
    if len(raw) <= MAX_CLOSE_REASON_BYTES:
        return text
    cut = raw[: MAX_CLOSE_REASON_BYTES - 3].decode("utf-8", errors="ignore")
    return cut + "..."


def _preview(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


class CustomChangeSource(ChangeSource):
    """Opens one websocket per stream to a custom change source."""

    upstream_type = "custom"  # /statz upstream group

    def __init__(
        self,
        url: str,
        *,
        app_id: str,
        shard_num: int,
        publications: Sequence[str],
        replica_version: str | None,
        connect_timeout_s: float = 10.0,
        ping_interval_s: float = 30.0,
        close_timeout_s: float = 5.0,
        max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        if ping_interval_s <= 0:
            raise ValueError(f"ping_interval_s must be positive, got {ping_interval_s}")
        self._url = url
        self._app_id = app_id
        self._shard_num = shard_num
        self._publications = tuple(publications)
        self._replica_version = replica_version
        self._connect_timeout_s = connect_timeout_s
        self._ping_interval_s = ping_interval_s
        self._close_timeout_s = close_timeout_s
        self._max_message_bytes = max_message_bytes
        # Fail on a malformed URL now (configuration error), not on every reconnect.
        self.stream_url(None)
        self.description = _describe(url)

    def stream_url(self, after_watermark: str | None) -> str:
        """The URL (credentials included) a stream from ``after_watermark`` connects to;
        None: the initial sync's (no ``lastWatermark``/``replicaVersion``)."""
        return stream_url(
            self._url,
            app_id=self._app_id,
            shard_num=self._shard_num,
            publications=self._publications,
            last_watermark=after_watermark,
            replica_version=self._replica_version if after_watermark is not None else None,
        )

    async def start_stream(
        self, after_watermark: str, backfill_requests: list[BackfillRequest]
    ) -> CustomChangeStream:
        if backfill_requests:
            raise ChangeSourceError("custom change sources do not support backfill")
        if self._replica_version is None:
            raise ChangeSourceError("no replica version: the initial sync comes first")
        return await self._connect(after_watermark)

    async def start_initial_sync(self) -> CustomChangeStream:
        """The initial sync's stream: the source sends one transaction (spec/source.md §4.2)."""
        return await self._connect(None)

    async def _connect(self, after_watermark: str | None) -> CustomChangeStream:
        url, authorization = _split_credentials(self.stream_url(after_watermark))
        try:
            ws = await connect(
                url,
                additional_headers={"Authorization": authorization} if authorization else None,
                # zero's client ignores proxy settings; so does this one.
                proxy=None,
                open_timeout=self._connect_timeout_s,
                # Liveness is ours (CustomChangeStream), with zero's rule.
                ping_interval=None,
                ping_timeout=None,
                close_timeout=self._close_timeout_s,
                max_size=self._max_message_bytes,
            )
        except (OSError, TimeoutError, WebSocketException) as e:
            reason = str(e) or type(e).__name__
            raise ChangeSourceError(
                f"cannot connect to custom change source {self.description}: {reason}"
            ) from e
        log.info(
            "connected to custom change source %s %s",
            self.description,
            f"after {after_watermark}" if after_watermark is not None else "for the initial sync",
        )
        return CustomChangeStream(
            ws,
            ping_interval_s=self._ping_interval_s,
            description=self.description,
            after_watermark=after_watermark,
        )


class CustomChangeStream(ChangeStream):
    """One websocket connection: validated inbound messages and coalesced outbound acks.

    Owns two tasks, both cancelled when the stream ends or is closed: the ack writer
    and the keep-alive loop. ``after_watermark`` is the ``lastWatermark`` the stream
    was opened with (None for the initial sync); the watermark rules start from it.
    """

    def __init__(
        self,
        ws: ClientConnection,
        *,
        ping_interval_s: float,
        description: str = "upstream",
        after_watermark: str | None = None,
    ) -> None:
        self._ws = ws
        self._description = description
        self._rules = StreamRules(after_watermark)
        self._ping_interval_s = ping_interval_s
        self._liveness = Liveness()
        self._reader_waiting = False
        self._failure: ChangeSourceError | None = None
        self._closed = False  # close() was called
        self._finished = False  # iteration has ended (cleanly or not)
        self._acks = CoalescingSender(self._ws.send)
        self._tasks = [
            asyncio.create_task(self._write_acks(), name="custom-source-acks"),
            asyncio.create_task(self._keep_alive(), name="custom-source-keepalive"),
        ]

    @property
    def ack_sender(self) -> CoalescingSender:
        """The outbound ack queue (exposed for logs and tests)."""
        return self._acks

    def __aiter__(self) -> CustomChangeStream:
        return self

    async def __anext__(self) -> ChangeSourceMessage:
        if self._finished:
            raise StopAsyncIteration
        self._reader_waiting = True
        try:
            frame = await self._ws.recv()
        except ConnectionClosed as e:
            await self._finish()
            if self._failure is not None:
                raise self._failure from e
            if self._closed or isinstance(e, ConnectionClosedOK):
                raise StopAsyncIteration from None
            raise ChangeSourceError(
                f"custom change source {self._description} connection lost: {e}"
            ) from e
        finally:
            self._reader_waiting = False
        self._liveness.activity()
        if not isinstance(frame, str):
            raise await self._fail(
                CloseCode.UNSUPPORTED_DATA,
                f"a binary frame of {len(frame)} bytes; change-source messages are JSON "
                "text frames",
            )
        try:
            value = loads(frame)
        except ValueError as e:
            raise await self._fail(
                CloseCode.INVALID_DATA, f"invalid JSON ({e}) in frame {_preview(frame)}"
            ) from None
        try:
            message = parse_change_source_message(value)
        except MessageValidationError as e:
            raise await self._fail(
                CloseCode.INVALID_DATA, f"an invalid change-source message: {e}"
            ) from None
        # Before the service sees the message: the error ends this stream only, and
        # the service reconnects from what is stored (its own framing checks, e.g.
        # begin/commit mismatch, would stop it for good).
        problem = self._rules.check(message)
        if problem is not None:
            raise await self._fail(CloseCode.POLICY_VIOLATION, problem)
        return message

    def ack(self, status: list[Any]) -> None:
        if self._finished or self._closed:
            return  # acks may be lost; the next stream starts from the stored watermark
        self._acks.offer(dumps(status))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._stop_tasks()
        # Idempotent, and bounded by close_timeout when the peer does not answer.
        await self._ws.close()

    async def _fail(self, code: CloseCode, problem: str) -> ChangeSourceError:
        """Closes the connection because of bad input; returns the error to raise."""
        error = ChangeSourceError(f"custom change source {self._description} sent {problem}")
        self._failure = error
        await self._finish()
        await self._ws.close(code, close_reason(problem))
        return error

    async def _finish(self) -> None:
        self._finished = True
        await self._stop_tasks()

    async def _stop_tasks(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _write_acks(self) -> None:
        # The reader reports how the connection ended.
        with contextlib.suppress(ConnectionClosed):
            await self._acks.run()

    async def _keep_alive(self) -> None:
        interval = self._ping_interval_s
        while True:
            await asyncio.sleep(interval)
            if not self._liveness.tick(reader_waiting=self._reader_waiting):
                self._failure = ChangeSourceError(
                    f"custom change source {self._description} sent nothing, not even a pong, "
                    f"for {interval:g} s"
                )
                log.warning("%s", self._failure)
                # No close handshake with a silent peer: drop the TCP connection.
                self._ws.transport.abort()
                return
            try:
                async with asyncio.timeout(interval):
                    pong = await self._ws.ping()
            except TimeoutError:
                continue  # our writes are back-pressured; the next tick decides
            except ConnectionClosed:
                return
            asyncio.ensure_future(pong).add_done_callback(self._on_pong)

    def _on_pong(self, pong: asyncio.Future[float]) -> None:
        # A ping that fails with the connection is not a sign of life.
        if not pong.cancelled() and pong.exception() is None:
            self._liveness.activity()
