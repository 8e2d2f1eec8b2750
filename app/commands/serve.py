"""``changestreamer serve``: migrate the change DB, then run the service under uvicorn.

The change source is the demo's, Postgres (``ZERO_UPSTREAM_DB``) or a custom one
(``ZERO_UPSTREAM_TYPE=custom``); after an auto-reset (the source needs a new
replica) the replica and the service are built again, at most ``MAX_AUTO_RESETS``
times in a row.

Ctrl-C (SIGINT) or SIGTERM shuts down gracefully: streams end, requests still
running get ``CHANGESTREAMER_SHUTDOWN_TIMEOUT_SECONDS``, the storer drains. A
second Ctrl-C during that shutdown exits at once with one line (``_Server``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import uvicorn

from app import speedups
from app.backup.destinations import new_backup_path
from app.commands import CommandError
from app.commands.migrate import migrate_change_db, open_change_db
from app.commands.startup import read_settings, start_logging
from app.config import Settings
from app.logs import final_line
from app.replica.errors import ReplicaError
from app.runtime import retirement
from app.runtime.backups import (
    BackupConfigError,
    RestoreError,
    check_backup_settings,
    start_backups,
)
from app.runtime.custom import (
    PreparedCustom,
    check_custom_settings,
    custom_service,
    prepare_custom_upstream,
)
from app.runtime.gc_tuning import before_exit, tune_for_streaming
from app.runtime.lifecycle import NodeLifecycle
from app.runtime.memory import return_large_frees, trim_periodically
from app.runtime.options import streamer_options, task_id
from app.runtime.postgres import (
    PreparedUpstream,
    UpstreamSetupError,
    postgres_service,
    prepare_upstream,
)
from app.runtime.replica_lock import ReplicaLock, ReplicaLockedError
from app.server.admin_auth import AdminAuth, check_startup
from app.server.app import create_app
from app.server.http_protocol import GuardedHttpProtocol
from app.server.log_lines import limit_lines
from app.server.transport import MAX_CLIENT_FRAME_BYTES
from app.server.ws_protocol import LivenessProtocol
from app.sources.demo import DemoChangeSource
from app.stop_signals import AutoResetSignal
from app.storage import ChangeDb, OwnershipLostError, Replication, SubscriptionState
from app.streamer.service import ChangeStreamerService

__all__ = ["demo_service", "discovery_address", "run_serve"]

log = logging.getLogger("changestreamer")

# The demo has no replica to sync: its change log starts at this version.
DEMO_REPLICA_VERSION = "01"
# serve rebuilds replica and service after an auto-reset, this many times in a row at most.
MAX_AUTO_RESETS = 3
_AUTO_RESET = -1


def run_serve(args: argparse.Namespace) -> int:
    """Checks the settings and the backup, migrates the change DB, serves until stopped."""
    settings = read_settings(change_db=True)
    start_logging(settings)  # first: the refusals below are lines in the log's format
    refusal = check_startup(settings.admin_password, settings.development)
    refusal = refusal or check_custom_settings(settings)
    if refusal is not None:
        raise CommandError(refusal, 2)
    try:  # before the change DB is touched: a backup that cannot work stops here
        notes = asyncio.run(check_backup_settings(settings))
    except BackupConfigError as e:
        raise CommandError(str(e), 2) from None
    for note in notes:
        log.info("%s", note)
    # One serve per replica, and none beside a litestream a killed one left behind.
    lock = ReplicaLock(settings.replica_file) if settings.upstream_db else None
    if lock is not None:
        try:
            lock.acquire()
        except ReplicaLockedError as e:
            raise CommandError(str(e), 1) from None
        except OSError as e:
            raise CommandError(f"cannot lock the replica: {lock.path}: {e.strerror}", 1) from None
    try:
        db = migrate_change_db(settings)
        log.info("speedups: %s", speedups.summary())  # which C helpers run (app/speedups.py)
        return _serve(settings, db, lock, host=args.host, port=args.port)
    finally:
        if lock is not None:
            lock.release()


class _Server(uvicorn.Server):
    """uvicorn's server, where a second Ctrl-C ends the process at once, quietly.

    uvicorn answers a second SIGINT during the graceful shutdown with a forced exit
    that skips the application's shutdown and then dies in a KeyboardInterrupt,
    printing the traceback of everything it cancelled. Here the process exits on
    the spot instead: the change DB is crash-safe (a transaction not committed is
    not there), and the children notice (``app/supervise.py``: EOF on their stdin).
    ``handle_exit`` is uvicorn's signal handler (a public method; uvicorn is pinned
    in pyproject.toml).
    """

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT and self.should_exit:  # uvicorn's test for a force-quit
            sys.stdout.flush()
            final_line("interrupted again: exiting without finishing the shutdown")
            os._exit(128 + signal.SIGINT)
        super().handle_exit(sig, frame)


def _serve(
    settings: Settings,
    db: ChangeDb,
    lock: ReplicaLock | None,
    *,
    host: str | None,
    port: int | None,
) -> int:
    """Runs the server; after an auto-reset (a new replica is needed) builds it all again."""
    for attempt in range(MAX_AUTO_RESETS + 1):
        if attempt:
            log.warning("auto-reset: re-syncing the replica and restarting the service")
            db = open_change_db(settings)
        outcome = _serve_once(settings, db, lock, host=host, port=port)
        if outcome != _AUTO_RESET:
            return outcome
    log.error("auto-reset %d times in a row; giving up", MAX_AUTO_RESETS)
    return 1


def _serve_once(
    settings: Settings,
    db: ChangeDb,
    lock: ReplicaLock | None,
    *,
    host: str | None,
    port: int | None,
) -> int:
    listen_host = host or settings.change_streamer_host
    listen_port = port or settings.listen_port
    address = discovery_address(settings, listen_host, listen_port)
    retired = asyncio.run(retirement.still_retired(settings, db))
    if retired is not None:
        return _serve_retired(settings, db, retired, host=listen_host, port=listen_port)
    server: _Server | None = None

    def shut_down() -> None:
        if server is not None:
            server.should_exit = True

    # restoring: the replica is restored or synced before the server listens.
    lifecycle = NodeLifecycle(
        startup_delay_s=settings.startup_delay_ms / 1000,
        on_exit=shut_down,
        on_retired=lambda lost: retirement.write(settings.replica_file, lost.owner),
    )
    prepared: PreparedUpstream | PreparedCustom | None = None
    if settings.upstream_db:
        try:
            prepared = asyncio.run(_prepare(settings, db))
        except (UpstreamSetupError, ReplicaError, RestoreError, BackupConfigError) as e:
            final_line(str(e))
            return 1
        except AutoResetSignal as e:  # a custom source's initial sync asked for it
            if not settings.auto_reset:
                final_line(f"the change source requires a reset: {e}")
                return 1
            log.warning("the change source requires a reset during the initial sync: %s", e)
            return _AUTO_RESET
    # After a restore (Postgres only): the previous owner keeps its log until we own it.
    held = prepared.held_reservation if isinstance(prepared, PreparedUpstream) else None
    # Backups go to a destination of this run's own (app/backup/destinations.py).
    backup_path = (
        new_backup_path(settings.task_id)
        if settings.litestream_backup_url and prepared is not None
        else None
    )
    lock_fd = lock.fd if lock is not None else None
    built: list[ChangeStreamerService] = []
    releasers: set[asyncio.Task[None]] = set()

    async def build_service() -> ChangeStreamerService:
        if prepared is None:
            service = await demo_service(settings, db, address=address)
            lifecycle.attach(service)
        else:
            runtime = (
                await custom_service(
                    settings, db, prepared, address=address, backup_path=backup_path
                )
                if isinstance(prepared, PreparedCustom)
                else await postgres_service(
                    settings, db, prepared, address=address, backup_path=backup_path
                )
            )
            service = runtime.service
            lifecycle.attach(service, children=(runtime.wait_closed,))
            if settings.follow_replica:
                follower = runtime.start_backup(
                    settings.change_db_url,
                    settings.shard,
                    log_level="debug" if settings.log_level == "debug" else "warning",
                    lock_fd=lock_fd,
                    litestream=bool(settings.litestream_backup_url),
                )
                lifecycle.add_check(follower.problem)
        start_backups(
            service,
            settings,
            replica_file=settings.replica_file if prepared else None,
            backup_path=backup_path,
            lock_fd=lock_fd,
        )
        if held is not None:

            async def release_once_owner() -> None:
                await service.owning.wait()
                await asyncio.to_thread(held.release)

            releasers.add(asyncio.create_task(release_once_owner(), name="release reservation"))
        # Free heap pages back to the OS now and then (app/runtime/memory.py); the
        # loop cancels it at exit.
        releasers.add(asyncio.create_task(trim_periodically(), name="malloc trim"))
        built.append(service)
        return service

    http_protocol = _http_protocol(settings)
    app = create_app(
        db,
        service_factory=build_service,
        lifecycle=lifecycle,
        auth=_admin_auth(settings, listen_host),
        keepalive_timeout_s=(settings.keepalive_timeout_ms or 0) / 1000 or None,
        on_keepalive_expired=shut_down,
        connection_limits=http_protocol.limits,
    )
    server = _Server(_uvicorn_config(settings, app, http_protocol, listen_host, listen_port))
    tune_for_streaming()
    return_large_frees()
    try:
        server.run()
    finally:
        if held is not None:
            held.release()
        before_exit()
    failure = built[0].failure if built else None
    if failure is None:
        return 0
    if isinstance(failure, OwnershipLostError):
        final_line(f"retired (the change log is owned by {failure.owner}): stopped as asked")
        return 0
    if isinstance(failure, AutoResetSignal) and settings.auto_reset and prepared is not None:
        return _AUTO_RESET
    final_line(f"the change streamer stopped: {failure}")
    return 1


def _serve_retired(
    settings: Settings, db: ChangeDb, lifecycle: NodeLifecycle, *, host: str, port: int
) -> int:
    """The server without a service: probes answer (``/ready`` 503, retired) until the
    process is stopped."""
    log.warning(
        "retired: the change log is owned by %s (%s), which took it over from this node; "
        "this node serves nothing and waits to be stopped",
        lifecycle.owner,
        lifecycle.owner_address,
    )
    http_protocol = _http_protocol(settings)
    app = create_app(
        db,
        auth=_admin_auth(settings, host),
        connection_limits=http_protocol.limits,
        lifecycle=lifecycle,
    )
    _Server(_uvicorn_config(settings, app, http_protocol, host, port)).run()
    return 0


def _http_protocol(settings: Settings) -> type[GuardedHttpProtocol]:
    """httptools, with bounds on requests still arriving (app/server/http_protocol.py);
    /metrics shows what they did."""
    return GuardedHttpProtocol.with_limits(
        settings.max_pending_handshakes,
        settings.handshake_timeout_s,
        settings.max_handshakes_per_s,
    )


def _admin_auth(settings: Settings, host: str) -> AdminAuth:
    """The admin pages' passwords; open without one, they answer only the loopback
    names, this node's own (``host`` it listens on, the address it advertises) and
    ``CHANGESTREAMER_ALLOWED_HOSTS``."""
    advertised = discovery_address(settings, host, 0)
    if "://" not in advertised:
        advertised = f"//{advertised}"
    own = [host, urlsplit(advertised).hostname or ""]
    return AdminAuth(
        settings.admin_password,
        settings.operator_password,
        settings.development,
        allowed_hosts=[h for h in (*own, *settings.allowed_hosts) if h and h not in _WILDCARDS],
    )


_WILDCARDS = ("0.0.0.0", "::")


def _uvicorn_config(
    settings: Settings,
    app: Any,
    http_protocol: type[GuardedHttpProtocol],
    host: str,
    port: int,
) -> uvicorn.Config:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        ws_per_message_deflate=False,
        ws_max_size=MAX_CLIENT_FRAME_BYTES,  # what a client may send in one frame
        # uvicorn's sans-I/O websockets, with zero's liveness rule: a pong *or* any
        # inbound frame keeps a peer alive (app/server/ws_protocol.py).
        ws=LivenessProtocol.with_queue_limit(settings.subscriber_max_queued_bytes),
        http=http_protocol,
        # Pings at most every 30 s (zero's clients drop a silent socket after 33 s);
        # a generous pong timeout, since a busy replica may answer late.
        ws_ping_interval=20,
        ws_ping_timeout=60,
        # X-Forwarded-* only from the proxies named (none by default): the admin
        # back-off keys on the client's address, which a header must not choose.
        **proxy_header_options(settings.trusted_proxies),
        log_level=settings.log_level,
        log_config=None,  # no handlers of uvicorn's: its lines go through ours (app/logs.py)
        lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
    )
    limit_lines()  # after uvicorn configured its loggers (Config does)
    return config


def proxy_header_options(trusted_proxies: list[str]) -> dict[str, Any]:
    """uvicorn's proxy options: its headers believed only from ``trusted_proxies``."""
    if not trusted_proxies:
        return {"proxy_headers": False}
    return {"proxy_headers": True, "forwarded_allow_ips": ",".join(trusted_proxies)}


