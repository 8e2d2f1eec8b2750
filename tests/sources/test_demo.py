"""The synthetic demo source: schema first, then valid, increasing, consistent transactions."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest

from app.protocol.canonical_json import dumps, loads
from app.protocol.lexi import from_lexi, to_lexi
from app.protocol.messages import (
    Begin,
    Commit,
    Data,
    Status,
    parse_change_source_message,
)
from app.sources.base import ChangeSourceError
from app.sources.demo import DemoChangeSource, DemoChangeStream
from app.sources.demo_state import DemoStateError

WALL_MS = 1_764_426_733_675.25


class FakeSleep:
    """Records the requested delays and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        await asyncio.sleep(0)


class Tx:
    def __init__(self, begin: Begin, changes: list[Data], commit: Commit) -> None:
        self.begin = begin
        self.changes = changes
        self.commit = commit

    @property
    def watermark(self) -> str:
        return self.commit.watermark

    @property
    def tags(self) -> list[str]:
        return [c.tag for c in self.changes]


def make_demo(state_file: Path, **kwargs: Any) -> DemoChangeSource:
    options: dict[str, Any] = {"seed": 7, "sleep": FakeSleep(), "wall_ms": lambda: WALL_MS}
    options.update(kwargs)
    return DemoChangeSource(state_file, **options)


async def take(stream: DemoChangeStream, count: int) -> tuple[list[Tx], list[Status]]:
    """The next ``count`` transactions, and the statuses seen on the way."""
    txs: list[Tx] = []
    statuses: list[Status] = []
    begin: Begin | None = None
    changes: list[Data] = []
    async for msg in stream:
        if isinstance(msg, Status):
            statuses.append(msg)
        elif isinstance(msg, Begin):
            assert begin is None, "begin inside a transaction"
            begin, changes = msg, []
        elif isinstance(msg, Data):
            assert begin is not None, "data outside a transaction"
            changes.append(msg)
        elif isinstance(msg, Commit):
            assert begin is not None
            assert msg.watermark == begin.commit_watermark
            txs.append(Tx(begin, changes, msg))
            begin = None
            if len(txs) == count:
                break
        else:
            raise AssertionError(f"unexpected message {msg!r}")
    return txs, statuses


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    return tmp_path / "demo" / "state.json"


async def test_the_first_transaction_creates_the_schema(state_file: Path) -> None:
    stream = await make_demo(state_file).start_stream("01", [])
    [tx], _ = await take(stream, 1)
    assert tx.begin.body == {"tag": "begin", "json": "p"}
    assert tx.commit.body == {"tag": "commit", "commitTimeMs": int(WALL_MS)}
    assert tx.tags == ["create-table", "create-index", "create-table", "create-index"]
    issues, issues_pk = tx.changes[0].body, tx.changes[1].body
    assert issues["spec"]["name"] == "issues"
    assert issues["spec"]["primaryKey"] == ["id"]
    assert issues["spec"]["columns"]["id"] == {"pos": 1, "dataType": "text", "notNull": True}
    assert issues["spec"]["columns"]["priority"] == {"pos": 4, "dataType": "int4", "notNull": False}
    assert issues["metadata"] == {"rowKey": {"columns": ["id"]}}
    assert "backfill" not in issues  # custom-style sources never announce backfills
    assert issues_pk["spec"] == {
        "schema": "public",
        "tableName": "issues",
        "name": "issues_pkey",
        "unique": True,
        "columns": {"id": "ASC"},
    }
    assert set(tx.changes[2].body["spec"]["columns"]) == {"id", "issue_id", "body", "created"}


async def test_row_transactions_follow_the_schema(state_file: Path) -> None:
    stream = await make_demo(state_file, rows_per_tx=(2, 4)).start_stream("01", [])
    txs, _ = await take(stream, 30)
    for tx in txs[1:]:
        assert 2 <= len(tx.changes) <= 4
        assert set(tx.tags) <= {"insert", "update", "delete"}
        for change in tx.changes:
            relation = change.body["relation"]
            assert relation["rowKey"] == {"columns": ["id"], "type": "default"}
            assert relation["name"] in ("issues", "comments")


