"""Alembic environment for the change DB.

The service calls Alembic with an open connection (``config.attributes``:
``connection`` and ``schema``) inside its own transaction, so a migration either
applies whole or not at all. Run by hand (``alembic upgrade head``), this file
builds that connection itself from ``-x url=...`` or ``ZERO_CHANGE_DB`` and
``-x app_id=... -x shard_num=...`` (defaults ``zero`` and ``0``).
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy.engine import Connection

from app.storage.tables import metadata

config = context.config


def run_on(connection: Connection) -> None:
    schema = config.attributes.get("schema")
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table_schema=schema,
        include_schemas=schema is not None,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_by_hand() -> None:
    from app.storage.engine import Shard, create_change_db, parse_change_db_url
    from app.storage.migrate import prepare

    args = context.get_x_argument(as_dictionary=True)
    url = args.get("url") or os.environ.get("ZERO_CHANGE_DB")
    if not url:
        raise SystemExit("set ZERO_CHANGE_DB or pass -x url=... to choose the change DB")
    shard = Shard(args.get("app_id", "zero"), int(args.get("shard_num", "0")))
    db = create_change_db(parse_change_db_url(url), shard)
    config.attributes["schema"] = db.schema

    def run_sync(connection: Connection) -> None:
        prepare(connection, db)
        run_on(connection)

    async def run() -> None:
        try:
            async with db.writer.begin() as conn:
                await conn.run_sync(run_sync)
        finally:
            await db.dispose()

    asyncio.run(run())


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported for the change DB")

connection = config.attributes.get("connection")
if connection is None:
    run_by_hand()
else:
    run_on(connection)