async def _prepare(settings: Settings, db: ChangeDb) -> PreparedUpstream | PreparedCustom:
    try:
        if settings.upstream_type == "custom":
            return await prepare_custom_upstream(settings, db)
        return await prepare_upstream(settings, db)
    finally:
        await db.dispose()  # the server runs its own event loop and pools


def discovery_address(settings: Settings, host: str, port: int) -> str:
    """The address written to ``replicationState.ownerAddress`` for view-syncers.

    ``ZERO_CHANGE_STREAMER_ADDRESS`` if set; else the listen address, with a
    wildcard listen address replaced by this host's IP (a wildcard is not a place
    to connect to). With ``ZERO_CHANGE_STREAMER_PROTOCOL=wss`` it is prefixed with
    ``wss://`` as zero does (``ws`` stays bare, for view-syncers that expect no
    scheme), unless the address already names a scheme.
    """
    address = settings.change_streamer_address
    if not address:
        if host in ("0.0.0.0", "::", ""):
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        address = f"{host}:{port}"
    if settings.change_streamer_protocol == "wss" and "://" not in address:
        return f"wss://{address}"
    return address


async def demo_service(settings: Settings, db: ChangeDb, *, address: str) -> ChangeStreamerService:
    """The service over the demo source, with the change log tied to its replica version."""

    replication = Replication(db)
    existing = await replication.config()
    replica_version = existing.replica_version if existing is not None else DEMO_REPLICA_VERSION
    state = await replication.state()
    watermark = state.last_watermark if state is not None else replica_version
    await replication.ensure_config(
        SubscriptionState(replica_version, tuple(settings.app_publications), watermark),
        auto_reset=settings.auto_reset,
    )
    state = await replication.state()
    assert state is not None
    return ChangeStreamerService(
        db=db,
        source=DemoChangeSource(settings.demo_state_file, rate_per_s=settings.demo_rate_per_s),
        task_id=task_id(settings),
        address=address,
        replica_version=replica_version,
        durable_watermark=state.last_watermark,
        options=streamer_options(settings),
    )
