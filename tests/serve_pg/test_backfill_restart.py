"""A ``serve`` killed (SIGKILL) in the middle of a backfill resumes it after restart.

A table of many rows is added to the publication while the workload writer keeps
committing to other tables. Once some of the backfill's batches are in the change
log (and its completion is not), ``serve`` is killed. The change DB still owes that
backfill (``backfilling``); the restarted process is started with it as a backfill
request, reads it again at a new snapshot and completes it. Afterwards:

* the replica equals Postgres row by row, the backfilled table included;
* every writer transaction is stored exactly once (nothing lost or duplicated);
* the replicaVersion is the one of the first start (no re-sync happened).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.serve_pg.conftest import (
    ServeFactory,
    Writer,
    eventually,
    lite_rows,
    pg_execute,
    pg_rows,
    replica_versions,
    start_ready,
    stored_xids,
    wait_until_replica_matches,
)

BIG_ROWS = 300_000  # tens of MB of COPY: the kill lands well before its end


def backfill_tags(change_db: Path) -> list[str]:
    rows = lite_rows(
        change_db,
        """SELECT json_extract(change, '$.tag') FROM "changeLog"
           WHERE json_extract(change, '$.tag') IN ('backfill', 'backfill-completed')""",
    )
    return [tag for (tag,) in rows]


async def test_sigkill_mid_backfill_resumes_it_after_restart(
    upstream: str, serve_factory: ServeFactory
) -> None:
    await pg_execute(
        upstream,
        "CREATE SCHEMA extra",
        "CREATE TABLE extra.big (id int PRIMARY KEY, label text, n bigint)",
        f"INSERT INTO extra.big SELECT g, 'row ' || g, g * 7 FROM generate_series(1, {BIG_ROWS}) g",
    )
    serve = await start_ready(upstream, serve_factory)
    replica_version = replica_versions(serve.replica_file)[0]
    writer = Writer(upstream)
    writer.start()
    try:
        await pg_execute(upstream, "ALTER PUBLICATION _hpf_public_0 ADD TABLES IN SCHEMA extra")
        await eventually(
            lambda: "backfill" in backfill_tags(serve.change_db_file), "a stored backfill batch"
        )
        serve.kill()
        tags = backfill_tags(serve.change_db_file)
        assert "backfill-completed" not in tags, "the backfill finished before the kill"
        owed = lite_rows(serve.change_db_file, 'SELECT schema, "table", "column" FROM backfilling')
        assert sorted(owed) == [("extra", "big", c) for c in ("id", "label", "n")]

        serve.start()
        await serve.wait_ready()
        await serve.wait_output(r"backfill added \(resumed\): extra\.big")
        await eventually(
            lambda: "backfill-completed" in backfill_tags(serve.change_db_file),
            "the resumed backfill to complete",
            timeout_s=120,
        )
        assert lite_rows(serve.change_db_file, "SELECT * FROM backfilling") == []
    finally:
        await writer.finish()

    await wait_until_replica_matches(upstream, serve.replica_file, timeout_s=120)
    expected = await pg_rows(upstream, "SELECT id, label, n FROM extra.big ORDER BY id")
    actual = lite_rows(serve.replica_file, 'SELECT id, label, n FROM "extra.big" ORDER BY id')
    assert len(actual) == BIG_ROWS
    assert actual == [tuple(r) for r in expected]
    stored = stored_xids(serve.change_db_file)
    assert len(stored) == len(set(stored)), "a transaction was stored twice"
    assert not set(writer.committed.values()) - set(stored), "a committed transaction is missing"
    assert replica_versions(serve.replica_file)[0] == replica_version
    # The backfill's versions are minors after the commits they follow, never acked.
    begins = [
        json.loads(c)
        for (c,) in lite_rows(serve.change_db_file, 'SELECT change FROM "changeLog" WHERE pos = 0')
    ]
    assert any(b.get("skipAck") is True for b in begins)
    await serve.terminate()
