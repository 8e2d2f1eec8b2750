"""A whole Postgres upstream in-process: scratch database → initial sync → service → replica.

``upstream`` (function scope) is a factory: ``env = await upstream(setup_sql)`` creates
the scratch database ``hpe_<module>``, runs ``setup_sql`` there, then does what
``serve`` does with ``ZERO_UPSTREAM_DB`` (``prepare_upstream`` — shard setup and
initial sync into a ``tmp_path`` replica — then ``postgres_service`` over a SQLite
change DB), starts the service and the replica follower, and subscribes one serving
subscriber at the replica version. The app ID is ``hpe`` so the slot
(``hpe_0_<suffix>``) and the publications are this directory's own.

:class:`Upstream` is what a test drives: ``execute`` on the upstream,
``next_transaction`` from the subscriber, ``replica_rows`` once the replica follower
(a child process) has applied a given commit. Teardown stops the service, waits for
the follower, and drops the database together with its slots (``tests/pgdb.py``).

Every wait is bounded by :data:`WAIT_S`; nothing here asserts on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from app.commands.migrate import open_change_db
from app.config import Settings, load_settings
from app.protocol.canonical_json import loads
from app.protocol.pieces import join_text
from app.runtime.postgres import PostgresRuntime, postgres_service, prepare_upstream
from app.storage import ChangeDb, Replication, migrate
from app.streamer.downstream import Downstream
from app.streamer.service import SubscriberContext
from tests.pgdb import scratch_database
from tests.waiting import eventually

APP_ID = "hpe"
WAIT_S = 15.0
SETUP_S = 60.0
POLL_S = 0.02

Message = list[Any]


class StreamTimeout(AssertionError):
    """The subscriber or the replica did not get there within WAIT_S."""


@dataclass
class Upstream:
    url: str
    settings: Settings
    db: ChangeDb
    runtime: PostgresRuntime
    subscriber: Downstream
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def replica_file(self) -> Path:
        return self.settings.replica_file

    @property
    def replica_version(self) -> str:
        return self.runtime.replica.replica_version

    async def execute(self, *statements: str | tuple[str, Sequence[Any]]) -> None:
        """Runs the statements in ONE upstream transaction and commits it."""
        async with await psycopg.AsyncConnection.connect(self.url) as conn:
            for s in statements:
                if isinstance(s, tuple):
                    await conn.execute(s[0].encode(), s[1])
                else:
                    await conn.execute(s.encode())
            await conn.commit()

    async def query(self, sql: str) -> list[tuple[Any, ...]]:
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            cur = await conn.execute(sql.encode())
            return await cur.fetchall()

    async def next_message(self) -> Message:
        """The next non-status message the serving subscriber receives (acked)."""
        while True:
            try:
                text = await asyncio.wait_for(self.subscriber.get(), WAIT_S)
            except TimeoutError:
                raise StreamTimeout(f"no message within {WAIT_S}s") from None
            self.subscriber.ack_next()
            message = loads(join_text(text))  # a large value's message comes as Pieces
            assert isinstance(message, list), text
            if message[0] != "status":
                return message

    async def next_transaction(self) -> list[Message]:
        """begin, data…, commit (or rollback) of the next transaction, parsed."""
        first = await self.next_message()
        assert first[0] == "begin", f"expected a begin, got {first}"
        out = [first]
        while out[-1][0] not in ("commit", "rollback"):
            message = await self.next_message()
            assert message[0] in ("data", "commit", "rollback"), message
            out.append(message)
        return out

    def nothing_pending(self) -> bool:
        """No further non-status message already queued for the subscriber."""
        while (text := self.subscriber.get_nowait()) is not None:
            self.subscriber.ack_next()
            if loads(join_text(text))[0] != "status":
                return False
        return True

    async def wait_replica(self, watermark: str, *, within_s: float = WAIT_S) -> None:
        """Until the replica follower has applied the commit at ``watermark``."""
        try:
            await eventually(
                lambda: self.replica_watermark() >= watermark,
                lambda: f"the replica at {self.replica_watermark()} to reach {watermark}",
                within_s,
                poll_s=POLL_S,
            )
        except AssertionError as e:
            raise StreamTimeout(str(e)) from None

    def replica_watermark(self) -> str:
        rows = self.replica_query('SELECT "stateVersion" FROM "_zero.replicationState"')
        return str(rows[0][0])

    def replica_query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(f"file:{self.replica_file}?mode=ro", uri=True)
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()

    async def replica_rows(
        self, table: str, *, at: str | None = None, order_by: str = "rowid"
    ) -> list[dict[str, Any]]:
        """The replica's rows of ``table`` (without ``_0_version``), after commit ``at``."""
        if at is not None:
            await self.wait_replica(at)
        conn = sqlite3.connect(f"file:{self.replica_file}?mode=ro", uri=True)
        try:
            cur = conn.execute(f'SELECT * FROM "{table}" ORDER BY {order_by}')
            rows = cur.fetchall()
        finally:
            conn.close()
        names = [d[0] for d in cur.description]
        return [{k: v for k, v in zip(names, r, strict=True) if k != "_0_version"} for r in rows]

    async def stop(self) -> None:
        await asyncio.wait_for(self.runtime.service.stop(), WAIT_S)
        await asyncio.wait_for(self.runtime.wait_closed(), WAIT_S)
        for task in self._tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, WAIT_S)
        await self.db.dispose()


