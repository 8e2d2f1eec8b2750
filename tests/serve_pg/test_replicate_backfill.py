"""``changestreamer replicate`` applies backfills (spec/source.md §1.8).

A ``serve`` child over a scratch Postgres, a copy of its replica file, and a
``changestreamer replicate`` child following the service into the copy. Then two
schema changes whose data only a backfill can bring: a column with a volatile
default (``now()``: the replica cannot compute the value Postgres gave the existing
rows) and a table with rows added to the publication (nothing of it was ever
streamed). Writes go on around them. The copy must end equal to Postgres row by
row, at the replica version it was copied at (nothing was reset).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.serve_pg.conftest import (
    APP_ID,
    SERVE,
    ServeFactory,
    eventually,
    lite_rows,
    pg_execute,
    pg_rows,
    replica_versions,
)

ROWS = 3000  # over 256 KiB of COPY for ``t``: several backfill batches
MATCH_TIMEOUT_S = 90.0
PUBLICATION = f"_{APP_ID}_public_0"

SETUP = (
    "CREATE TABLE foo (id int PRIMARY KEY, v text, n int)",
    f"INSERT INTO foo SELECT g, 'foo ' || g, g FROM generate_series(1, {ROWS}) g",
    "CREATE SCHEMA other",
    "CREATE TABLE other.t (id int PRIMARY KEY, v text, n int8, j jsonb)",
    "INSERT INTO other.t SELECT g, repeat('t', 100) || g, g::int8 * 1000000000, "
    f"jsonb_build_object('g', g) FROM generate_series(1, {ROWS}) g",
)

# (Postgres query, replica query, Postgres row → replica row); timestamps as epoch µs ÷ 1000.
TABLES: dict[str, tuple[str, str, Callable[[tuple[Any, ...]], tuple[Any, ...]]]] = {
    "foo": (
        "SELECT id, v, n, (extract(epoch FROM at) * 1000000)::bigint FROM foo ORDER BY id",
        "SELECT id, v, n, at FROM foo ORDER BY id",
        lambda r: (*r[:3], None if r[3] is None else r[3] / 1000),
    ),
    "other.t": (
        "SELECT id, v, n, j::text FROM other.t ORDER BY id",
        'SELECT id, v, n, j FROM "other.t" ORDER BY id',
        lambda r: tuple(r),
    ),
}


def replicate(
    url: str, replica: Path, protocol: str, log: Path, cwd: Path
) -> subprocess.Popen[bytes]:
    """``changestreamer replicate`` as a child (killed by its PID in the test's teardown)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_", "CHANGESTREAMER_"))}
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                *(str(SERVE), "replicate", url, "--replica", str(replica)),
                *("--id", "bf-copy", "--protocol-version", protocol),
            ],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=out,
        )


def copy_replica(source: Path, dest: Path) -> None:
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=10)
    dst = sqlite3.connect(dest)
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()


async def differences(url: str, replica: Path) -> list[str]:
    """Row-by-row differences of both tables ([] = equal); a table or column the
    replica does not show yet is a difference too."""
    problems: list[str] = []
    for table, (pg_query, lite_query, convert) in TABLES.items():
        expected: list[tuple[Any, ...]] = [convert(r) for r in await pg_rows(url, pg_query)]
        try:
            actual = lite_rows(replica, lite_query)
        except sqlite3.OperationalError as e:
            problems.append(f"{table}: {e}")
            continue
        if len(actual) != len(expected):
            problems.append(f"{table}: {len(actual)} rows on the replica, {len(expected)} upstream")
        problems += [
            f"{table}: upstream {e} replica {a}"
            for e, a in zip(expected, actual, strict=False)
            if tuple(e) != tuple(a)
        ][:10]
    return problems


@pytest.mark.parametrize("protocol", ["6", "7"])
async def test_replicate_applies_backfills_and_ends_equal_to_postgres(
    upstream: str, serve_factory: ServeFactory, tmp_path: Path, protocol: str
) -> None:
    await pg_execute(upstream, *SETUP)
    serve = serve_factory(upstream)
    serve.start()
    await serve.wait_ready()
    copy = tmp_path / "copy.db"
    copy_replica(serve.replica_file, copy)
    replica_version, copied_at = replica_versions(copy)

    log = tmp_path / "replicate.log"
    proc = replicate(f"ws://127.0.0.1:{serve.port}", copy, protocol, log, tmp_path)
    try:

        def alive() -> None:
            code = proc.poll()
            assert code is None, f"replicate exited with {code}:\n{log.read_text()[-3000:]}"

        await pg_execute(upstream, "UPDATE foo SET n = n + 1 WHERE id <= 10")

        def follows() -> bool:
            alive()
            return replica_versions(copy)[1] > copied_at

        await eventually(follows, "replicate to follow")
        await pg_execute(
            upstream,
            "ALTER TABLE foo ADD COLUMN at timestamptz DEFAULT now()",
            "UPDATE foo SET v = v || '!' WHERE id % 100 = 0",
            f"ALTER PUBLICATION {PUBLICATION} ADD TABLE other.t",
            "UPDATE other.t SET n = -n WHERE id % 250 = 0",
            "DELETE FROM other.t WHERE id % 300 = 0",
            "INSERT INTO foo (id, v, n) VALUES (-1, 'after', -1)",
        )

        async def equal() -> bool:
            alive()
            return not await differences(upstream, copy)

        try:
            await eventually(equal, "the copy to equal Postgres", MATCH_TIMEOUT_S)
        except AssertionError as e:
            problems = "\n".join((await differences(upstream, copy))[:20])
            raise AssertionError(f"{e}\n{problems}\nreplicate:\n{log.read_text()[-3000:]}") from e
        alive()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    assert replica_versions(copy)[0] == replica_version
    assert replica_versions(serve.replica_file)[0] == replica_version
    # The backfilled column and table are no longer marked as being backfilled.
    backfilling = 'SELECT count(*) FROM "_zero.column_metadata" WHERE backfill IS NOT NULL'
    assert lite_rows(copy, backfilling) == [(0,)]
    await serve.terminate()