async def test_watermarks_strictly_increase_above_after_watermark(state_file: Path) -> None:
    after = to_lexi(5000)
    stream = await make_demo(state_file).start_stream(after, [])
    txs, _ = await take(stream, 50)
    values = [from_lexi(tx.watermark) for tx in txs]
    assert values[0] == 5001
    assert all(a < b for a, b in itertools.pairwise(values))


async def test_every_message_is_a_validated_change_source_message(state_file: Path) -> None:
    stream = await make_demo(state_file, status_every=3).start_stream("01", [])
    seen = 0
    async for msg in stream:
        # What the source yields is exactly what parsing its JSON gives back.
        assert parse_change_source_message(loads(dumps(msg.as_list()))) == msg
        seen += 1
        if seen == 300:
            break


def row_of(change: Data) -> tuple[str, str]:
    """(table, id) of the row an insert, update or delete touches."""
    row = change.body["key"] if change.tag == "delete" else change.body["new"]
    return change.body["relation"]["name"], row["id"]


def replay(live: set[tuple[str, str]], txs: list[Tx]) -> dict[str, int]:
    """Applies the row changes to ``live``, checking that only live rows are touched."""
    counts = {"insert": 0, "update": 0, "delete": 0}
    for tx in txs:
        for change in tx.changes:
            counts[change.tag] += 1
            row = row_of(change)
            if change.tag == "insert":
                live.add(row)
                continue
            assert row in live, f"{change.tag} of a row that was never inserted: {row}"
            if change.tag == "update":
                assert change.body["key"] is None
            else:
                live.remove(row)
    return counts


async def test_updates_and_deletes_only_touch_inserted_rows(state_file: Path) -> None:
    stream = await make_demo(state_file, rows_per_tx=(1, 6)).start_stream("01", [])
    txs, _ = await take(stream, 400)
    counts = replay(set(), txs[1:])
    assert all(n > 20 for n in counts.values()), counts


async def test_a_new_stream_forgets_rows_of_transactions_that_were_not_stored(
    state_file: Path,
) -> None:
    source = make_demo(state_file)
    txs, _ = await take(await source.start_stream("01", []), 60)
    stored = txs[:30]  # the change log got these; the other 30 were lost with the stream
    live: set[tuple[str, str]] = set()
    replay(live, stored[1:])
    resumed, _ = await take(await source.start_stream(stored[-1].watermark, []), 100)
    assert "create-table" not in resumed[0].tags
    counts = replay(live, resumed)
    assert counts["update"] + counts["delete"] > 0


async def test_acks_are_recorded(state_file: Path) -> None:
    source = make_demo(state_file)
    stream = await source.start_stream("01", [])
    [tx], _ = await take(stream, 1)
    stream.ack(["status", tx.commit.body, {"watermark": tx.watermark}])
    assert stream.acked_watermark == tx.watermark
    assert source.acked_watermark == tx.watermark


async def test_a_status_asking_for_an_ack_follows_every_nth_transaction(
    state_file: Path,
) -> None:
    stream = await make_demo(state_file, status_every=3).start_stream("01", [])
    txs, statuses = await take(stream, 11)
    # The schema transaction is not counted; row transactions 3, 6 and 9 are.
    assert [s.watermark for s in statuses] == [txs[i].watermark for i in (3, 6, 9)]
    assert all(s.ack and s.body == {"ack": True} for s in statuses)


async def test_transactions_are_paced_with_the_injected_sleep(state_file: Path) -> None:
    sleep = FakeSleep()
    stream = await make_demo(state_file, rate_per_s=20.0, sleep=sleep).start_stream("01", [])
    await take(stream, 11)
    # One pause between consecutive transactions, none before the first.
    assert sleep.delays == [0.05] * 10


