"""Replication slots and replicas rows against a real Postgres (spec/source.md §5.2, §6.1).

Slots are cluster-wide and few (``max_replication_slots``), so every test uses its own
app ID ``hpb_s<random>`` and its scratch database (conftest) is dropped with its slots.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from app.protocol.lexi import lsn_to_watermark
from app.sources.postgres.errors import AutoResetRequired, SlotCreationError
from app.sources.postgres.published import published_schema
from app.sources.postgres.shard import ShardConfig, setup_shard
from app.sources.postgres.slots import (
    check_replica,
    create_replication_slot,
    drop_slot,
    drop_unclaimed_slots,
    record_initial_sync,
    slot_health,
    slot_pool_suffix,
    slot_status,
)
from app.sources.postgres.stats import upstream_stats
from app.stop_signals import AutoResetSignal
from tests.pgdb import scratch_database
from tests.waiting import eventually


def test_slot_pool_suffixes_run_a_to_z_then_aa() -> None:
    assert [slot_pool_suffix(n) for n in (0, 1, 25, 26, 27, 51, 52, 701, 702)] == [
        "a",
        "b",
        "z",
        "aa",
        "ab",
        "az",
        "ba",
        "zz",
        "aaa",
    ]


@pytest.mark.parametrize(
    ("restart_lsn", "wal_status", "status"),
    [
        ("0/1", "reserved", "ok"),
        ("0/1", "extended", "ok"),
        ("0/1", "unreserved", "unreserved"),
        ("0/1", "lost", "lost"),
        (None, None, "lost"),
        ("0/1", None, "unknown"),
    ],
)
def test_slot_status(restart_lsn: str | None, wal_status: str | None, status: str) -> None:
    assert slot_status(restart_lsn, wal_status) == status


@pytest.fixture
def cfg() -> ShardConfig:
    return ShardConfig(f"hpb_s{uuid.uuid4().hex[:8]}", 0)


@pytest.fixture
async def conn(db_url: str, cfg: ShardConfig) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        await c.execute("CREATE TABLE foo (id int PRIMARY KEY, v text)")
        await setup_shard(c, cfg)
        yield c


async def rows(conn: psycopg.AsyncConnection[Any], query: str, *params: Any) -> list[Any]:
    cur = await conn.execute(query.encode(), list(params) or None)
    return list(await cur.fetchall())


async def test_created_slot_exports_the_snapshot_of_its_consistent_point(
    conn: psycopg.AsyncConnection[Any], db_url: str, cfg: ShardConfig
) -> None:
    await conn.execute("INSERT INTO foo VALUES (1, 'before')")
    before_ms = int(time.time() * 1000)

    slot = await create_replication_slot(db_url, cfg)
    try:
        await conn.execute("INSERT INTO foo VALUES (2, 'after')")
        async with await psycopg.AsyncConnection.connect(db_url) as reader:
            await reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            await reader.execute(f"SET TRANSACTION SNAPSHOT '{slot.snapshot_name}'".encode())
            assert await rows(reader, "SELECT id, v FROM foo") == [(1, "before")]
            await reader.rollback()
    finally:
        await slot.close()

    assert slot.slot_name == f"{cfg.shard_schema}_a"
    assert slot.replica_version == lsn_to_watermark(slot.consistent_point)
    assert before_ms <= int(slot.replica_id) <= int(time.time() * 1000)
    replicas = await rows(conn, f'SELECT id, slot, version FROM "{cfg.shard_schema}".replicas')
    assert replicas == [(slot.replica_id, slot.slot_name, slot.replica_version)]
    assert await rows(
        conn,
        "SELECT plugin, slot_type, database = current_database() FROM pg_replication_slots "
        "WHERE slot_name = %s",
        slot.slot_name,
    ) == [("pgoutput", "logical", True)]


async def test_claimed_slot_is_kept_and_the_next_name_is_used(
    conn: psycopg.AsyncConnection[Any], db_url: str, cfg: ShardConfig
) -> None:
    first = await create_replication_slot(db_url, cfg)
    await first.close()
    second = await create_replication_slot(db_url, cfg)
    await second.close()

    assert (first.slot_name, second.slot_name) == (
        f"{cfg.shard_schema}_a",
        f"{cfg.shard_schema}_b",
    )


async def test_unclaimed_inactive_slot_is_dropped_and_its_name_reused(
    conn: psycopg.AsyncConnection[Any], db_url: str, cfg: ShardConfig
) -> None:
    orphan = f"{cfg.shard_schema}_a"
    await conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [orphan])
    cur = await conn.execute(
        "SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = %s", [orphan]
    )
    orphan_lsn = (await cur.fetchone() or [None])[0]

    slot = await create_replication_slot(db_url, cfg)
    await slot.close()

    assert slot.slot_name == orphan
    assert slot.consistent_point != orphan_lsn  # a new slot, not the orphan
    assert await drop_unclaimed_slots(conn, cfg) == (0, 1, 0)


async def test_another_database_s_slot_of_the_same_app_is_never_dropped(
    conn: psycopg.AsyncConnection[Any], db_url: str, pg_url: str, cfg: ShardConfig
) -> None:
    # Slot names are the cluster's; the same app in another database (another
    # deployment, another test run) claims its slots in its own replicas table,
    # which this database cannot see.
    async with scratch_database(pg_url, f"hpb_other_{cfg.app_id}") as other_url:
        theirs = f"{cfg.shard_schema}_z"
        async with await psycopg.AsyncConnection.connect(other_url, autocommit=True) as other:
            await other.execute(
                "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [theirs]
            )
        slot = await create_replication_slot(db_url, cfg)  # drops this database's only
        await slot.close()
        assert await drop_unclaimed_slots(conn, cfg) == (0, 1, 0)
        assert await rows(
            conn, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", theirs
        ) == [(1,)]


async def test_slot_creation_times_out_while_a_transaction_stays_open(
    conn: psycopg.AsyncConnection[Any], db_url: str, cfg: ShardConfig
) -> None:
    async with await psycopg.AsyncConnection.connect(db_url) as blocker:
        await blocker.execute("SELECT txid_current()")  # an xid the snapshot must wait for
        with pytest.raises(SlotCreationError, match="creating replication slot"):
            await create_replication_slot(db_url, cfg, timeout_s=1.0)
        await blocker.rollback()

    # Postgres gave up itself (lock_timeout): no half-made slot is left behind.
    assert (
        await rows(
            conn,
            "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE %s",
            f"{cfg.shard_schema}_%",
        )
        == []
    )


async def initialized_replica(
    conn: psycopg.AsyncConnection[Any], db_url: str, cfg: ShardConfig
) -> tuple[str, str, str]:
    slot = await create_replication_slot(db_url, cfg)
    await slot.close()
    internal = await setup_shard(conn, cfg)
    schema = await published_schema(conn, internal.publications)
    await record_initial_sync(conn, cfg, slot.replica_id, schema, {"host": "test"})
    return slot.replica_id, slot.slot_name, slot.replica_version


async def test_replica_is_usable_once_the_initial_sync_is_recorded(
    conn: psycopg.AsyncConnection[Any], db_url: str, cfg: ShardConfig
) -> None:
    slot = await create_replication_slot(db_url, cfg)
    await slot.close()

    with pytest.raises(AutoResetRequired, match="No replication slot for replica at version"):
        await check_replica(conn, cfg, slot.replica_version)

    schema = await published_schema(conn, [f"_{cfg.app_id}_public_0"])
    await record_initial_sync(conn, cfg, slot.replica_id, schema, {"host": "test"})
    replica = await check_replica(conn, cfg, slot.replica_version)

    assert (replica.id, replica.slot, replica.version) == (
        slot.replica_id,
        slot.slot_name,
        slot.replica_version,
    )
    assert replica.initial_schema == {"tables": schema["tables"], "indexes": schema["indexes"]}
    assert replica.initial_sync_context == {"host": "test"}
    assert replica.subscriber_context is None
    assert replica.publications == [f"_{cfg.app_id}_metadata_0", f"_{cfg.app_id}_public_0"]
    assert replica.ddl_detection is True


async def test_missing_slot_requires_a_reset(
    conn: psycopg.AsyncConnection[Any], db_url: str, cfg: ShardConfig
) -> None:
    _, slot_name, version = await initialized_replica(conn, db_url, cfg)
    assert await drop_slot(db_url, slot_name) is True

    with pytest.raises(AutoResetRequired, match=f"replication slot {slot_name} is missing") as e:
        await check_replica(conn, cfg, version)
    assert isinstance(e.value, AutoResetSignal)  # the streamer's auto-reset path


async def test_changed_publications_require_a_reset_and_drop_the_shard(
    conn: psycopg.AsyncConnection[Any], db_url: str, cfg: ShardConfig
) -> None:
    _, _, version = await initialized_replica(conn, db_url, cfg)
    await conn.execute("CREATE PUBLICATION hpb_other FOR TABLE foo")

    with pytest.raises(AutoResetRequired, match=r"Requested publications \[hpb_other\]"):
        await check_replica(conn, ShardConfig(cfg.app_id, 0, ("hpb_other",)), version)
    assert (
        await rows(conn, "SELECT nspname FROM pg_namespace WHERE nspname = %s", cfg.shard_schema)
        == []
    )


async def test_slot_health_of_a_fresh_slot_is_ok(
    conn: psycopg.AsyncConnection[Any], db_url: str, cfg: ShardConfig
) -> None:
    slot = await create_replication_slot(db_url, cfg)
    await slot.close()

    health = await slot_health(conn, slot.slot_name)
    missing = await slot_health(conn, f"{cfg.shard_schema}_zz")

    assert (health.status, health.wal_status) == ("ok", "reserved")
    assert health.restart_lsn is not None
    assert missing.status == "missing"


async def test_drop_slot_ends_the_backend_streaming_from_it(
    conn: psycopg.AsyncConnection[Any], db_url: str, cfg: ShardConfig
) -> None:
    slot = await create_replication_slot(db_url, cfg)
    try:
        await slot.replication_conn.execute(
            f"START_REPLICATION SLOT \"{slot.slot_name}\" LOGICAL 0/0 (proto_version '1', "
            f"publication_names '_{cfg.app_id}_public_0')".encode()
        )
        active: list[tuple[Any, ...]] = []

        async def streaming() -> bool:
            nonlocal active
            active = await rows(
                conn, "SELECT active FROM pg_replication_slots WHERE slot_name = %s", slot.slot_name
            )
            return active == [(True,)]

        await eventually(streaming, "the slot to be active", 5)
        assert active == [(True,)]

        assert await drop_slot(db_url, slot.slot_name) is True
    finally:
        await slot.close()

    assert (await slot_health(conn, slot.slot_name)).status == "missing"
    assert await drop_slot(db_url, slot.slot_name) is True  # already gone: still fine


async def test_the_upstream_stats_count_the_shard_and_show_the_wal_each_slot_retains(
    conn: psycopg.AsyncConnection[Any], db_url: str, cfg: ShardConfig
) -> None:
    slot = await create_replication_slot(db_url, cfg)
    await slot.close()
    await conn.execute(
        f'INSERT INTO "{cfg.shard_schema}"."clients" VALUES '
        "(%s, %s, %s, NULL), (%s, %s, %s, NULL)".encode(),
        ["g1", "c1", 3, "g1", "c2", 4],
    )
    before = await upstream_stats(db_url, cfg)
    for i in range(200):  # WAL the slot must keep: nothing consumes it
        await conn.execute("INSERT INTO foo VALUES (%s, repeat('x', 1000))", [100 + i])
    after = await upstream_stats(db_url, cfg)
    assert {k: v for k, v in after.items() if k != "slots"} == {
        "type": "pg",
        "numReplicas": 1,
        "numClientsWithMutations": 2,
        "numMutationsProcessed": 7,
    }
    [was], [now] = before["slots"], after["slots"]
    assert now["name"] == slot.slot_name
    assert now["active"] is False
    assert now["restartLSN"] == was["restartLSN"]
    assert now["retainedWalBytes"] >= was["retainedWalBytes"] + 200_000
    assert now["unconfirmedWalBytes"] >= was["unconfirmedWalBytes"] + 200_000
