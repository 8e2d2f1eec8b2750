"""Storer: group commit of whole transactions, durability, back pressure, catch-up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from app import progress
from app.protocol.canonical_json import dumps, loads
from app.protocol.codec import reconstruct
from app.protocol.errors import ErrorType
from app.protocol.lexi import to_lexi
from app.protocol.pieces import Text
from app.storage import ChangeDb, ChangeLog, OwnershipLostError, Replication, StoredRow
from app.streamer.downstream import Downstream
from app.streamer.storer import Storer, WedgedError
from app.streamer.subscriber import Change, Mode, Subscriber
from app.streamer.timers import ManualTimers

from ..waiting import eventually
from .conftest import OWNER, REPLICA_VERSION
from .helpers import collect, drain, make_sub, settle, whole

# Entries: (watermark, tag, change text, body); ``change`` makes the service's Change.


def change(entry: tuple[str, str, str, object]) -> Change:
    w, tag, text, _ = entry
    return Change(w, tag, reconstruct(w, tag, text))


def begin(w: str, **extra: object) -> tuple[str, str, str, dict[str, object]]:
    body = {"tag": "begin", **extra}
    return w, "begin", dumps(body), body


def insert(w: str, i: int) -> tuple[str, str, str, None]:
    change = {"tag": "insert", "relation": {"schema": "public", "name": "t"}, "new": {"id": i}}
    return w, "insert", dumps(change), None


def commit(w: str) -> tuple[str, str, str, None]:
    return w, "commit", dumps({"tag": "commit"}), None


def rollback(w: str) -> tuple[str, str, str, None]:
    return w, "rollback", dumps({"tag": "rollback"}), None


def txn(w: str, n: int = 1) -> list[tuple[str, str, str, object]]:
    return [begin(w), *[insert(w, i) for i in range(n)], commit(w)]


class WedgingLog(ChangeLog):
    """A change log whose group commits hang once ``wedge`` is called, as on a disk
    that stopped answering, until ``unwedge``: the storer runs but consumes nothing
    more."""

    def __init__(self, db: ChangeDb) -> None:
        super().__init__(db)
        self.hung = asyncio.Event()  # a group commit is hanging
        self._going = asyncio.Event()
        self._going.set()

    def wedge(self) -> None:
        self._going.clear()

    def unwedge(self) -> None:
        self._going.set()

    async def commit_rows(self, owner: str, rows: Sequence[StoredRow], last_watermark: str) -> None:
        if not self._going.is_set():
            self.hung.set()
            await self._going.wait()
        await super().commit_rows(owner, rows, last_watermark)


class Harness:
    def __init__(self, db: ChangeDb, *, change_log: ChangeLog | None = None, **kw: Any) -> None:
        self.timers = ManualTimers()
        self.durable: list[str] = []
        self.fatal: list[BaseException] = []
        self.log = change_log or ChangeLog(db)
        self.storer = Storer(
            change_log=self.log,
            replication=Replication(db),
            owner=OWNER,
            replica_version=REPLICA_VERSION,
            durable_watermark=REPLICA_VERSION,
            timers=self.timers,
            on_durable=self.durable.append,
            on_fatal=self.fatal.append,
            **kw,
        )
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.storer.run())

    def feed(self, entries: Sequence[tuple[str, str, str, object]]) -> None:
        """The entries as the service hands them over: its changes, one at a time."""
        for entry in entries:
            self.storer.append([change(entry)])

    async def until_durable(self, w: str) -> None:
        await asyncio.wait_for(self.storer.wait_durable(w), 10)

    async def rows(self) -> list[tuple[str, int, Text]]:
        out = []
        async for batch in self.log.read("00", "zz"):
            out += [(w, p, c) for w, p, c, _ in batch]
        return out

    async def close(self) -> None:
        await self.storer.stop()
        if self.task is not None:
            await asyncio.wait_for(self.task, 10)


@pytest.fixture
async def harness(change_db: ChangeDb) -> AsyncIterator[Harness]:
    h = Harness(change_db)
    h.start()
    yield h
    await h.close()


async def test_whole_transactions_are_stored_with_positions_and_head(harness: Harness) -> None:
    harness.feed(txn("02", 3) + txn("03", 1))
    await harness.until_durable("03")
    rows = await harness.rows()
    assert [(w, p) for w, p, _ in rows] == [
        ("01", 0),
        ("01", 1),
        ("02", 0),
        ("02", 1),
        ("02", 2),
        ("02", 3),
        ("02", 4),
        ("03", 0),
        ("03", 1),
        ("03", 2),
    ]
    assert loads(whole(rows[3][2])) == {
        "tag": "insert",
        "relation": {"schema": "public", "name": "t"},
        "new": {"id": 0},
    }
    state = await Replication(harness.log.db).state()
    assert state is not None
    assert state.last_watermark == "03"
    assert harness.durable[-1] == "03"


async def test_a_rolled_back_transaction_stores_nothing(harness: Harness) -> None:
    harness.feed([begin("02"), insert("02", 1), rollback("02"), *txn("03")])
    await harness.until_durable("03")
    assert {w for w, _, _ in await harness.rows()} == {"01", "03"}
    assert "02" not in harness.durable


async def test_skip_ack_transactions_are_stored_but_not_reported_for_acks(harness: Harness) -> None:
    harness.feed([begin("02.01", skipAck=True), insert("02.01", 1), commit("02.01")])
    await harness.until_durable("02.01")
    assert harness.durable == []
    assert "02.01" in {w for w, _, _ in await harness.rows()}


async def test_an_aborted_transaction_stores_nothing_and_the_next_one_is_stored(
    harness: Harness,
) -> None:
    harness.feed([begin("02"), insert("02", 1)])
    harness.storer.abort()
    harness.feed(txn("03"))
    await harness.until_durable("03")
    assert {w for w, _, _ in await harness.rows()} == {"01", "03"}


@pytest.fixture
async def in_pieces(change_db: ChangeDb) -> AsyncIterator[Harness]:
    """A storer that writes a transaction in pieces past 2,000 bytes."""
    h = Harness(change_db, open_tx_flush_bytes=2000)
    h.start()
    yield h
    await h.close()


@pytest.mark.parametrize("end", ["rollback", "abort"])
async def test_a_big_transaction_written_in_pieces_is_dropped_whole(
    in_pieces: Harness, end: str
) -> None:
    """Ended by the upstream's rollback or cut off by the stream (abort)."""
    h = in_pieces
    big = [begin("02"), *[insert("02", i) for i in range(200)]]
    h.feed(big)
    fed = sum(len(text) for _, _, text, _ in big)
    await eventually(lambda: h.storer.queued_bytes < fed, "its first pieces go to the log")
    if end == "rollback":
        h.feed([rollback("02")])
    else:
        h.storer.abort()
    h.feed(txn("03"))
    await h.until_durable("03")
    assert {w for w, _, _ in await h.rows()} == {"01", "03"}
    assert h.durable == ["03"]


