"""Bringing a change DB to this code's schema, or refusing with one clear line.

Everything runs in one transaction (SQLite and Postgres both have transactional
DDL), so a failed migration leaves the database as it was. On Postgres the
transaction first takes an advisory lock named after the schema, so nodes that
start together migrate one after the other.

Refusals (``ChangeDbSetupError``): the database cannot be reached, is not a
database (a corrupt or foreign file), belongs to something else (tables but no
migration history), or was migrated by a newer changestreamer (a revision this
code does not know).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, OperationalError

import migrations
from app.storage.engine import ChangeDb
from app.storage.errors import ChangeDbSetupError

VERSION_TABLE = "alembic_version"


def alembic_config(db: ChangeDb, connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.attributes["schema"] = db.schema
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision(db: ChangeDb) -> str:
    head = ScriptDirectory.from_config(alembic_config(db)).get_current_head()
    assert head is not None, "migrations/versions holds no revision"
    return head


async def migrate(db: ChangeDb) -> str:
    """Upgrades the change DB to the newest revision and returns it."""
    try:
        async with db.writer.begin() as conn:
            await conn.run_sync(_upgrade, db)
    except ChangeDbSetupError:
        raise
    except (DBAPIError, OSError) as e:
        raise setup_error(db, e) from e
    return head_revision(db)


async def current_revision(db: ChangeDb) -> str | None:
    """The revision the change DB is at, or None if it was never migrated."""
    try:
        async with db.reader.connect() as conn:
            return await conn.run_sync(_current_revision, db)
    except (DBAPIError, OSError) as e:
        raise setup_error(db, e) from e


def _current_revision(connection: Connection, db: ChangeDb) -> str | None:
    ctx = MigrationContext.configure(connection, opts={"version_table_schema": db.schema})
    return ctx.get_current_revision()


def _upgrade(connection: Connection, db: ChangeDb) -> None:
    prepare(connection, db)
    command.upgrade(alembic_config(db, connection), "head")


def prepare(connection: Connection, db: ChangeDb) -> None:
    """Locks, creates the schema, and checks the database is ours and not newer."""
    if db.dialect == "postgresql":
        assert db.schema is not None
        # Waiting for another node's migration, or rewriting a large change log, may
        # take longer than ZERO_CHANGE_STATEMENT_TIMEOUT_MS bounds a statement.
        connection.exec_driver_sql("SET LOCAL statement_timeout = 0")
        connection.execute(
            text("SELECT pg_advisory_xact_lock(hashtext(:key))"),
            {"key": f"migrate-schema:{db.schema}"},
        )
        connection.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{db.schema}"')
    tables = set(inspect(connection).get_table_names(schema=db.schema))
    where = db.description if db.schema is None else f'schema "{db.schema}" of {db.description}'
    if tables and VERSION_TABLE not in tables:
        shown = ", ".join(sorted(tables)[:6])
        raise ChangeDbSetupError(
            f"{where} is not a changestreamer change DB: it holds tables ({shown}) "
            "but no migration history; point ZERO_CHANGE_DB elsewhere"
        )
    current = _current_revision(connection, db)
    if current is None:
        return
    scripts = ScriptDirectory.from_config(alembic_config(db))
    try:
        scripts.get_revision(current)
    except CommandError:
        raise ChangeDbSetupError(
            f"{where} is at schema revision {current!r}, which this changestreamer does not "
            f"know (it knows up to {scripts.get_current_head()!r}); it was migrated by a "
            "newer version: upgrade changestreamer"
        ) from None


def setup_error(db: ChangeDb, error: BaseException) -> ChangeDbSetupError:
    """One line that says why the change DB cannot be used."""
    cause = error.orig if isinstance(error, DBAPIError) and error.orig is not None else error
    detail = " ".join(str(cause).split()) or type(cause).__name__
    if isinstance(cause, sqlite3.DatabaseError) and "not a database" in detail:
        return ChangeDbSetupError(
            f"{db.description} is not a SQLite database "
            f"(corrupt, or another kind of file): {detail}"
        )
    if db.dialect == "postgresql" and isinstance(error, OperationalError):
        return ChangeDbSetupError(f"cannot connect to the change DB {db.description}: {detail}")
    return ChangeDbSetupError(f"cannot use the change DB {db.description}: {detail}")
