"""``serve`` failure paths with a Postgres upstream: each ends with a clear error, or
recovers without losing anything.

* Start-up failures (upstream unreachable, unknown publication, a role without the
  privileges replication needs, a replica whose slot is gone without auto-reset)
  exit with code 1 and one ``changestreamer: …`` line on stderr that says what is
  wrong.
* A slot dropped between runs with auto-reset on is a fresh initial sync with a new
  replicaVersion.
* A slot dropped while serving (without auto-reset) stops the process with an error
  naming the slot, as the reference's abort does.
* A replication connection ended by the server mid-stream (``pg_terminate_backend``
  on the walsender) is reconnected from the last stored commit: nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import signal
import time
from collections.abc import AsyncIterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests import waiting
from tests.serve_pg.conftest import (
    Serve,
    ServeFactory,
    Writer,
    _http_status,
    app_slots,
    create_workload_schema,
    eventually,
    free_port,
    pg_execute,
    pg_rows,
    replica_versions,
    start_ready,
    stored_xids,
    wait_until_replica_matches,
)

WEAK_ROLE = "hpf_weak"


def error_line(serve: Serve) -> str:
    """The one line the CLI prints for a start-up failure."""
    lines = [line for line in serve.output().splitlines() if line.startswith("changestreamer: ")]
    assert len(lines) == 1, f"expected one error line:\n{serve.output()}"
    return lines[0]


async def test_unreachable_upstream_exits_1_naming_the_upstream(
    serve_factory: ServeFactory,
) -> None:
    port = free_port()  # nothing listens there
    serve = serve_factory(f"postgresql://postgres@127.0.0.1:{port}/hpf_nowhere")
    serve.start()
    assert await serve.wait_exit() == 1
    line = error_line(serve)
    assert f"upstream postgres@127.0.0.1:{port}/hpf_nowhere" in line
    assert "connection refused" in line.lower(), line


async def test_an_upstream_option_the_replication_client_refuses_exits_1_naming_it(
    serve_factory: ServeFactory,
) -> None:
    # hostaddr is libpq's; our replication client does not take it, so no upstream
    # connection does (conninfo), and the service says so at start-up.
    serve = serve_factory("postgresql://postgres@127.0.0.1/hpf_x?hostaddr=127.0.0.1")
    serve.start()
    assert await serve.wait_exit() == 1
    line = error_line(serve)
    assert "upstream postgres@127.0.0.1:5432/hpf_x" in line, line
    assert "does not support hostaddr" in line, line


async def test_missing_publication_exits_1_naming_it(
    upstream: str, serve_factory: ServeFactory
) -> None:
    await create_workload_schema(upstream)
    serve = serve_factory(upstream, ZERO_APP_PUBLICATIONS="nope")
    serve.start()
    assert await serve.wait_exit() == 1
    line = error_line(serve)
    assert "publication" in line.lower(), line
    assert "nope" in line, line
    assert not serve.replica_file.exists()
    assert await app_slots(upstream) == [], "a failed start must not leave a slot behind"


@pytest.fixture
async def weak_role(upstream: str) -> AsyncIterator[str]:
    """A LOGIN role with only CONNECT on the upstream: the URL to connect as it."""
    admin = make_conninfo(upstream, dbname="postgres")
    dbname = conninfo_to_dict(upstream)["dbname"]

    async def drop() -> None:
        with contextlib.suppress(psycopg.errors.UndefinedObject):
            await pg_execute(upstream, f"DROP OWNED BY {WEAK_ROLE}")
        await pg_execute(admin, f"DROP ROLE IF EXISTS {WEAK_ROLE}")

    await drop()
    await pg_execute(
        admin,
        f"CREATE ROLE {WEAK_ROLE} LOGIN",
        f'GRANT CONNECT ON DATABASE "{dbname}" TO {WEAK_ROLE}',
    )
    try:
        yield make_conninfo(upstream, user=WEAK_ROLE)
    finally:
        await drop()


async def test_role_without_replication_privilege_exits_1_with_the_reason(
    upstream: str, weak_role: str, serve_factory: ServeFactory
) -> None:
    await create_workload_schema(upstream)
    serve = serve_factory(weak_role)
    serve.start()
    assert await serve.wait_exit() == 1
    line = error_line(serve)
    assert f"upstream {WEAK_ROLE}@127.0.0.1" in line, line
    assert "permission denied" in line.lower() or "privilege" in line.lower(), line
    assert await app_slots(upstream) == []


async def _first_run(upstream: str, serve: Serve) -> str:
    """Syncs and serves once, stops cleanly; returns the replicaVersion."""
    serve.start()
    await serve.wait_ready()
    version, _ = replica_versions(serve.replica_file)
    await serve.terminate()
    return version


async def test_slot_dropped_between_runs_without_auto_reset_exits_1(
    upstream: str, serve_factory: ServeFactory
) -> None:
    await create_workload_schema(upstream)
    serve = serve_factory(upstream, ZERO_AUTO_RESET="false")
    version = await _first_run(upstream, serve)
    [(slot, _, _)] = await app_slots(upstream)
    await pg_execute(upstream, f"SELECT pg_drop_replication_slot('{slot}')")

    serve.start()
    assert await serve.wait_exit() == 1
    line = error_line(serve)
    assert f"replica {serve.replica_file} cannot continue" in line, line
    assert slot in line, line
    assert "ZERO_AUTO_RESET" in line, line
    # Nothing was touched: the replica is still the old one, and no new slot exists.
    assert replica_versions(serve.replica_file)[0] == version
    assert await app_slots(upstream) == []


async def test_slot_dropped_between_runs_with_auto_reset_resyncs_a_new_replica(
    upstream: str, serve_factory: ServeFactory
) -> None:
    await create_workload_schema(upstream)
    serve = serve_factory(upstream, ZERO_AUTO_RESET="true")
    version = await _first_run(upstream, serve)
    [(slot, _, _)] = await app_slots(upstream)
    await pg_execute(upstream, f"SELECT pg_drop_replication_slot('{slot}')")
    # Written while nothing replicates: only a new initial sync can bring it over.
    await pg_execute(upstream, "UPDATE items SET s = 'while down' WHERE id <= 10")

    serve.start()
    await serve.wait_ready()
    new_version, _ = replica_versions(serve.replica_file)
    assert new_version > version
    assert len(await app_slots(upstream)) == 1
    # Ready does not wait for the stream to connect: the walsender takes the new
    # slot shortly after (bounded wait).
    await _walsender_pid(upstream)
    await wait_until_replica_matches(upstream, serve.replica_file)
    # And it streams again.
    await pg_execute(upstream, "INSERT INTO ledger VALUES (1, 1)")
    await wait_until_replica_matches(upstream, serve.replica_file)
    await serve.terminate()


async def _walsender_pid(upstream: str) -> int:
    async def active() -> int | None:
        slots = await app_slots(upstream)
        return slots[0][2] if slots else None

    pid: int = await eventually(active, "an active walsender on the slot")
    return pid


async def test_walsender_terminated_mid_stream_reconnects_and_loses_nothing(
    upstream: str, serve_factory: ServeFactory
) -> None:
    serve = await start_ready(upstream, serve_factory)
    writer = Writer(upstream, big_at=15, big_rows=500)
    writer.start()
    try:
        for round_ in range(2):
            pid = await _walsender_pid(upstream)
            await writer.wait_stored(serve.change_db_file, 20 * (round_ + 1))
            [(ok,)] = await pg_rows(upstream, f"SELECT pg_terminate_backend({pid})")
            assert ok
            # A new walsender (a reconnect, not the old one) takes the slot again.
            await eventually(
                functools.partial(_other_walsender, upstream, pid), "a reconnected walsender"
            )
    finally:
        await writer.finish()
    await wait_until_replica_matches(upstream, serve.replica_file)
    stored = stored_xids(serve.change_db_file)
    assert len(stored) == len(set(stored)), "a transaction was stored twice"
    assert set(writer.committed.values()) <= set(stored)
    assert serve.alive()
    assert "change stream failed" in serve.output()
    await serve.terminate()


async def _other_walsender(upstream: str, old_pid: int) -> bool:
    slots = await app_slots(upstream)
    return bool(slots) and slots[0][2] not in (None, old_pid)


async def drop_active_slot(upstream: str, slot: str, timeout_s: float = 10.0) -> None:
    """Ends the walsender and drops the slot, racing the service's reconnects.

    pg_drop_replication_slot holds the slot while it drops it, so the service's
    takeover of the slot (which ends whatever backend holds it) may end ours:
    then reconnect and try again."""

    async def dropped() -> bool:
        async with await psycopg.AsyncConnection.connect(upstream, autocommit=True) as conn:
            try:
                await conn.execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                    "WHERE slot_name = %s AND active_pid IS NOT NULL",
                    (slot,),
                )
                await conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                return True
            except (psycopg.errors.ObjectInUse, psycopg.errors.AdminShutdown):
                return False

    await waiting.eventually(dropped, f"slot {slot} dropped", timeout_s)


async def test_slot_dropped_while_running_without_auto_reset_exits_with_an_error(
    upstream: str, serve_factory: ServeFactory
) -> None:
    serve = await start_ready(upstream, serve_factory, ZERO_AUTO_RESET="false")
    [(slot, _, _)] = await app_slots(upstream)
    await drop_active_slot(upstream, slot)

    # A correct service stops at its first reconnect; 15 s covers several of ours.
    code = await serve.wait_exit(timeout_s=15)
    assert code not in (0, -signal.SIGTERM), "a fatal stop must not look like success"
    assert re.search(rf"replication slot {slot} (does not exist|is missing)", serve.output())


async def test_sigterm_cancels_a_request_still_running_after_the_shutdown_timeout(
    upstream: str, serve_factory: ServeFactory
) -> None:
    serve = await start_ready(upstream, serve_factory, CHANGESTREAMER_SHUTDOWN_TIMEOUT_SECONDS="1")
    url = f"http://127.0.0.1:{serve.port}/profz?seconds=60"
    # Two 60 s profiles: one runs, the other is refused (409) once the first began.
    both = [asyncio.create_task(asyncio.to_thread(_http_status, url, 90)) for _ in range(2)]
    refused = await eventually(
        lambda: [t for t in both if t.done() and t.result() == 409], "one profile refused"
    )
    [running] = [t for t in both if t not in refused]
    started = time.monotonic()
    await serve.terminate(timeout_s=20)  # without the bound it waited out the 60 s
    assert time.monotonic() - started < 20
    assert await running != 200
    assert "timeout graceful shutdown exceeded" in serve.output()