@pytest.mark.parametrize("rows_in", ["one at a time", "in runs"])
async def test_a_big_transaction_written_in_pieces_keeps_every_position(
    in_pieces: Harness, rows_in: str
) -> None:
    h = in_pieces
    inserts = [insert("04", i) for i in range(200)]
    h.feed([begin("04")])
    if rows_in == "in runs":  # the main loop hands over runs of rows
        for k in range(0, len(inserts), 30):
            h.storer.append([change(e) for e in inserts[k : k + 30]])
    else:
        h.feed(inserts)
    h.feed([commit("04"), *txn("05")])
    await h.until_durable("05")
    rows = [(w, p) for w, p, _ in await h.rows() if w == "04"]
    assert rows == [("04", p) for p in range(202)]
    assert h.durable == ["04", "05"]


async def test_row_changes_outside_a_transaction_are_refused(change_db: ChangeDb) -> None:
    h = Harness(change_db)
    with pytest.raises(AssertionError, match="outside a transaction"):
        h.storer.append([change(insert("02", 0))])


async def test_queued_bytes_count_what_waits_and_fall_to_zero(in_pieces: Harness) -> None:
    h = in_pieces
    open_tx = [begin("02"), *[insert("02", i) for i in range(5)]]
    h.feed(open_tx)
    assert h.storer.queued_bytes == sum(len(text) for _, _, text, _ in open_tx)
    h.feed([rollback("02")])  # never queued: its bytes are free at once
    assert h.storer.queued_bytes == 0
    big = [begin("03"), *[insert("03", i) for i in range(200)]]
    h.feed(big)  # in pieces
    fed = sum(len(text) for _, _, text, _ in big)
    await eventually(lambda: h.storer.queued_bytes < fed, "its first pieces go to the log")
    h.feed([rollback("03"), *txn("04")])
    await h.until_durable("04")
    assert h.storer.queued_bytes == 0
    assert {w for w, _, _ in await h.rows()} == {"01", "04"}


