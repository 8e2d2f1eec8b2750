"""The replication websockets, protocol v1–v7 (spec/wire.md §2.3, §2.4, §3, §5).

``GET /replication/v{N}/changes`` subscribes to the change stream;
``GET /replication/v{N}/snapshot`` holds a snapshot reservation while a replica
restores from backup; ``GET /replication/v7/subscribe`` does both on one socket
(``app.server.subscribe_v7``). Request errors complete the upgrade and close with 1002
and ``Error: <message>`` (the reference's exact texts, so its clients log and
retry the same way); errors after streaming began are in-band ``error``
messages, sent by the streamer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Mapping

from fastapi import APIRouter, WebSocket
from starlette.responses import PlainTextResponse

from app.logs import bind_log_fields
from app.protocol.lexi import InvalidWatermarkError, parse_state_version
from app.server.replication_access import ReplicationAccess
from app.server.subscribe_v7 import Session
from app.server.transport import id_problem, reject, stream_downstream
from app.streamer.downstream import Downstream
from app.streamer.reservations import (
    BackupsNotConfiguredError,
    Reservation,
    TooManyReservations,
)
from app.streamer.service import (
    ChangeStreamerService,
    StreamerOptions,
    SubscriberContext,
    TooManySubscribers,
)
from app.versions import MAX_PROTOCOL_VERSION, MIN_PROTOCOL_VERSION

log = logging.getLogger(__name__)

# ASCII digits only: \d would also take "v٦" (an Arabic-Indic six) as v6. At most 9,
# so that int() of them cannot fail (it refuses more than 4300 digits).
_PATH = re.compile(r"/replication/v([0-9]{1,9})/(changes|snapshot|subscribe)$")


class RequestError(Exception):
    """An invalid replication request; the message goes to the client."""


def protocol_version(path: str) -> int:
    """The version in ``/replication/v<N>/(changes|snapshot)``, checked against ours."""
    match = _PATH.search(path)
    if match is None:
        raise RequestError(f"invalid path: {path}")
    version = int(match.group(1))
    if not MIN_PROTOCOL_VERSION <= version <= MAX_PROTOCOL_VERSION:
        raise RequestError(
            f"Cannot service client at protocol v{version}. "
            f"Supported protocols: [v{MIN_PROTOCOL_VERSION} ... v{MAX_PROTOCOL_VERSION}]"
        )
    return version


def _required(query: Mapping[str, str], name: str) -> str:
    value = query.get(name, "")
    if not value:
        raise RequestError(f"invalid querystring - missing {name}")
    return value


def _client_id(value: str, name: str) -> str:
    problem = id_problem(value, name)
    if problem is not None:
        raise RequestError(f"invalid querystring - {problem}")
    return value


def _watermark(query: Mapping[str, str], name: str) -> str:
    value = _required(query, name)
    try:
        parse_state_version(value)
    except InvalidWatermarkError as e:
        raise RequestError(f"invalid querystring - {name}: {e}") from None
    return value


def subscriber_context(path: str, query: Mapping[str, str]) -> SubscriberContext:
    """Parses a ``/changes`` request (empty parameters count as absent)."""
    version = protocol_version(path)
    return SubscriberContext(
        protocol_version=version,
        id=_client_id(_required(query, "id"), "id"),
        mode="backup" if query.get("mode") == "backup" else "serving",
        replica_version=_watermark(query, "replicaVersion"),
        watermark=_watermark(query, "watermark"),
        initial=query.get("initial") == "true",
        task_id=_client_id(query.get("taskID") or "", "taskID") or None,
    )


def request_path(websocket: WebSocket) -> str:
    """The request's path as the ASGI server parsed it from the request line.

    Not ``websocket.url.path``: Starlette builds that URL from the ``Host`` header,
    so a header such as ``Host: x/replication/v1/changes?`` could change the path
    (and the protocol version) that the route did not match on.
    """
    path = websocket.scope.get("path", "")
    return path if isinstance(path, str) else ""


async def _deny(websocket: WebSocket, status: int, reason: str, headers: dict[str, str]) -> None:
    """Answers the upgrade request with ``status`` (never accepting the socket)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        response = PlainTextResponse(f"{reason}\n", status_code=status, headers=headers)
        await websocket.send_denial_response(response)
    else:  # a server without the denial extension answers a close before accept with 403
        await websocket.close()


