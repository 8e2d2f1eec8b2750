"""Reset-required from the stream, with and without auto-reset.

A schema change the source cannot follow ends the stream with ``reset-required``.
The one used here is a DDL event of a trigger version this source does not know (as
a newer zero-cache's triggers would send), in the same transaction as
``ALTER TABLE … ADD COLUMN c timestamptz DEFAULT now()`` (which alone would be
backfilled: tests/e2e_pg/test_backfill.py), so the column only reaches the replica
through the re-sync.

* With ``ZERO_AUTO_RESET=true`` the same ``serve`` process re-syncs: a new replica
  file with a new replicaVersion, the change DB re-tied to it, ready again, and the
  replica holds the new column with upstream's values; streaming continues.
* After that re-sync the old replica's slot is dropped (as the reference's
  ``dropOldReplicasAndSlots`` does when a stream starts): a forgotten slot keeps
  WAL on the upstream forever.
* With ``ZERO_AUTO_RESET=false`` the flag is kept in the change DB and the next start
  refuses with one clear line instead of serving a replica that cannot continue.
"""

from __future__ import annotations

import sqlite3

from tests.serve_pg.conftest import (
    Serve,
    ServeFactory,
    app_slots,
    eventually,
    lite_rows,
    pg_execute,
    pg_rows,
    replica_versions,
    start_ready,
    wait_until_replica_matches,
)

ADD_VOLATILE_COLUMN = "ALTER TABLE items ADD COLUMN c timestamptz DEFAULT now()"
UNKNOWN_DDL_EVENT = (
    'SELECT pg_logical_emit_message(true, \'hpf/0/ddl\', \'{"type":"ddlUpdate","version":99}\')'
)
RESET_TX = ("BEGIN", ADD_VOLATILE_COLUMN, UNKNOWN_DDL_EVENT, "COMMIT")  # one transaction


def current_replica_version(serve: Serve) -> str | None:
    """None while the replica file is missing or being replaced."""
    try:
        return replica_versions(serve.replica_file)[0]
    except (sqlite3.Error, AssertionError):
        return None


async def new_column_matches(upstream: str, serve: Serve) -> list[str]:
    expected = [
        (id_, us / 1000)
        for id_, us in await pg_rows(
            upstream, "SELECT id, (extract(epoch FROM c) * 1000000)::bigint FROM items ORDER BY id"
        )
    ]
    actual = lite_rows(serve.replica_file, "SELECT id, c FROM items ORDER BY id")
    return [f"{e} != {a}" for e, a in zip(expected, actual, strict=False) if e != a] + (
        [f"{len(expected)} upstream rows, {len(actual)} replica rows"]
        if len(expected) != len(actual)
        else []
    )


async def test_reset_required_with_auto_reset_resyncs_in_the_same_process(
    upstream: str, serve_factory: ServeFactory
) -> None:
    serve = await start_ready(upstream, serve_factory, ZERO_AUTO_RESET="true")
    old_version, _ = replica_versions(serve.replica_file)
    assert proc_pid(serve) is not None

    await pg_execute(upstream, *RESET_TX)
    await serve.wait_output(r"upstream requires a reset")
    await serve.wait_output(r"auto-reset: re-syncing the replica")
    new_version = await eventually(
        lambda: (v := current_replica_version(serve)) is not None and v != old_version and v,
        "a replica with a new replicaVersion",
    )
    assert new_version > old_version
    await serve.wait_ready()
    assert serve.runs == 1, "the same process re-synced"

    columns = [r[1] for r in lite_rows(serve.replica_file, 'PRAGMA table_info("items")')]
    assert "c" in columns
    assert await new_column_matches(upstream, serve) == []
    await wait_until_replica_matches(upstream, serve.replica_file)
    # The change DB now belongs to the new replica, and the flag is cleared.
    config = lite_rows(
        serve.change_db_file, 'SELECT "replicaVersion", "resetRequired" FROM "replicationConfig"'
    )
    assert [(v, bool(flag)) for v, flag in config] == [(new_version, False)]

    # And it streams again, new column included.
    await pg_execute(
        upstream,
        "INSERT INTO items (id, n, c) VALUES (-1, 1, '2001-02-03 04:05:06.789+00')",
        "INSERT INTO ledger VALUES (1, 1)",
    )
    await wait_until_replica_matches(upstream, serve.replica_file)
    assert lite_rows(serve.replica_file, "SELECT c FROM items WHERE id = -1") == [(981173106789,)]
    await serve.terminate()


def proc_pid(serve: Serve) -> int | None:
    return serve.proc.pid if serve.proc is not None and serve.alive() else None


async def test_reset_required_without_auto_reset_refuses_the_next_start(
    upstream: str, serve_factory: ServeFactory
) -> None:
    serve = await start_ready(upstream, serve_factory, ZERO_AUTO_RESET="false")
    version, _ = replica_versions(serve.replica_file)

    await pg_execute(upstream, *RESET_TX)
    await serve.wait_output(r"upstream requires a reset")
    await eventually(
        lambda: (
            lite_rows(serve.change_db_file, 'SELECT "resetRequired" FROM "replicationConfig"')
            == [(1,)]
        ),
        "resetRequired in the change DB",
    )
    assert replica_versions(serve.replica_file)[0] == version, "no re-sync without auto-reset"
    await serve.terminate()

    serve.start()
    assert await serve.wait_exit() == 1
    lines = [line for line in serve.output().splitlines() if line.startswith("changestreamer: ")]
    assert len(lines) == 1, serve.output()
    assert "the change DB says a reset is required" in lines[0]
    assert "ZERO_AUTO_RESET" in lines[0]
    assert replica_versions(serve.replica_file)[0] == version


async def test_auto_reset_drops_the_old_replicas_slot(
    upstream: str, serve_factory: ServeFactory
) -> None:
    serve = await start_ready(upstream, serve_factory, ZERO_AUTO_RESET="true")
    old_version, _ = replica_versions(serve.replica_file)
    [(old_slot, _, _)] = await app_slots(upstream)

    await pg_execute(upstream, *RESET_TX)
    await eventually(
        lambda: (v := current_replica_version(serve)) is not None and v != old_version,
        "a replica with a new replicaVersion",
    )
    await serve.wait_ready()

    async def only_the_new_slot() -> bool:
        slots = [name for name, _, _ in await app_slots(upstream)]
        return len(slots) == 1 and slots != [old_slot]

    # The reference drops it as soon as the new stream starts; 10 s is generous.
    await eventually(only_the_new_slot, f"old slot {old_slot} to be dropped", timeout_s=10)
    await serve.terminate()