async def test_ownership_taken_over_stops_the_storer_and_stores_nothing(
    change_db: ChangeDb,
) -> None:
    h = Harness(change_db)
    await Replication(change_db).assume_ownership("someone-else", None)
    h.start()
    h.feed(txn("02"))
    assert h.task is not None
    with pytest.raises(OwnershipLostError, match="assumed by someone-else"):
        await asyncio.wait_for(h.task, 10)
    assert {w for w, _, _ in await h.rows()} == {"01"}


async def test_back_pressure_gate_opens_once_the_queue_drains(change_db: ChangeDb) -> None:
    h = Harness(change_db, back_pressure_bytes=1000)
    assert h.storer.ready_for_more() is None  # not running: no gate
    h.start()
    await settle()
    h.feed([begin("02"), *[insert("02", i) for i in range(50)], commit("02")])
    gate = h.storer.ready_for_more()
    assert gate is not None
    await asyncio.wait_for(gate, 10)
    assert h.storer.ready_for_more() is None
    await h.close()


async def test_a_wedged_change_log_fails_the_gate_after_the_statement_timeout(
    change_db: ChangeDb,
) -> None:
    wedging = WedgingLog(change_db)
    h = Harness(change_db, change_log=wedging, back_pressure_bytes=100, statement_timeout_s=20)
    h.start()
    wedging.wedge()
    h.feed(txn("02"))  # taken, and its commit hangs: nothing more is consumed
    await asyncio.wait_for(wedging.hung.wait(), 10)
    h.feed(txn("03", 5))
    gate = h.storer.ready_for_more()
    assert gate is not None
    assert h.timers.pending() == [20.0]
    h.timers.advance(20)
    with pytest.raises(WedgedError, match="No statement processed within the last 20000ms"):
        await gate
    # A stale, rejected gate is never handed out again.
    fresh = h.storer.ready_for_more()
    assert fresh is not None
    assert fresh is not gate
    wedging.unwedge()
    await h.close()


# -- catch-up ---------------------------------------------------------------


def subscribe(h: Harness, watermark: str, mode: Mode = "serving") -> tuple[Subscriber, Downstream]:
    sub, ds = make_sub(watermark, mode=mode)
    h.storer.catchups.catchup(sub, mode)
    return sub, ds


async def test_catch_up_starts_at_once_between_transactions_and_covers_what_was_enqueued(
    harness: Harness,
) -> None:
    harness.feed(txn("02") + txn("03"))
    sub, ds = subscribe(harness, "01")
    msgs = await collect(ds, 7)
    assert [m[0] for m in msgs] == ["status", "begin", "data", "commit", "begin", "data", "commit"]
    assert msgs[-1] == ["commit", {"tag": "commit"}, {"watermark": "03"}]
    await eventually(lambda: not sub.backlogged, "the subscriber is live")


async def test_catch_up_waits_for_the_open_transaction_and_includes_it(harness: Harness) -> None:
    harness.feed([begin("02"), insert("02", 1)])
    _sub, ds = subscribe(harness, "01")
    await eventually(lambda: len(harness.storer.catchups.parked) == 1, "the catch-up is parked")
    assert drain(ds, ack=False) == []  # parked: nothing, not even the status
    harness.feed([commit("02")])
    msgs = await collect(ds, 4)
    assert [m[0] for m in msgs] == ["status", "begin", "data", "commit"]


@pytest.mark.parametrize("ending", ["rollback", "abort"])
async def test_catch_up_parked_in_a_transaction_is_served_when_it_ends_without_commit(
    harness: Harness, ending: str
) -> None:
    harness.feed([*txn("02"), begin("03"), insert("03", 1)])
    _sub, ds = subscribe(harness, "01")
    await eventually(lambda: len(harness.storer.catchups.parked) == 1, "the catch-up is parked")
    assert drain(ds, ack=False) == []
    if ending == "rollback":
        harness.feed([rollback("03")])
    else:
        harness.storer.abort()
    msgs = await collect(ds, 4)
    assert msgs[-1] == ["commit", {"tag": "commit"}, {"watermark": "02"}]


