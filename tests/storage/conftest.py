"""Change DB fixtures: every storage test runs on SQLite and on real Postgres.

SQLite runs twice: with group commits in the writer process (the default) and in
aiosqlite's thread (``ChangeDbOptions(sqlite_writer="thread")``)."""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest
from sqlalchemy import text

from app.storage import (
    ChangeDb,
    ChangeDbOptions,
    Shard,
    create_change_db,
    migrate,
    parse_change_db_url,
)

_shards = itertools.count()


def unique_shard() -> Shard:
    """A shard (so a Postgres schema) no other test or run uses."""
    return Shard(f"t{os.getpid()}", next(_shards))


async def drop_schema(db: ChangeDb) -> None:
    if db.dialect == "postgresql":
        async with db.writer.begin() as conn:
            await conn.execute(text(f'DROP SCHEMA IF EXISTS "{db.shard.cdc_schema}" CASCADE'))


def make_db(backend: str, tmp_path: Path, pg_url: str) -> ChangeDb:
    shard = unique_shard()
    if backend == "postgres":
        return create_change_db(parse_change_db_url(pg_url), shard)
    url = str(tmp_path / f"{shard.name}-cdc.db")
    writer: Literal["process", "thread"] = "thread" if backend == "sqlite-thread" else "process"
    return create_change_db(parse_change_db_url(url), shard, ChangeDbOptions(sqlite_writer=writer))


@pytest.fixture(params=["sqlite", "sqlite-thread", "postgres"])
async def empty_db(
    request: pytest.FixtureRequest, tmp_path: Path, pg_url: str
) -> AsyncIterator[ChangeDb]:
    """A change DB that has not been migrated yet."""
    db = make_db(request.param, tmp_path, pg_url)
    try:
        yield db
    finally:
        await drop_schema(db)
        await db.dispose()


@pytest.fixture
async def db(empty_db: ChangeDb) -> ChangeDb:
    """A migrated change DB."""
    await migrate(empty_db)
    return empty_db


async def _migrated(backend: str, tmp_path: Path, pg_url: str) -> AsyncIterator[ChangeDb]:
    db = make_db(backend, tmp_path, pg_url)
    try:
        await migrate(db)
        yield db
    finally:
        await drop_schema(db)
        await db.dispose()


@pytest.fixture
async def sqlite_db(tmp_path: Path, pg_url: str) -> AsyncIterator[ChangeDb]:
    """A migrated SQLite change DB, for SQLite-only behaviour."""
    async for db in _migrated("sqlite", tmp_path, pg_url):
        yield db


@pytest.fixture
async def pg_db(tmp_path: Path, pg_url: str) -> AsyncIterator[ChangeDb]:
    """A migrated Postgres change DB, for Postgres-only behaviour."""
    async for db in _migrated("postgres", tmp_path, pg_url):
        yield db
