"""Restart safety: SIGKILL ``serve`` while Postgres takes writes, restart it, twice.

A writer commits many small transactions (inserts, updates, deletes) and one big one
the whole time. After each kill, with the service dead and the slot idle:

* the slot's ``confirmed_flush_lsn`` has moved on since the last look (acks are sent
  once changes are stored), and
* it never passed an unstored transaction: every transaction the writer saw commit is
  either in the change DB or still in the slot (peeked, which leaves the slot alone).
  A transaction in neither would be lost for good on restart.

After the last restart the writer stops, the service catches up, and the replica
must equal Postgres row by row in every column, with every writer transaction
stored exactly once in the change DB, and no re-sync along the way.
"""

from __future__ import annotations

import functools

from app.protocol.lexi import parse_state_version
from tests.serve_pg.conftest import (
    Serve,
    ServeFactory,
    Writer,
    app_slots,
    change_db_watermark,
    eventually,
    pg_rows,
    replica_versions,
    start_ready,
    stored_xids,
    wait_until_replica_matches,
)

KILLS = 2
STORED_PER_ROUND = 40
BIG_AT = STORED_PER_ROUND + 5


async def slot_pending_xids(upstream: str, slot: str) -> set[int]:
    """The transactions Postgres would still send from the slot (not consumed)."""
    rows = await pg_rows(
        upstream,
        "SELECT DISTINCT xid::text::bigint FROM pg_logical_slot_peek_binary_changes("
        f"'{slot}', NULL, NULL, 'proto_version', '1', "
        "'publication_names', '_hpf_metadata_0,_hpf_public_0')",
    )
    return {xid for (xid,) in rows}


async def _flush_moved_past(upstream: str, previous: int) -> bool:
    [(_, flush, _)] = await app_slots(upstream)
    return flush is not None and flush > previous


async def idle_slot(upstream: str) -> tuple[str, int]:
    """Once the killed service's walsender is gone: (slot, confirmed_flush_lsn)."""

    async def idle() -> tuple[str, int] | None:
        [(slot, flush, pid)] = await app_slots(upstream)
        return (slot, flush) if pid is None and flush is not None else None

    found: tuple[str, int] = await eventually(idle, "the slot to be released", 30)
    return found


async def check_after_kill(upstream: str, serve: Serve, writer: Writer, previous_flush: int) -> int:
    slot, flush = await idle_slot(upstream)
    # Read after the kill: nothing can be stored or acked any more.
    committed = set(writer.committed.values())
    stored = stored_xids(serve.change_db_file)
    last_stored = parse_state_version(change_db_watermark(serve.change_db_file)).major
    pending = await slot_pending_xids(upstream, slot)

    assert flush > previous_flush, "confirmed_flush_lsn did not advance while changes were stored"
    lost = committed - set(stored) - pending
    assert not lost, (
        f"confirmed_flush_lsn {flush:X} is past {len(lost)} committed transactions that the "
        f"change DB (lastWatermark LSN {last_stored:X}) never stored: xids {sorted(lost)[:10]}"
    )
    assert len(stored) == len(set(stored)), "a transaction was stored twice"
    return flush


async def test_sigkill_twice_during_writes_loses_and_repeats_nothing(
    upstream: str, serve_factory: ServeFactory
) -> None:
    serve = await start_ready(upstream, serve_factory)
    replica_version, _ = replica_versions(serve.replica_file)
    [(_, flush, _)] = await app_slots(upstream)
    assert flush is not None

    writer = Writer(upstream, big_at=BIG_AT, big_rows=1500)
    writer.start()
    try:
        for kill in range(1, KILLS + 1):
            await writer.wait_stored(serve.change_db_file, STORED_PER_ROUND * kill)
            if kill == 1:
                # Right after the big transaction commits: likely while it is decoded,
                # stored or applied to the replica.
                await eventually(lambda: BIG_AT in writer.committed, "the big transaction")
            # Acks follow storage asynchronously: a burst stored in one group commit
            # can be on disk a moment before its ack reaches Postgres.
            await eventually(
                functools.partial(_flush_moved_past, upstream, flush),
                "an ack to move confirmed_flush_lsn",
            )
            serve.kill()
            flush = await check_after_kill(upstream, serve, writer, flush)
            serve.start()
            await serve.wait_ready()
        # Writes continue across the last restart, and are streamed again.
        await writer.wait_stored(serve.change_db_file, STORED_PER_ROUND * (KILLS + 1))
    finally:
        await writer.finish()

    await wait_until_replica_matches(upstream, serve.replica_file)
    stored = stored_xids(serve.change_db_file)
    assert len(stored) == len(set(stored)), "a transaction was stored twice"
    missing = set(writer.committed.values()) - set(stored)
    assert not missing, f"committed but never stored: xids {sorted(missing)[:10]}"
    # The restarts resumed the same replica; a re-sync would hide losses.
    assert replica_versions(serve.replica_file)[0] == replica_version
    assert serve.runs == KILLS + 1
    assert [serve.output(run).count("initial sync of") for run in range(1, KILLS + 2)] == [
        1,
        *[0] * KILLS,
    ]
    await serve.terminate()
