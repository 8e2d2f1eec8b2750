"""The ``changestreamer`` command.

``serve`` migrates the change DB and runs the HTTP server; ``migrate`` only
migrates. Bad settings and unusable databases end the command with one line on
stderr and exit code 2 (settings) or 1 (database).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from app.config import Settings, SettingsError, load_settings
from app.storage import (
    ChangeDb,
    ChangeDbConfigError,
    ChangeDbSetupError,
    create_change_db,
    migrate,
    parse_change_db_url,
)

log = logging.getLogger("changestreamer")


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
    args = parser.parse_args(argv)

    try:
        settings = load_settings()
    except SettingsError as e:
        print(f"changestreamer: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Alembic narrates every step at INFO; the one line below says the outcome.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        db = open_change_db(settings)
        revision = asyncio.run(_migrate(db))
    except (ChangeDbConfigError, ChangeDbSetupError) as e:
        print(f"changestreamer: {e}", file=sys.stderr)
        return 1
    log.info("change DB %s is at schema revision %s", db.description, revision)
    if args.command == "migrate":
        return 0
    return _serve(settings, db, host=args.host, port=args.port)


def open_change_db(settings: Settings) -> ChangeDb:
    return create_change_db(parse_change_db_url(settings.change_db_url), settings.shard)


async def _migrate(db: ChangeDb) -> str:
    try:
        return await migrate(db)
    finally:
        # The engines' pools belong to this event loop; the server runs its own.
        await db.dispose()


def _serve(settings: Settings, db: ChangeDb, *, host: str | None, port: int | None) -> int:
    import uvicorn

    from app.server.app import create_app

    config = uvicorn.Config(
        create_app(db),
        host=host or settings.change_streamer_host,
        port=port or settings.listen_port,
        ws_per_message_deflate=False,
        log_level=settings.log_level,
        lifespan="on",
    )
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