async def test_close_stops_iteration_even_during_a_pause(state_file: Path) -> None:
    never = asyncio.Event()

    async def stuck_sleep(seconds: float) -> None:
        await never.wait()

    stream = await make_demo(state_file, sleep=stuck_sleep).start_stream("01", [])
    await take(stream, 1)  # the schema; the next transaction waits for the pause
    reader = asyncio.create_task(take(stream, 1))
    await asyncio.sleep(0)
    assert not reader.done()
    await stream.close()
    await stream.close()
    assert await reader == ([], [])


async def test_starting_a_new_stream_closes_the_previous_one(state_file: Path) -> None:
    source = make_demo(state_file)
    first = await source.start_stream("01", [])
    await take(first, 1)
    await source.start_stream("01", [])
    assert first.closed
    assert await take(first, 1) == ([], [])


async def test_backfill_requests_are_rejected(state_file: Path) -> None:
    request = {"table": {"schema": "public", "name": "issues", "metadata": None}, "columns": {}}
    with pytest.raises(ChangeSourceError, match="backfill"):
        await make_demo(state_file).start_stream("01", [request])


# --- persistence ------------------------------------------------------------------------


async def test_watermarks_keep_increasing_after_a_restart_with_an_older_change_log(
    state_file: Path,
) -> None:
    first_txs, _ = await take(await make_demo(state_file).start_stream("01", []), 5)
    last = first_txs[-1].watermark
    # A new process; the change log is behind (e.g. restored): after_watermark is old.
    restarted = make_demo(state_file)
    txs, _ = await take(await restarted.start_stream("01", []), 5)
    assert txs[0].watermark > last
    # It cannot know the schema reached that change log, so it creates it again.
    assert txs[0].tags[0] == "create-table"


async def test_a_restart_with_the_schema_stored_goes_straight_to_rows(state_file: Path) -> None:
    txs, _ = await take(await make_demo(state_file).start_stream("01", []), 5)
    restarted = make_demo(state_file)
    resumed, _ = await take(await restarted.start_stream(txs[-1].watermark, []), 3)
    assert resumed[0].watermark > txs[-1].watermark
    assert "create-table" not in resumed[0].tags
    # Ids are not persisted: it inserts until it knows rows again.
    assert resumed[0].tags == ["insert"] * len(resumed[0].tags)


async def test_a_change_log_ahead_of_the_state_file_wins(state_file: Path) -> None:
    await take(await make_demo(state_file).start_stream("01", []), 2)
    ahead = to_lexi(10**9)
    txs, _ = await take(await make_demo(state_file).start_stream(ahead, []), 1)
    assert from_lexi(txs[0].watermark) == 10**9 + 1
    assert "create-table" not in txs[0].tags


async def test_the_schema_is_sent_again_when_it_was_not_stored(state_file: Path) -> None:
    source = make_demo(state_file)
    [schema_tx], _ = await take(await source.start_stream("01", []), 1)
    # The stream broke before the schema transaction was stored.
    [again], _ = await take(await source.start_stream("01", []), 1)
    assert again.tags[0] == "create-table"
    assert again.watermark > schema_tx.watermark


async def test_the_state_file_is_small_json_written_atomically(state_file: Path) -> None:
    txs, _ = await take(await make_demo(state_file, reserve_block=4).start_stream("01", []), 10)
    state = loads(state_file.read_text())
    assert state["version"] == 1
    assert from_lexi(state["reservedThrough"]) >= from_lexi(txs[-1].watermark)
    assert state["schemaWatermark"] == txs[0].watermark
    assert [p.name for p in state_file.parent.iterdir()] == [state_file.name]


async def test_an_unreadable_state_file_is_reported(state_file: Path) -> None:
    state_file.parent.mkdir(parents=True)
    state_file.write_text('{"version": 1, "reservedThrough": "not a watermark"}')
    with pytest.raises(DemoStateError, match="state file"):
        make_demo(state_file)