def router(
    get_service: Callable[[], ChangeStreamerService],
    closed_reason: Callable[[], str | None] = lambda: None,
) -> APIRouter:
    """The replication websockets, as plain Starlette routes: each endpoint parses
    its own path and query (``subscriber_context``), so FastAPI's dependency
    resolution would only cost each new stream time (~7 % of the event loop under
    connection churn, py-spy on ``bench.churn``).

    Every upgrade is first checked by :class:`ReplicationAccess` (Origin, the
    optional replication password), built from the service's options, then by the
    node's ``closed_reason`` (``NodeLifecycle.refusal``: retired, stopping).
    """
    routes = APIRouter()
    built: list[tuple[StreamerOptions, ReplicationAccess]] = []

    def access() -> ReplicationAccess:
        options = get_service().options
        if not built or built[0][0] is not options:
            checks = ReplicationAccess(
                options.allowed_origins,
                options.replication_password,
                backoff=built[0][1].backoff if built else None,
            )
            built[:] = [(options, checks)]
        return built[0][1]

    async def admitted(websocket: WebSocket) -> bool:
        refusal = await access().check(websocket.scope)
        if refusal is not None:
            await _deny(websocket, refusal.status, refusal.reason, refusal.headers)
            return False
        closed = closed_reason() or (
            "this change-streamer has stopped" if get_service().stopped.is_set() else None
        )
        if closed is not None:
            # Retired (another node owns the change log) or stopping: a refused
            # upgrade, so that clients try again, and in discover mode find the owner.
            await _deny(websocket, 503, closed, {})
            return False
        return True

    async def changes(websocket: WebSocket) -> None:
        if not await admitted(websocket):
            return
        try:
            ctx = subscriber_context(request_path(websocket), websocket.query_params)
        except RequestError as e:
            await reject(websocket, str(e))
            return
        # Once per connection: every line this task and its tasks log names the subscriber.
        bind_log_fields(ctx.log_fields())
        try:
            downstream = get_service().subscribe(ctx)
        except TooManySubscribers as e:
            await reject(websocket, str(e))
            return
        try:
            await websocket.accept()
        except BaseException:
            downstream.close("connection ended")  # the client left during the upgrade
            raise
        # Batch frames only for clients that can read them (v7 and asked for).
        batched = ctx.protocol_version >= 7 and websocket.query_params.get("wsBatched") == "true"
        await stream_downstream(websocket, downstream, name=ctx.id, batched=batched)

    async def subscribe(websocket: WebSocket) -> None:
        if not await admitted(websocket):
            return
        try:
            protocol = protocol_version(request_path(websocket))
            if protocol < 7:
                raise RequestError(
                    f"the /subscribe endpoint requires protocol v7 (client is at v{protocol})"
                )
            # Counted under the subscriber limit until it subscribes (the session
            # then trades this place for the subscriber's own).
            slot = get_service().admit_socket()
        except (RequestError, TooManySubscribers) as e:
            await reject(websocket, str(e))
            return
        try:
            await websocket.accept()
            # The session adds the task and subscriber as its messages name them.
            fields = bind_log_fields({"protocol": protocol})
            await Session(websocket, get_service, log_fields=fields, slot=slot).run()
        finally:
            slot.release()

    async def snapshot(websocket: WebSocket) -> None:
        if not await admitted(websocket):
            return
        try:
            protocol_version(request_path(websocket))
            task_id = _client_id(websocket.query_params.get("taskID") or "", "taskID")
            if not task_id:
                raise RequestError("Missing taskID in snapshot request")
            bind_log_fields({"task": task_id})
            slot = get_service().admit_socket()
            try:
                reservation = get_service().start_snapshot_reservation(task_id)
            except BackupsNotConfiguredError:
                slot.release()
                raise RequestError(
                    "replication-manager is not configured with a ZERO_LITESTREAM_BACKUP_URL"
                ) from None
            except TooManyReservations as e:
                slot.release()
                raise RequestError(str(e)) from None
        except (RequestError, TooManySubscribers) as e:
            await reject(websocket, str(e))
            return
        downstream = Downstream()
        relay: asyncio.Task[None] | None = None
        try:
            await websocket.accept()
            relay = asyncio.create_task(_relay(reservation, downstream))
            await stream_downstream(websocket, downstream, name=f"snapshot-{task_id}")
        finally:
            slot.release()
            reservation.cancel()  # a no-op once the task's subscription completed it
            if relay is not None:
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await relay

    per_address = AddressCounts()

    def counted(
        handler: Callable[[WebSocket], Awaitable[None]],
    ) -> Callable[[WebSocket], Awaitable[None]]:
        async def endpoint(websocket: WebSocket) -> None:
            address = websocket.client.host if websocket.client is not None else ""
            limit = get_service().options.max_sockets_per_address
            if not per_address.enter(address, limit):
                await _deny(websocket, 503, f"at most {limit} sockets from one address", {})
                return
            try:
                await handler(websocket)
            finally:
                per_address.exit(address)

        return endpoint

    for name, endpoint in (("changes", changes), ("subscribe", subscribe), ("snapshot", snapshot)):
        routes.add_websocket_route(f"/replication/{{version}}/{name}", counted(endpoint))
    return routes


class AddressCounts:
    """The replication sockets each client address holds (entries removed at 0)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._refused_logged: set[str] = set()

    def enter(self, address: str, limit: int) -> bool:
        held = self._counts.get(address, 0)
        if held >= limit:
            if address not in self._refused_logged and len(self._refused_logged) < _LOGGED:
                self._refused_logged.add(address)  # once per address (bounded)
                log.warning("refusing sockets from %s: it holds %d (the limit)", address, held)
            return False
        self._counts[address] = held + 1
        return True

    def exit(self, address: str) -> None:
        held = self._counts.get(address, 0) - 1
        if held > 0:
            self._counts[address] = held
        else:
            self._counts.pop(address, None)
            self._refused_logged.discard(address)


# Addresses whose refusal is logged (once each), at most.
_LOGGED = 1024


async def _relay(reservation: Reservation, downstream: Downstream) -> None:
    """Feeds the reservation's messages to the socket; ends the stream with it."""
    last: asyncio.Future[bool] | None = None
    try:
        async for message in reservation:
            last = downstream.push([message], track=True)
        if last is not None:
            await last  # consumed, or the connection closed first
    finally:
        downstream.close("reservation ended")