async def test_a_backlog_past_its_bound_is_read_from_the_log_in_another_round(
    harness: Harness,
) -> None:
    """A catching-up subscriber keeps at most its bound of live changes (flow
    control does not wait on one that has acked nothing yet, so the gate does not
    bound it); it reads what it dropped from the change log in another round:
    every transaction once, in order, and then it is live."""
    harness.feed(txn("02") + txn("03"))
    sub, ds = make_sub("01", max_backlog_changes=8)
    harness.storer.catchups.catchup(sub, "serving")
    most = 0
    for i in range(4, 40):
        for entry in txn(f"{i:02d}"):
            live = change(entry)
            sub.send([live])  # forwarded, then handed to the storer, as the service does
            harness.storer.append([live])
            most = max(most, sub.backlog_size)
    assert most <= 8
    assert sub.backlog_drops == 1
    msgs = await collect(ds, 1 + 38 * 3)
    commits = [m[2]["watermark"] for m in msgs if m[0] == "commit"]
    assert commits == [f"{i:02d}" for i in range(2, 40)]
    await eventually(lambda: not sub.backlogged, "the subscriber is live")
    for entry in txn("40"):
        sub.send([change(entry)])
    assert (await collect(ds, 3))[-1] == ["commit", {"tag": "commit"}, {"watermark": "40"}]


@pytest.mark.parametrize("tail_bytes", [0, 1 << 20], ids=["from-the-log", "from-memory"])
async def test_a_subscriber_that_does_not_read_holds_no_catch_up_turn(
    change_db: ChangeDb, tail_bytes: int
) -> None:
    """Catch-ups take turns per batch, not per catch-up: one that waits for its
    subscriber to read the last batch does so outside its turn, so with a single
    turn another subscriber still catches up (and one that closes is let go)."""
    h = Harness(change_db, max_concurrent_catchups=1, catchup_batch=4, tail_bytes=tail_bytes)
    h.start()
    try:
        entries = [e for i in range(2, 12) for e in txn(f"{i:02d}")]
        h.feed(entries)
        await h.until_durable("11")
        stuck, stuck_ds = subscribe(h, "01")  # never reads
        await eventually(lambda: stuck_ds.pushed > 1, "the first batch is sent")
        _reader, ds = subscribe(h, "01")
        msgs = await collect(ds, 1 + len(entries))
        assert msgs[-1] == ["commit", {"tag": "commit"}, {"watermark": "11"}]
        assert stuck.backlogged
        assert stuck_ds.pending > 1
        stuck.close()
        await eventually(lambda: not h.storer.catchups.running, "the stuck catch-up ends")
    finally:
        await h.close()


async def test_catch_up_does_not_include_later_transactions(harness: Harness) -> None:
    harness.feed(txn("02"))
    _sub, ds = subscribe(harness, "01")
    harness.feed(txn("03"))  # after the subscription point: live, not catch-up
    await harness.until_durable("03")
    msgs = await collect(ds, 4)
    await eventually(lambda: not harness.storer.catchups.running, "the catch-up ends")
    assert drain(ds) == []
    assert msgs[-1] == ["commit", {"tag": "commit"}, {"watermark": "02"}]


async def test_a_watermark_older_than_the_log_gets_watermark_too_old(harness: Harness) -> None:
    harness.feed(txn("03"))
    await harness.until_durable("03")
    await harness.log.purge_before("03", OWNER)
    _sub, ds = subscribe(harness, "02")
    msgs = await collect(ds, 1)
    assert msgs == [
        [
            "error",
            {
                "type": int(ErrorType.WATERMARK_TOO_OLD),
                "message": "earliest supported watermark is 03 (requested 02)",
            },
        ]
    ]


async def test_the_replica_version_is_too_old_once_a_purge_took_the_log_s_start(
    harness: Harness,
) -> None:
    harness.feed(txn("02") + txn("03"))
    await harness.until_durable("03")
    _sub, ds = subscribe(harness, REPLICA_VERSION)  # the whole log: fine
    assert [m[0] for m in await collect(ds, 7)][-1] == "commit"
    assert await harness.log.purge_before("03", OWNER) > 0  # transaction 02 is gone
    _sub, ds = subscribe(harness, REPLICA_VERSION)
    # Not 03 onwards with 02 silently missing: the subscriber must restore or resync.
    assert await collect(ds, 1) == [
        [
            "error",
            {
                "type": int(ErrorType.WATERMARK_TOO_OLD),
                "message": f"earliest supported watermark is 03 (requested {REPLICA_VERSION})",
            },
        ]
    ]


