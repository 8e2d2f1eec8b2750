"""``changestreamer migrate``, and the change DB as ``serve`` opens it: from the
settings, brought to this version's schema before anything else touches it."""

from __future__ import annotations

import argparse
import asyncio
import logging

from app.commands import CommandError
from app.commands.startup import read_settings, start_logging
from app.config import Settings
from app.storage import (
    ChangeDb,
    ChangeDbConfigError,
    ChangeDbOptions,
    ChangeDbSetupError,
    create_change_db,
    migrate,
    parse_change_db_url,
)

__all__ = ["migrate_change_db", "open_change_db", "run_migrate"]

log = logging.getLogger("changestreamer")


def run_migrate(args: argparse.Namespace) -> int:
    """Migrates the change DB and exits."""
    settings = read_settings(change_db=True)
    start_logging(settings)
    migrate_change_db(settings)
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


def migrate_change_db(settings: Settings) -> ChangeDb:
    """The change DB, migrated; one line and exit status 1 when it cannot be used."""
    try:
        db = open_change_db(settings)
        revision = asyncio.run(_migrate(db))
    except (ChangeDbConfigError, ChangeDbSetupError) as e:
        raise CommandError(str(e), 1) from None
    log.info("change DB %s is at schema revision %s", db.description, revision)
    return db


async def _migrate(db: ChangeDb) -> str:
    try:
        return await migrate(db)
    finally:
        # The engines' pools belong to this event loop; the server runs its own.
        await db.dispose()
