"""The ``changestreamer`` command.

``serve`` migrates the change DB and runs the HTTP server; ``migrate`` only
migrates. Bad settings and unusable databases end the command with one line on
stderr and exit code 2 (settings) or 1 (database).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

# First: every module below picks its C helper or twin as it is imported, so a bad
# CHANGESTREAMER_SPEEDUPS stops here with one line, like any bad setting.
try:
    from app import speedups
except ValueError as e:  # speedups.SpeedupsSettingError
    print(f"changestreamer: {e}", file=sys.stderr)
    raise SystemExit(2) from None

from app.backup.process import check_version
from app.backup.restore import restore_replica
from app.client import add_status_arguments, add_tail_arguments, run_status, run_tail
from app.config import Settings, SettingsError, check_change_db_directory, load_settings
from app.replica.command import add_replicate_arguments, run_replicate
from app.replica.errors import ReplicaError
from app.runtime.backups import (
    BackupConfigError,
    RestoreError,
    check_backup_settings,
    litestream_options,
    start_backups,
)
from app.runtime.custom import (
    PreparedCustom,
    check_custom_settings,
    custom_service,
    prepare_custom_upstream,
)
from app.runtime.gc_tuning import before_exit, tune_for_streaming
from app.runtime.memory import return_large_frees, trim_periodically
from app.runtime.options import streamer_options, task_id
from app.runtime.postgres import (
    PreparedUpstream,
    UpstreamSetupError,
    postgres_service,
    prepare_upstream,
)
from app.server.admin import AdminAuth, check_startup
from app.server.http_protocol import GuardedHttpProtocol
from app.server.log_lines import limit_lines
from app.server.ws_protocol import LivenessProtocol
from app.sources.demo import DemoChangeSource
from app.storage import (
    AutoResetSignal,
    ChangeDb,
    ChangeDbConfigError,
    ChangeDbOptions,
    ChangeDbSetupError,
    Replication,
    SubscriptionState,
    create_change_db,
    migrate,
    parse_change_db_url,
)
from app.streamer.service import ChangeStreamerService

log = logging.getLogger("changestreamer")

# The demo has no replica to sync: its change log starts at this version.
DEMO_REPLICA_VERSION = "01"
# serve rebuilds replica and service after an auto-reset, this many times in a row at most.
MAX_AUTO_RESETS = 3
_AUTO_RESET = -1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="changestreamer",
        description="A change-streamer, wire-compatible with Rocicorp Zero's.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="migrate the change DB and run the service")
    serve.add_argument("--port", type=int, help="listen port (default ZERO_CHANGE_STREAMER_PORT)")
    serve.add_argument("--host", help="listen address (default ZERO_CHANGE_STREAMER_HOST)")
    commands.add_parser("migrate", help="bring the change DB to this version's schema and exit")
    tail_cmd = commands.add_parser(
        "tail", help="print a change-streamer's transactions as they stream"
    )
    add_tail_arguments(tail_cmd)
    status_cmd = commands.add_parser("status", help="print a change-streamer's /statz")
    add_status_arguments(status_cmd)
    replicate_cmd = commands.add_parser(
        "replicate", help="keep a replica file current from a change-streamer"
    )
    add_replicate_arguments(replicate_cmd)
    restore_cmd = commands.add_parser(
        "restore", help="restore a replica file from its litestream backup and exit"
    )
    restore_cmd.add_argument(
        "--backup-url", help="the backup (file:// or s3://; default ZERO_LITESTREAM_BACKUP_URL)"
    )
    restore_cmd.add_argument(
        "--replica", type=Path, help="the replica file to write (default ZERO_REPLICA_FILE)"
    )
    restore_cmd.add_argument("--replica-version", help="refuse a backup of another replica version")
    restore_cmd.add_argument(
        "--force", action="store_true", help="replace the replica file if it exists"
    )
    args = parser.parse_args(argv)
    # Client commands need no settings or change DB (they may run on another host).
    if args.command == "tail":
        return run_tail(args)
    if args.command == "status":
        return run_status(args)
    if args.command == "replicate":
        return run_replicate(args)

    try:
        settings = load_settings()
        if args.command != "restore":  # restore needs no change DB
            check_change_db_directory(settings)
    except SettingsError as e:
        print(f"changestreamer: {e}", file=sys.stderr)
        return 2
    if args.command == "serve":
        refusal = check_startup(settings.admin_password, settings.development)
        refusal = refusal or check_custom_settings(settings)
        if refusal is not None:
            print(f"changestreamer: {refusal}", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Alembic narrates every step at INFO; the one line below says the outcome.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    for note in settings.startup_notes:
        log.info("%s", note)
    if args.command == "restore":
        return _restore(args, settings)
    if args.command == "serve":
        try:  # before the change DB is touched: a backup that cannot work stops here
            notes = asyncio.run(check_backup_settings(settings))
        except BackupConfigError as e:
            print(f"changestreamer: {e}", file=sys.stderr)
            return 2
        for note in notes:
            log.info("%s", note)
    try:
        db = open_change_db(settings)
        revision = asyncio.run(_migrate(db))
    except (ChangeDbConfigError, ChangeDbSetupError) as e:
        print(f"changestreamer: {e}", file=sys.stderr)
        return 1
    log.info("change DB %s is at schema revision %s", db.description, revision)
    if args.command == "migrate":
        return 0
    log.info("speedups: %s", speedups.summary())  # which C helpers run (app/speedups.py)
    return _serve(settings, db, host=args.host, port=args.port)


def _restore(args: argparse.Namespace, settings: Settings) -> int:
    """``changestreamer restore``: the backup into the replica file, atomically."""
    updates: dict[str, object] = {}
    if args.backup_url:
        updates["litestream_backup_url"] = args.backup_url
    replica = args.replica or settings.replica_file
    try:
        options = litestream_options(settings.model_copy(update=updates), replica)
        if replica.exists() and not args.force:
            print(f"changestreamer: {replica} exists; pass --force to replace it", file=sys.stderr)
            return 2
        if not replica.parent.is_dir():
            print(f"changestreamer: directory {replica.parent} does not exist", file=sys.stderr)
            return 2
        asyncio.run(check_version(options.executable))
        restored = asyncio.run(restore_replica(options, replica_version=args.replica_version))
    except (BackupConfigError, RestoreError) as e:
        print(f"changestreamer: {e}", file=sys.stderr)
        return 1
    if restored is None:
        print(f"changestreamer: no backup at {options.backup_url}", file=sys.stderr)
        return 1
    print(
        f"restored {replica}: replica version {restored.state.replica_version} at "
        f"{restored.state.state_version}, {restored.bytes} bytes in {restored.seconds:.1f} s"
    )
    return 0


def open_change_db(settings: Settings) -> ChangeDb:
    options = ChangeDbOptions(
        sqlite_writer=settings.sqlite_writer,
        # A Postgres change DB: at most ZERO_CHANGE_MAX_CONNS connections, as in zero.
        pg_pool_size=settings.change_max_conns,
        pg_max_overflow=0,
        pg_statement_timeout_ms=settings.change_statement_timeout_ms,
    )
    return create_change_db(parse_change_db_url(settings.change_db_url), settings.shard, options)


async def _migrate(db: ChangeDb) -> str:
    try:
        return await migrate(db)
    finally:
        # The engines' pools belong to this event loop; the server runs its own.
        await db.dispose()


def _serve(settings: Settings, db: ChangeDb, *, host: str | None, port: int | None) -> int:
    """Runs the server; after an auto-reset (a new replica is needed) builds it all again."""
    for attempt in range(MAX_AUTO_RESETS + 1):
        if attempt:
            log.warning("auto-reset: re-syncing the replica and restarting the service")
            db = open_change_db(settings)
        outcome = _serve_once(settings, db, host=host, port=port)
        if outcome != _AUTO_RESET:
            return outcome
    log.error("auto-reset %d times in a row; giving up", MAX_AUTO_RESETS)
    return 1


def _serve_once(settings: Settings, db: ChangeDb, *, host: str | None, port: int | None) -> int:
    import uvicorn

    from app.server.app import create_app

    listen_host = host or settings.change_streamer_host
    listen_port = port or settings.listen_port
    address = discovery_address(settings, listen_host, listen_port)
    prepared: PreparedUpstream | PreparedCustom | None = None
    if settings.upstream_db:
        try:
            prepared = asyncio.run(_prepare(settings, db))
        except (UpstreamSetupError, ReplicaError, RestoreError, BackupConfigError) as e:
            print(f"changestreamer: {e}", file=sys.stderr)
            return 1
        except AutoResetSignal as e:  # a custom source's initial sync asked for it
            if not settings.auto_reset:
                print(f"changestreamer: the change source requires a reset: {e}", file=sys.stderr)
                return 1
            log.warning("the change source requires a reset during the initial sync: %s", e)
            return _AUTO_RESET
    # After a restore (Postgres only): the previous owner keeps its log until we own it.
    held = prepared.held_reservation if isinstance(prepared, PreparedUpstream) else None
    server: uvicorn.Server | None = None
    built: list[ChangeStreamerService] = []
    releasers: set[asyncio.Task[None]] = set()

    def shut_down() -> None:
        if server is not None:
            server.should_exit = True

    async def build_service() -> ChangeStreamerService:
        if prepared is None:
            service = await demo_service(settings, db, address=address)
        else:
            runtime = (
                await custom_service(settings, db, prepared, address=address)
                if isinstance(prepared, PreparedCustom)
                else await postgres_service(settings, db, prepared, address=address)
            )
            if settings.follow_replica:
                runtime.start_backup(
                    settings.change_db_url,
                    settings.shard,
                    log_level="debug" if settings.log_level == "debug" else "warning",
                )
            service = runtime.service
        start_backups(service, settings, replica_file=settings.replica_file if prepared else None)
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

    # httptools, with bounds on requests still arriving (app/server/http_protocol.py);
    # /metrics shows what they did.
    http_protocol = GuardedHttpProtocol.with_limits(
        settings.max_pending_handshakes,
        settings.handshake_timeout_s,
        settings.max_handshakes_per_s,
    )
    app = create_app(
        db,
        service_factory=build_service,
        startup_delay_s=settings.startup_delay_ms / 1000,
        on_service_exit=shut_down,
        auth=AdminAuth(settings.admin_password, settings.operator_password, settings.development),
        keepalive_timeout_s=(settings.keepalive_timeout_ms or 0) / 1000 or None,
        on_keepalive_expired=shut_down,
        connection_limits=http_protocol.limits,
    )
    config = uvicorn.Config(
        app,
        host=listen_host,
        port=listen_port,
        ws_per_message_deflate=False,
        # uvicorn's sans-I/O websockets, with zero's liveness rule: a pong *or* any
        # inbound frame keeps a peer alive (app/server/ws_protocol.py).
        ws=LivenessProtocol.with_queue_limit(settings.subscriber_max_queued_bytes),
        http=http_protocol,
        # Pings at most every 30 s (zero's clients drop a silent socket after 33 s);
        # a generous pong timeout, since a busy replica may answer late.
        ws_ping_interval=20,
        ws_ping_timeout=60,
        log_level=settings.log_level,
        lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
    )
    limit_lines()  # after uvicorn configured its loggers (Config does)
    server = uvicorn.Server(config)
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
    if isinstance(failure, AutoResetSignal) and settings.auto_reset and prepared is not None:
        return _AUTO_RESET
    print(f"changestreamer: the change streamer stopped: {failure}", file=sys.stderr)
    return 1


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


if __name__ == "__main__":
    sys.exit(main())
