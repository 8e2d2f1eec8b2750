"""``serve`` with zero-cache's upstream settings: a failover slot refused on this
server (one line, exit 1), the stream's inbound timeout, and the ``wss`` discovery
address (``ZERO_CHANGE_STREAMER_PROTOCOL``)."""

from __future__ import annotations

import psycopg
from psycopg.conninfo import make_conninfo

from tests.serve_pg.conftest import (
    ServeFactory,
    app_slots,
    create_workload_schema,
    lite_rows,
)


async def test_a_failover_slot_on_postgres_before_17_stops_start_up_with_one_line(
    upstream: str, serve_factory: ServeFactory
) -> None:
    await create_workload_schema(upstream)
    async with await psycopg.AsyncConnection.connect(upstream) as c:
        version = c.info.server_version
    assert version < 170000, "this test needs a server before Postgres 17"
    serve = serve_factory(upstream, ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER="true")
    serve.start()
    assert await serve.wait_exit() == 1
    line = (
        "changestreamer: ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER needs Postgres 17 or later; "
        f"the upstream is Postgres {version // 10000}.{version % 10000} "
        "(unset the setting, or upgrade)"
    )
    assert line in serve.output().splitlines()
    assert "Traceback" not in serve.output()
    assert await app_slots(upstream) == []
    assert not serve.replica_file.exists()


async def test_a_silent_stream_is_torn_down_after_the_inbound_timeout(
    upstream: str, serve_factory: ServeFactory
) -> None:
    await create_workload_schema(upstream)
    # Postgres asks for a reply after 2 s of silence (half its wal_sender_timeout):
    # an idle stream is silent that long, well past a 1 s inbound limit (the default
    # limit, 2 × 4 s, would never be reached).
    short = make_conninfo(upstream, options="-c wal_sender_timeout=4000")
    serve = serve_factory(
        short,
        ZERO_UPSTREAM_PG_STREAM_INBOUND_TIMEOUT_MS="1000",
        ZERO_CHANGE_STREAMER_PROTOCOL="wss",
    )
    serve.start()
    await serve.wait_ready()
    await serve.wait_output(r"no message from Postgres for \d+ s \(limit 1 s\); reconnecting")
    # The discovery address view-syncers read: wss://, as zero writes it.
    [(address,)] = lite_rows(serve.change_db_file, 'SELECT "ownerAddress" FROM "replicationState"')
    assert address == f"wss://127.0.0.1:{serve.port}"
    await serve.terminate()