async def test_a_backup_replica_older_than_the_log_is_too_old_not_fatal(harness: Harness) -> None:
    # A subscriber's mode comes from the network: it may not stop the service
    # (issue 25; zero's storer resets here for its own in-process backup replicator).
    harness.feed(txn("03"))
    await harness.until_durable("03")
    await harness.log.purge_before("03", OWNER)
    _sub, ds = subscribe(harness, "02", mode="backup")
    assert await collect(ds, 1) == [
        [
            "error",
            {
                "type": int(ErrorType.WATERMARK_TOO_OLD),
                "message": "earliest supported watermark is 03 (requested 02)",
            },
        ]
    ]
    assert harness.fatal == []


@pytest.mark.parametrize("mode", ["serving", "backup"])
async def test_a_subscriber_ahead_of_the_durable_log_is_caught_up_without_error(
    harness: Harness, mode: Mode
) -> None:
    harness.feed(txn("02"))
    await harness.until_durable("02")
    _sub, ds = subscribe(harness, "05", mode=mode)
    msgs = await collect(ds, 1)
    assert [m[0] for m in msgs] == ["status"]
    assert harness.fatal == []


async def test_during_a_takeover_catch_ups_wait_and_reach_what_the_old_owner_stored(
    harness: Harness, change_db: ChangeDb
) -> None:
    # The old owner (harness) stores 02 and 03; the new task read the log's end
    # when it was at 02, before the old owner stored 03 (and acked it upstream,
    # so the new stream will never bring it).
    harness.feed(txn("02") + txn("03"))
    await harness.until_durable("03")
    new = Harness(change_db, hold_catchups_until_owned=True)
    new.storer.reset_for_stream("02")
    _sub, ds = subscribe(new, "01")
    await eventually(lambda: len(new.storer.catchups.parked) == 1, "the catch-up is parked")
    assert drain(ds, ack=False) == []  # parked until the takeover is done
    new.storer.owned("03")  # the log's end as read in the takeover's transaction
    msgs = await collect(ds, 7)
    assert msgs[-1] == ["commit", {"tag": "commit"}, {"watermark": "03"}]
    assert new.storer.durable == "03"
    await new.storer.catchups.close()


async def test_a_long_catch_up_shows_its_progress_and_leaves_the_view_when_done(
    change_db: ChangeDb, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Shown at once, a line every 20 ms; batches of 4 rows; the subscriber reads
    # nothing until the line is seen, so the catch-up stalls after its first batches.
    monkeypatch.setattr(progress, "AFTER_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.02)
    caplog.set_level(logging.INFO, logger="app.progress")
    h = Harness(change_db, catchup_batch=4)
    h.start()
    try:
        last = to_lexi(11)
        h.feed([e for i in range(2, 12) for e in txn(to_lexi(i))])  # 10 tx, 30 changes
        await h.until_durable(last)
        sub, ds = make_sub(REPLICA_VERSION, id="sub-7")
        h.storer.catchups.catchup(sub, "serving")

        def line() -> logging.LogRecord | None:
            return next((r for r in caplog.records if r.getMessage().startswith("catch-up")), None)

        record = await eventually(line, "a catch-up progress line")
        assert record.getMessage().startswith("catch-up of sub-7: ")
        fields = record.__dict__["log_fields"]  # app.logs puts extra fields there
        assert fields["subscriber"] == "sub-7"
        assert fields["mode"] == "serving"
        shown = fields["progress"]
        assert shown["unit"] == "changes"
        assert 0 < shown["done"] < 30  # stalled on the unread batches
        # The total is estimated from the watermark range read so far.
        assert shown["done"] <= shown["total"]

        received: list[object] = []
        end = ["commit", {"tag": "commit"}, {"watermark": last}]

        def read_to_the_end() -> bool:
            received.extend(drain(ds))
            return bool(received) and received[-1] == end

        await eventually(read_to_the_end, "the rest of the catch-up")
        assert len(received) == 1 + 30  # the status, then every change once
        # Finished: it leaves the view (which stays bounded).
        await eventually(lambda: not h.storer.catchups.progress.jobs, "the job to leave the view")
    finally:
        await h.close()
        await h.storer.catchups.close()