def commit_watermark(tx: list[Message]) -> str:
    """The watermark of a transaction read by ``next_transaction``."""
    watermark = tx[0][2]["commitWatermark"]
    assert isinstance(watermark, str)
    return watermark


def data(tx: list[Message]) -> list[dict[str, Any]]:
    """The data payloads of a transaction, in order."""
    return [m[1] for m in tx if m[0] == "data"]


@contextlib.asynccontextmanager
async def running_upstream(
    pg_url: str,
    name: str,
    work_dir: Path,
    setup_sql: Sequence[str] = (),
    **settings: Any,
) -> AsyncIterator[Upstream]:
    """The whole pipeline over a scratch database ``name`` (see the module docstring)."""
    async with scratch_database(pg_url, name) as url:
        if setup_sql:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                for s in setup_sql:
                    await conn.execute(s.encode())
        config = load_settings(
            ZERO_UPSTREAM_DB=url,
            ZERO_APP_ID=APP_ID,
            ZERO_REPLICA_FILE=work_dir / "replica.db",
            **settings,
        )
        db = open_change_db(config)
        try:
            # Slot creation waits for every open transaction of the cluster: bounded, so a
            # stuck neighbour fails this setup instead of hanging it.
            async with asyncio.timeout(SETUP_S):
                await migrate(db)
                prepared = await prepare_upstream(config, db)
                runtime = await postgres_service(config, db, prepared, address="127.0.0.1:0")
        except BaseException:
            await db.dispose()
            raise
        service = runtime.service
        tasks = [asyncio.create_task(service.run(), name="hpe-service")]
        runtime.start_backup(config.change_db_url, config.shard)
        subscriber = service.subscribe(
            SubscriberContext(
                protocol_version=6,
                id="hpe-serving",
                mode="serving",
                replica_version=runtime.replica.replica_version,
                watermark=runtime.replica.state_version,
                initial=True,
            )
        )
        env = Upstream(url, config, db, runtime, subscriber, tasks)
        try:
            yield env
        finally:
            await env.stop()


StartUpstream = Callable[..., Awaitable[Upstream]]


@pytest.fixture
async def upstream(
    pg_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[StartUpstream]:
    """``await upstream(setup_sql, **ZERO_settings)`` → a running :class:`Upstream`."""
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    async with contextlib.AsyncExitStack() as stack:

        async def start(setup_sql: Sequence[str] = (), **settings: Any) -> Upstream:
            return await stack.enter_async_context(
                running_upstream(pg_url, f"hpe_{module}", tmp_path, setup_sql, **settings)
            )

        yield start


async def reset_required(env: Upstream) -> bool:
    config = await Replication(env.db).config()
    return config is not None and config.reset_required
