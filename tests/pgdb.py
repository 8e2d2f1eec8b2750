"""Scratch Postgres databases for tests: created fresh, dropped with their slots after.

    async with scratch_database(pg_url, "cs_thing") as url:
        ...

Replication slots are cluster-wide and keep a database from being dropped, so the
teardown first ends and drops every slot of that database (whatever its name).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import psycopg
from psycopg.conninfo import make_conninfo

from tests.waiting import eventually

__all__ = ["drop_database", "scratch_database"]

DROP_TIMEOUT_S = 5.0
DROP_RETRY_S = 0.1


async def drop_database(pg_url: str, name: str) -> None:
    admin = make_conninfo(pg_url, dbname="postgres")
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as c:

        async def slots_gone() -> bool:
            cur = await c.execute(
                "SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = %s",
                (name,),
            )
            slots = await cur.fetchall()
            for slot, pid in slots:
                if pid is not None:
                    await c.execute("SELECT pg_terminate_backend(%s)", (pid,))
                with contextlib.suppress(
                    psycopg.errors.ObjectInUse, psycopg.errors.UndefinedObject
                ):
                    await c.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            return not slots

        await eventually(
            slots_gone,
            f"the replication slots of database {name} to be dropped",
            DROP_TIMEOUT_S,
            poll_s=DROP_RETRY_S,
        )
        await c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())


@contextlib.asynccontextmanager
async def scratch_database(pg_url: str, name: str) -> AsyncIterator[str]:
    """A new, empty database ``name`` (dropped first if a crashed run left it)."""
    await drop_database(pg_url, name)
    admin = make_conninfo(pg_url, dbname="postgres")
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as c:
        await c.execute(f'CREATE DATABASE "{name}"'.encode())
    try:
        yield make_conninfo(pg_url, dbname=name)
    finally:
        await drop_database(pg_url, name)
