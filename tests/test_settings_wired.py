"""zero-cache settings this role implements: each one's bad values (one line) and the
behaviour it changes. The Postgres upstream's own ones (copy workers, failover slots,
the inbound timeout) are in tests/e2e_pg/test_upstream_settings.py and
tests/serve_pg/test_upstream_settings.py; lag reports in tests/e2e_pg/test_lag_reports.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from app.commands.migrate import open_change_db
from app.commands.serve import discovery_address
from app.config import Settings, SettingsError, load_settings
from app.protocol.canonical_json import dumps
from app.protocol.codec import reconstruct
from app.runtime import memory_limit
from app.runtime.memory_limit import back_pressure_bytes, memory_limit_bytes
from app.runtime.options import streamer_options
from app.storage import (
    ChangeDbOptions,
    Shard,
    StoredRow,
    create_change_db,
    migrate,
    parse_change_db_url,
)
from app.streamer.service import ChangeStreamerService
from app.streamer.subscriber import Change
from tests.change_dbs import migrated
from tests.memory_source import MemoryChangeSource
from tests.pgdb import scratch_database

MiB = 1024 * 1024


def load(env: dict[str, str]) -> Settings:
    return load_settings(environ=env, env_file=None)


def refused(env: dict[str, str]) -> str:
    with pytest.raises(SettingsError) as e:
        load(env)
    return str(e.value)


# -- parsing ------------------------------------------------------------------------------


def test_the_defaults_are_zero_cache_1_9_0s() -> None:
    s = load({})
    assert s.replication_lag_report_interval_ms == 30_000
    assert s.upstream_max_conns == 20
    assert s.initial_sync_table_copy_workers == 5
    assert s.upstream_pg_stream_inbound_timeout_ms is None  # 2 × wal_sender_timeout
    assert s.upstream_pg_replication_slot_failover is False
    assert s.change_max_conns == 5
    assert s.change_statement_timeout_ms == 20_000
    assert s.change_streamer_protocol == "ws"
    # Ours (zero: 2000 rows per INSERT; a COPY has no bind-parameter limit).
    assert s.change_log_batch_size == 10_000
    assert s.back_pressure_bytes is None
    assert s.back_pressure_heap_proportion is None


def test_a_lag_report_interval_of_zero_or_less_is_accepted_and_means_none() -> None:
    assert (
        load({"ZERO_REPLICATION_LAG_REPORT_INTERVAL_MS": "0"}).replication_lag_report_interval_ms
        == 0
    )
    assert (
        load({"ZERO_REPLICATION_LAG_REPORT_INTERVAL_MS": "-1"}).replication_lag_report_interval_ms
        == -1
    )


_INT = "Input should be a valid integer, unable to parse string as an integer"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("ZERO_REPLICATION_LAG_REPORT_INTERVAL_MS", "soon", _INT),
        ("ZERO_UPSTREAM_MAX_CONNS", "0", "Input should be greater than or equal to 1"),
        ("ZERO_UPSTREAM_MAX_CONNS", "many", _INT),
        ("ZERO_INITIAL_SYNC_TABLE_COPY_WORKERS", "0", "Input should be greater than or equal to 1"),
        ("ZERO_UPSTREAM_PG_STREAM_INBOUND_TIMEOUT_MS", "0", "Input should be greater than 0"),
        ("ZERO_UPSTREAM_PG_STREAM_INBOUND_TIMEOUT_MS", "1.5", _INT),
        (
            "ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER",
            "maybe",
            "Input should be a valid boolean, unable to interpret input",
        ),
        ("ZERO_CHANGE_MAX_CONNS", "0", "Input should be greater than or equal to 1"),
        ("ZERO_CHANGE_STATEMENT_TIMEOUT_MS", "0", "Input should be greater than 0"),
        ("ZERO_CHANGE_STATEMENT_TIMEOUT_MS", "-5", "Input should be greater than 0"),
        ("ZERO_CHANGE_LOG_BATCH_SIZE", "0", "Input should be greater than or equal to 1"),
        ("ZERO_CHANGE_LOG_BATCH_SIZE", "1.5", _INT),
        ("ZERO_CHANGE_STREAMER_PROTOCOL", "http", "Input should be 'ws' or 'wss'"),
        ("ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_BYTES", "0", "Input should be greater than 0"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_setting(name: str, value: str, message: str) -> None:
    line = refused({name: value})
    assert line == f"invalid setting {name}: {message} (got {value!r})"
    assert "\n" not in line


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "nan", "inf", "lots"])
def test_a_bad_heap_proportion_is_one_line(value: str) -> None:
    assert refused({"ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_HEAP_PROPORTION": value}) == (
        "ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_HEAP_PROPORTION must be a fraction above 0 "
        f"and at most 1 (got {value!r})"
    )


# -- ZERO_CHANGE_STREAMER_PROTOCOL ----------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "10.0.0.5:4849"),
        ({"ZERO_CHANGE_STREAMER_PROTOCOL": "ws"}, "10.0.0.5:4849"),  # bare, as zero writes it
        ({"ZERO_CHANGE_STREAMER_PROTOCOL": "wss"}, "wss://10.0.0.5:4849"),
        (
            {
                "ZERO_CHANGE_STREAMER_PROTOCOL": "wss",
                "ZERO_CHANGE_STREAMER_ADDRESS": "cs.example:443",
            },
            "wss://cs.example:443",
        ),
        (  # an address that names its scheme is taken as it is
            {
                "ZERO_CHANGE_STREAMER_PROTOCOL": "wss",
                "ZERO_CHANGE_STREAMER_ADDRESS": "wss://cs.example",
            },
            "wss://cs.example",
        ),
    ],
)
def test_the_discovery_address_takes_the_protocol(env: dict[str, str], expected: str) -> None:
    assert discovery_address(load(env), "10.0.0.5", 4849) == expected


# -- flow control: zero 1.9's padding switches early release off when negative ---------


@pytest.mark.parametrize(
    ("env", "proportion"),
    [
        ({}, 2.0),
        ({"ZERO_CHANGE_STREAMER_FLOW_CONTROL_CONSENSUS_TIMEOUT_PROPORTION": "0.5"}, 0.5),
        # A positive padding is 1.9's fixed wait: the proportion decides here instead.
        ({"ZERO_CHANGE_STREAMER_FLOW_CONTROL_CONSENSUS_PADDING_SECONDS": "3"}, 2.0),
        # Negative: no early release (a negative proportion never arms the timer,
        # tests/streamer/test_flow_control.py).
        ({"ZERO_CHANGE_STREAMER_FLOW_CONTROL_CONSENSUS_PADDING_SECONDS": "-1"}, -1.0),
    ],
)
def test_a_negative_consensus_padding_turns_early_release_off(
    env: dict[str, str], proportion: float
) -> None:
    assert streamer_options(load(env)).timeout_proportion == proportion


# -- back pressure: bytes, or a proportion of the memory limit ---------------------------


def test_the_heap_proportion_is_of_the_memory_limit_and_explicit_bytes_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory_limit, "memory_limit_bytes", lambda: 2048 * MiB)
    proportion = {"ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_HEAP_PROPORTION": "0.04"}
    assert streamer_options(load({})).back_pressure_bytes == 64 * MiB
    assert streamer_options(load(proportion)).back_pressure_bytes == int(2048 * MiB * 0.04)
    explicit = {**proportion, "ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_BYTES": "1000"}
    assert streamer_options(load(explicit)).back_pressure_bytes == 1000


def test_an_unknown_memory_limit_falls_back_to_the_default_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory_limit, "memory_limit_bytes", lambda: None)
    assert back_pressure_bytes(None, 0.5, 123) == 123
    assert back_pressure_bytes(None, 0.5, 123, limit=1000) == 500


def _cgroups(tmp_path: Path, files: dict[str, str], membership: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    proc = tmp_path / "proc-cgroup"
    proc.write_text(membership)
    return root, proc


def test_the_memory_limit_is_the_tightest_cgroup_limit_below_the_ram(tmp_path: Path) -> None:
    ram = memory_limit_bytes(tmp_path / "none", tmp_path / "none")
    assert ram is not None
    assert ram > 0
    # cgroup v2: this group's memory.max, or an ancestor's if tighter.
    root, proc = _cgroups(
        tmp_path / "v2",
        {"app/task/memory.max": str(512 * MiB), "app/memory.max": "max"},
        "0::/app/task\n",
    )
    assert memory_limit_bytes(root, proc) == 512 * MiB
    # cgroup v1: memory.limit_in_bytes; its "no limit" is a huge number.
    root, proc = _cgroups(
        tmp_path / "v1",
        {
            "memory/docker/abc/memory.limit_in_bytes": str(256 * MiB),
            "memory/memory.limit_in_bytes": "9223372036854771712",
        },
        "4:memory:/docker/abc\n1:cpu:/\n",
    )
    assert memory_limit_bytes(root, proc) == 256 * MiB
    root, proc = _cgroups(tmp_path / "none-set", {"memory.max": "max"}, "0::/\n")
    assert memory_limit_bytes(root, proc) == ram


# -- the change log: group commits, statement timeout -------------------------------------


@pytest.fixture
async def sqlite_db(tmp_path: Path) -> AsyncIterator[Any]:
    db = create_change_db(
        parse_change_db_url(str(tmp_path / "cdc.db")),
        Shard(),
        ChangeDbOptions(sqlite_writer="thread"),
    )
    await migrated(db, auto_reset=True, owner="owner", address="127.0.0.1:1")
    try:
        yield db
    finally:
        await db.dispose()


def _txn(w: str) -> list[Change]:
    insert = {"tag": "insert", "relation": {"schema": "public", "name": "t"}, "new": {"id": 1}}
    return [
        Change(w, tag, reconstruct(w, tag, dumps(body)))
        for tag, body in (
            ("begin", {"tag": "begin"}),
            ("insert", insert),
            ("commit", {"tag": "commit"}),
        )
    ]


@pytest.mark.parametrize(("batch", "groups_of"), [(None, [15]), ("3", [3] * 5), ("7", [9, 6])])
async def test_the_change_log_batch_size_caps_rows_per_group_commit(
    sqlite_db: Any, batch: str | None, groups_of: list[int]
) -> None:
    env = {"ZERO_CHANGE_LOG_BATCH_SIZE": batch} if batch else {}
    options = streamer_options(load(env))
    service = ChangeStreamerService(
        db=sqlite_db,
        source=MemoryChangeSource(),
        task_id="owner",
        address=None,
        replica_version="01",
        durable_watermark="01",
        options=options,
    )
    storer = service.storer
    groups: list[int] = []
    commit_rows = service.change_log.commit_rows

    async def counted(owner: str, rows: Sequence[StoredRow], last: str) -> None:
        groups.append(len(rows))
        await commit_rows(owner, rows, last)

    service.change_log.commit_rows = counted  # type: ignore[method-assign,assignment]
    for w in ("02", "03", "04", "05", "06"):  # queued before the writer looks: one group
        storer.append(_txn(w))
    run = asyncio.create_task(storer.run())
    try:
        await asyncio.wait_for(storer.wait_durable("06"), 10)
    finally:
        await storer.stop()
        await asyncio.wait_for(run, 10)
    # 3 rows a transaction; a group takes whole transactions until it holds the batch.
    assert groups == groups_of


async def test_the_statement_timeout_bounds_the_storer_and_postgres_sessions(
    pg_url: str, tmp_path: Path
) -> None:
    settings_env = {
        "ZERO_CHANGE_STATEMENT_TIMEOUT_MS": "300",
        "ZERO_CHANGE_MAX_CONNS": "3",
        "ZERO_APP_ID": "cswired",
    }
    assert streamer_options(load(settings_env)).statement_timeout_s == 0.3  # the watchdog
    async with scratch_database(pg_url, "cs_settings_wired") as url:
        # ZERO_CHANGE_DB takes a URL; scratch_database gives a conninfo string.
        info = psycopg.conninfo.conninfo_to_dict(url)
        change_db = (
            f"postgresql://{info.get('user', 'postgres')}@{info.get('host', '127.0.0.1')}:"
            f"{info.get('port', 5432)}/{info['dbname']}"
        )
        db = open_change_db(load({**settings_env, "ZERO_CHANGE_DB": change_db}))
        try:
            pool = db.writer.sync_engine.pool
            assert pool.size() == 3  # type: ignore[attr-defined]
            assert pool._max_overflow == 0  # type: ignore[attr-defined]
            async with db.writer.connect() as conn:
                assert (await conn.scalar(text("SHOW statement_timeout"))) == "300ms"
                with pytest.raises(DBAPIError, match="statement timeout"):
                    await conn.execute(text("SELECT pg_sleep(30)"))
            # Migrations lift it for their transaction (they may wait for another node).
            await migrate(db)
            # At most ZERO_CHANGE_MAX_CONNS sessions at once.
            conns = [await db.writer.connect() for _ in range(3)]
            try:
                for c in conns:
                    await c.scalar(text("SELECT 1"))
                assert pool.checkedout() == 3  # type: ignore[attr-defined]
                sessions = await _sessions(url)
                assert sessions == 3
            finally:
                for c in conns:
                    await c.close()
        finally:
            await db.dispose()


async def _sessions(url: str) -> int:
    """The change DB's sessions in this database (zero's application_name)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as c:
        cur = await c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'zero-change-streamer'"
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])
