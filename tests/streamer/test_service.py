"""ChangeStreamerService end to end, in process: a scripted source, a real SQLite log."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import text

from app.protocol.canonical_json import dumps, loads
from app.protocol.errors import ErrorType
from app.stop_signals import AbortError, AutoResetSignal
from app.storage import (
    ChangeDb,
    ChangeLog,
    OwnershipLostError,
    Replication,
    Shard,
    create_change_db,
    parse_change_db_url,
)
from app.streamer import loop_lag
from app.streamer.downstream import Downstream
from app.streamer.reservations import Reservation
from app.streamer.service import (
    FLUSH_THRESHOLD,
    ChangeStreamerService,
    StreamerOptions,
    SubscriberContext,
    UnrecoverableError,
)
from app.streamer.subscriber import Mode
from app.streamer.timers import ManualTimers
from app.versions import PROBE_REPLICA_VERSION
from tests.change_dbs import migrated
from tests.memory_source import MemoryChangeSource, MemoryChangeStream
from tests.waiting import eventually, stays

from .conftest import OWNER, REPLICA_VERSION
from .helpers import collect, whole


def begin(w: str) -> list[Any]:
    return ["begin", {"tag": "begin"}, {"commitWatermark": w}]


def insert(i: int, **extra: Any) -> list[Any]:
    row = {"id": i, **extra}
    return [
        "data",
        {
            "tag": "insert",
            "relation": {"schema": "public", "name": "t", "rowKey": {"columns": ["id"]}},
            "new": row,
        },
    ]


def commit(w: str) -> list[Any]:
    return ["commit", {"tag": "commit", "commitTimeMs": 1}, {"watermark": w}]


def status(w: str, ack: bool = True) -> list[Any]:
    return ["status", {"ack": ack}, {"watermark": w}]


def txn(w: str, *rows: list[Any]) -> list[list[Any]]:
    return [begin(w), *(rows or [insert(1)]), commit(w)]


class Service:
    def __init__(self, db: ChangeDb, **options: Any) -> None:
        self.source = MemoryChangeSource()
        self.timers = ManualTimers()
        self.service = ChangeStreamerService(
            db=db,
            source=self.source,
            task_id=OWNER,
            address="127.0.0.1:4849",
            replica_version=REPLICA_VERSION,
            durable_watermark=REPLICA_VERSION,
            options=StreamerOptions(backoff_initial_s=0.01, backoff_max_s=0.05, **options),
            timers=self.timers,
        )
        self.log = ChangeLog(db)
        self.run: asyncio.Task[None] = asyncio.create_task(self.service.run())

    async def stream(self, n: int = 1) -> MemoryChangeStream:
        return await asyncio.wait_for(self.source.wait_for_stream(n), 10)

    def subscribe(
        self,
        watermark: str,
        *,
        id: str = "sub",
        replica_version: str = REPLICA_VERSION,
        mode: Mode = "serving",
    ) -> Downstream:
        return self.service.subscribe(SubscriberContext(6, id, mode, replica_version, watermark))

    async def durable(self, w: str) -> None:
        await asyncio.wait_for(self.service.storer.wait_durable(w), 10)

    async def stored(self) -> list[tuple[str, int]]:
        out = []
        async for batch in self.log.read("00", "zz"):
            out += [(w, p) for w, p, _, _ in batch]
        return out

    async def live(self, ds: Downstream, *, ack: bool = True) -> None:
        """Takes the initial status and waits until the subscriber is past catch-up:
        from here on the stream reaches it directly, in order, flow control
        included. (Before that, live changes wait in its backlog and a lag report
        only shapes the initial status, so tests of the live path must wait.)"""
        first = loads(whole(await asyncio.wait_for(ds.get(), 10)))
        assert first[0] == "status", first
        if ack:
            ds.ack_next()

        def left_catch_up() -> bool:
            subs = [*self.service.forwarder.active, *self.service.forwarder.queued]
            return bool(subs) and not any(sub.backlogged for sub in subs)

        await eventually(left_catch_up, "the subscriber to leave catch-up")

    async def stop(self) -> None:
        await self.service.stop()
        await asyncio.wait_for(asyncio.gather(self.run, return_exceptions=True), 10)


@pytest.fixture
async def svc(change_db: ChangeDb) -> AsyncIterator[Service]:
    s = Service(change_db)
    yield s
    await s.stop()


async def test_get_change_log_state_of_a_fresh_log(svc: Service) -> None:
    state = await svc.service.get_change_log_state()
    assert (state.replica_version, state.min_watermark) == (REPLICA_VERSION, REPLICA_VERSION)


async def test_first_stream_starts_at_the_replica_version_then_at_the_last_stored_commit(
    svc: Service,
) -> None:
    stream = await svc.stream()
    assert stream.after_watermark == REPLICA_VERSION
    stream.push_all(txn("05"))
    await svc.durable("05")
    stream.end()
    second = await svc.stream(2)
    assert second.after_watermark == "05"


async def test_forwards_at_once_stores_and_acks_commits_then_echoes_statuses(svc: Service) -> None:
    ds = svc.subscribe(REPLICA_VERSION)
    stream = await svc.stream()
    stream.push_all([*txn("09", insert(1), insert(2)), status("0a", ack=False), status("0c")])
    msgs = await collect(ds, 5)
    assert [m[0] for m in msgs] == ["status", "begin", "data", "data", "commit"]
    acks = await asyncio.wait_for(stream.wait_for_acks(2), 10)
    assert acks == [
        ["status", {"tag": "commit", "commitTimeMs": 1}, {"watermark": "09"}],
        ["status", {"ack": True}, {"watermark": "0c"}],
    ]
    assert await svc.stored() == [("01", 0), ("01", 1), ("09", 0), ("09", 1), ("09", 2), ("09", 3)]
    state = await Replication(svc.log.db).state()
    assert state is not None
    assert (state.last_watermark, state.owner, state.owner_address) == (
        "09",
        OWNER,
        "127.0.0.1:4849",
    )


async def test_catch_up_then_continuation_without_gap_or_duplicate(svc: Service) -> None:
    stream = await svc.stream()
    stream.push_all(txn("02") + txn("03"))
    await svc.durable("03")
    ds = svc.subscribe("02")
    stream.push_all(txn("04"))
    msgs = await collect(ds, 7)
    commits = [m[2]["watermark"] for m in msgs if m[0] == "commit"]
    assert commits == ["03", "04"]
    assert msgs[0][0] == "status"


async def test_a_rolled_back_transaction_is_forwarded_but_not_stored_or_acked(svc: Service) -> None:
    ds = svc.subscribe(REPLICA_VERSION)
    stream = await svc.stream()
    stream.push_all([begin("02"), insert(1), ["rollback", {"tag": "rollback"}], *txn("03")])
    msgs = await collect(ds, 7)
    assert [m[0] for m in msgs] == [
        "status",
        "begin",
        "data",
        "rollback",
        "begin",
        "data",
        "commit",
    ]
    await svc.durable("03")
    assert {w for w, _ in await svc.stored()} == {"01", "03"}
    acks = await asyncio.wait_for(stream.wait_for_acks(1), 10)
    assert [a[2]["watermark"] for a in acks] == ["03"]


async def test_a_subscriber_ahead_gets_only_later_transactions(svc: Service) -> None:
    stream = await svc.stream()
    stream.push_all(txn("02") + txn("03"))
    await svc.durable("03")
    ds = svc.subscribe("03")
    stream.push_all(txn("04"))
    msgs = await collect(ds, 4)
    assert [m[0] for m in msgs] == ["status", "begin", "data", "commit"]
    assert msgs[-1][2] == {"watermark": "04"}


async def test_big_integers_floats_and_bools_survive_both_paths(svc: Service) -> None:
    stream = await svc.stream()
    row = insert(1, big=123456789012345678901234567890, f=1.5, whole=2.0, b=True, n=None)
    live = svc.subscribe(REPLICA_VERSION, id="live")
    stream.push_all(txn("02", row))
    await svc.durable("02")
    caught_up = svc.subscribe(REPLICA_VERSION, id="late")
    live_msgs = await collect(live, 4)
    late_msgs = await collect(caught_up, 4)
    assert live_msgs[2] == late_msgs[2]
    assert live_msgs[2][1]["new"] == {
        "id": 1,
        "big": 123456789012345678901234567890,
        "f": 1.5,
        "whole": 2,
        "b": True,
        "n": None,
    }


async def test_wrong_replica_version_is_the_first_and_only_message(svc: Service) -> None:
    ds = svc.subscribe(REPLICA_VERSION, replica_version="0z")
    msgs = await collect(ds, 2)
    assert msgs == [
        [
            "error",
            {
                "type": int(ErrorType.WRONG_REPLICA_VERSION),
                "message": "current replica version is 01 (requested 0z)",
            },
        ]
    ]


@pytest.mark.parametrize(
    ("requested", "level"),
    [("0z", logging.WARNING), (PROBE_REPLICA_VERSION, logging.INFO)],  # a probe only asks
)
async def test_a_wrong_replica_version_is_a_warning_unless_the_client_asks(
    svc: Service, caplog: pytest.LogCaptureFixture, requested: str, level: int
) -> None:
    caplog.set_level(logging.INFO, logger="app.streamer.service")
    ds = svc.subscribe(REPLICA_VERSION, replica_version=requested)
    await collect(ds, 1)
    [record] = [r for r in caplog.records if r.getMessage().startswith("rejecting subscriber")]
    assert record.levelno == level


async def test_a_failing_start_is_retried(change_db: ChangeDb) -> None:
    s = Service.__new__(Service)
    Service.__init__(s, change_db)
    s.source.fail_next_starts(ConnectionError("upstream down"), 2)
    stream = await s.stream(1)
    assert s.source.start_calls[:3] == [REPLICA_VERSION] * 3
    assert stream.after_watermark == REPLICA_VERSION
    await s.stop()


async def test_a_broken_stream_mid_transaction_sends_one_rollback_and_resends_the_transaction(
    svc: Service,
) -> None:
    ds = svc.subscribe(REPLICA_VERSION)
    stream = await svc.stream()
    stream.push_all([begin("02"), insert(1)])
    stream.fail(ConnectionError("upstream went away"))
    second = await svc.stream(2)
    assert second.after_watermark == REPLICA_VERSION
    second.push_all(txn("02", insert(1)))
    msgs = await collect(ds, 7)
    assert [m[0] for m in msgs] == [
        "status",
        "begin",
        "data",
        "rollback",
        "begin",
        "data",
        "commit",
    ]
    await stays(lambda: ds.get_nowait() is None, 0.05, "no message after the resent commit")
    assert ds.get_nowait() is None  # exactly one synthetic rollback
    await svc.durable("02")
    assert {w for w, _ in await svc.stored()} == {"01", "02"}


async def test_an_upstream_ending_at_a_commit_checkpoint_sends_no_rollback(svc: Service) -> None:
    """The upstream breaks while the loop waits on flow control, the newest
    checkpoint being a commit (the change that crossed 64 KiB): the transaction is
    complete, so no synthetic rollback may follow its commit."""
    # Transaction 02's row is the first checkpoint (the loop does not wait on it);
    # 03's commit is the second, and the loop waits for the first, never acked.
    first = insert(1, pad="x" * FLUSH_THRESHOLD)
    begin_len, commit_len = len(dumps(begin("03"))), len(dumps(commit("03")))
    base = len(dumps(insert(1, pad="")))
    pad = FLUSH_THRESHOLD - commit_len - begin_len - base - commit_len // 2
    big = insert(1, pad="x" * pad)
    carried = commit_len + begin_len + len(dumps(big))  # after the first checkpoint
    assert carried < FLUSH_THRESHOLD <= carried + commit_len
    # It acks its status (so flow control counts it), then reads but never acks
    # again: the wait holds.
    ds = svc.subscribe(REPLICA_VERSION)
    stream = await svc.stream()
    await svc.live(ds)
    stream.push_all([*txn("02", first), *txn("03", big)])
    received = ["status"]
    while len(received) < 7:
        text = await asyncio.wait_for(ds.get(), 10)
        received.append(loads(whole(text))[0])
    assert received == ["status", "begin", "data", "commit", "begin", "data", "commit"]
    await svc.durable("03")
    await eventually(  # the loop is waiting on the first checkpoint
        lambda: svc.service.forwarder.current is not None, "the loop to wait on a checkpoint"
    )
    assert svc.service.forwarder.current is not None
    stream.fail(ConnectionError("upstream went away"))
    second = await svc.stream(2)
    assert second.after_watermark == "03"
    second.push_all(txn("04"))
    while len(received) < 10:
        text = await asyncio.wait_for(ds.get(), 10)
        received.append(loads(whole(text))[0])
    assert received[7:] == ["begin", "data", "commit"]


async def test_a_subscriber_that_stops_acking_holds_the_loop_within_two_checkpoints(
    svc: Service,
) -> None:
    row = insert(1, pad="x" * 1000)
    row_len = len(dumps(row))
    ds = svc.subscribe(REPLICA_VERSION)  # reads, acks its status, then nothing yet
    stream = await svc.stream()
    await svc.live(ds)
    stream.push_all(txn("02", *[row] * 200))  # ~3 checkpoints' worth
    await eventually(  # the loop waits
        lambda: svc.service.forwarder.current is not None, "the loop to wait on a checkpoint"
    )
    assert svc.service.forwarder.current is not None
    sent = []
    while (text := ds.get_nowait()) is not None:
        sent.append(text)
    forwarded = sum(len(t) for t in sent)  # the initial status was taken before
    # Pipelined one deep: the second checkpoint went out, the third did not.
    assert 2 * FLUSH_THRESHOLD - row_len <= forwarded < 2 * FLUSH_THRESHOLD + row_len
    ds.ack_many(len(sent))  # what was sent (the status was acked before)
    while len(sent) < 202:
        sent.append(await asyncio.wait_for(ds.get(), 10))
        ds.ack_next()
    assert loads(whole(sent[-1]))[0] == "commit"
    await svc.durable("02")


async def test_an_explicit_rollback_then_end_sends_no_second_rollback(svc: Service) -> None:
    ds = svc.subscribe(REPLICA_VERSION)
    stream = await svc.stream()
    stream.push_all([begin("02"), insert(1), ["rollback", {"tag": "rollback"}]])
    stream.end()
    second = await svc.stream(2)
    second.push_all(txn("03"))
    msgs = await collect(ds, 7)
    assert [m[0] for m in msgs] == [
        "status",
        "begin",
        "data",
        "rollback",
        "begin",
        "data",
        "commit",
    ]


async def test_data_before_begin_stops_the_service_and_stores_nothing(svc: Service) -> None:
    stream = await svc.stream()
    stream.push_all([insert(1)])
    with pytest.raises(UnrecoverableError, match="received before 'begin'"):
        await asyncio.wait_for(svc.run, 10)
    assert await svc.stored() == [("01", 0), ("01", 1)]


async def test_a_commit_watermark_mismatch_stops_the_service(svc: Service) -> None:
    stream = await svc.stream()
    stream.push_all([begin("02"), insert(1), commit("03")])
    with pytest.raises(
        UnrecoverableError, match="commit watermark 03 does not match 'begin' watermark 02"
    ):
        await asyncio.wait_for(svc.run, 10)


async def test_a_duplicate_transaction_is_retried_and_nothing_of_it_kept(svc: Service) -> None:
    stream = await svc.stream()
    stream.push_all(txn("02"))
    await svc.durable("02")
    stream.push_all(txn("02", insert(7)))  # a buggy source re-sends a stored commit
    second = await svc.stream(2)
    assert second.after_watermark == "02"
    assert await svc.stored() == [("01", 0), ("01", 1), ("02", 0), ("02", 1), ("02", 2)]


async def test_ownership_taken_before_a_transaction_stops_the_service(svc: Service) -> None:
    stream = await svc.stream()
    stream.push_all(txn("02"))
    await svc.durable("02")
    await Replication(svc.log.db).assume_ownership("usurper", None)
    stream.push_all(txn("03"))
    with pytest.raises(OwnershipLostError, match="usurper"):
        await asyncio.wait_for(svc.run, 10)
    assert {w for w, _ in await svc.stored()} == {"01", "02"}


async def test_reset_required_marks_the_config_and_stops_with_auto_reset(svc: Service) -> None:
    stream = await svc.stream()
    stream.push_all([["control", {"tag": "reset-required", "message": "slot lost"}]])
    with pytest.raises(AutoResetSignal, match="slot lost"):
        await asyncio.wait_for(svc.run, 10)
    config = await Replication(svc.log.db).config()
    assert config is not None
    assert config.reset_required


async def test_reset_required_without_auto_reset_keeps_replicating(change_db: ChangeDb) -> None:
    s = Service(change_db, auto_reset=False)
    stream = await s.stream()
    stream.push_all([["control", {"tag": "reset-required"}], *txn("02")])
    await s.durable("02")
    config = await Replication(change_db).config()
    assert config is not None
    assert config.reset_required
    await s.stop()


async def test_a_backup_subscriber_behind_the_log_is_too_old_and_the_service_serves_on(
    svc: Service,
) -> None:
    # Issue 25: an anonymous socket with mode=backup at the replica version, once the
    # log's start is purged, used to reset the service ("backup replica at watermark
    # 01 is behind change db"). It is WatermarkTooOld like any other subscriber.
    stream = await svc.stream()
    stream.push_all([*txn("02"), *txn("03")])
    await svc.durable("03")
    # The service's own purge (short retention: the backup reached 03).
    svc.service.backups.track("03")
    svc.timers.advance(30)
    await svc.service.purger.idle()
    assert {w for w, _ in await svc.stored()} == {"03"}
    backup = svc.subscribe(REPLICA_VERSION, id="anonymous", mode="backup")
    assert (await collect(backup, 2))[-1:] == [
        [
            "error",
            {
                "type": int(ErrorType.WATERMARK_TOO_OLD),
                "message": f"earliest supported watermark is 03 (requested {REPLICA_VERSION})",
            },
        ]
    ]
    live = svc.subscribe("03", id="live")
    await svc.live(live)
    stream.push_all(txn("04"))
    assert [m[0] for m in await collect(live, 3)] == ["begin", "data", "commit"]
    assert not svc.run.done()
    config = await Replication(svc.log.db).config()
    assert config is not None
    assert not config.reset_required
    live.close()


async def test_lag_reports_are_forwarded_to_live_subscribers(svc: Service) -> None:
    ds = svc.subscribe(REPLICA_VERSION)
    stream = await svc.stream()
    await svc.live(ds)
    report = {
        "lastTimings": {"sendTimeMs": 150, "commitTimeMs": 151, "receiveTimeMs": 152},
        "nextSendTimeMs": 234,
    }
    stream.push_all(
        [*txn("02"), ["status", {"ack": False, "lagReport": report}, {"watermark": "03"}]]
    )
    msgs = await collect(ds, 4)
    assert [m[0] for m in msgs] == ["begin", "data", "commit", "status"]
    assert msgs[-1] == ["status", {"tag": "status", "lagReport": report}]


async def test_a_lag_report_inside_a_batch_keeps_its_place_in_the_stream(svc: Service) -> None:
    """Changes are forwarded a batch at a time; a status between them is not reordered."""
    ds = svc.subscribe(REPLICA_VERSION)
    stream = await svc.stream()
    await svc.live(ds)
    report = {
        "lastTimings": {"sendTimeMs": 1, "commitTimeMs": 2, "receiveTimeMs": 3},
        "nextSendTimeMs": 4,
    }
    first, second = txn("02", insert(1), insert(2)), txn("03")
    status = ["status", {"ack": False, "lagReport": report}, {"watermark": "02"}]
    stream.push_all([*first[:2], status, *first[2:], *second])
    msgs = await collect(ds, 4 + 1 + 3)
    assert [m[0] for m in msgs] == [
        *["begin", "data", "status", "data", "commit"],
        *["begin", "data", "commit"],
    ]
    assert msgs[2] == ["status", {"tag": "status", "lagReport": report}]


# -- purge, reservations, back pressure (core.md §7 items 8, 9, 17, 18, 29) ----


async def test_cleanup_purges_to_the_slowest_subscriber_after_30_s(svc: Service) -> None:
    stream = await svc.stream()
    stream.push_all([*txn("02"), *txn("03"), *txn("04")])
    await svc.durable("04")
    slow = svc.subscribe("03", id="slow")  # stays at 03: it never acks anything new
    assert loads(whole(await asyncio.wait_for(slow.get(), 10)))[0] == "status"
    slow.ack_next()  # (a subscriber that acks nothing at all is dropped after 10 s)
    await eventually(
        lambda: ("slow", "03") in svc.service.forwarder.named_acks(),
        "the slow subscriber to count for the purge floor",
    )
    svc.service.backups.track("04")
    assert svc.timers.pending().count(30.0) == 1  # (the 1 s progress tick is armed too)
    svc.timers.advance(30)
    await svc.service.purger.idle()
    # Floor = min(backup 04, slow subscriber at 03) = 03: 01 and 02 are gone.
    assert {w for w, _ in await svc.stored()} == {"03", "04"}
    late = svc.subscribe("02", id="late")
    msgs = await collect(late, 1)
    assert msgs == [
        [
            "error",
            {
                "type": int(ErrorType.WATERMARK_TOO_OLD),
                "message": "earliest supported watermark is 03 (requested 02)",
            },
        ]
    ]
    slow.close()


async def test_a_subscriber_lagging_past_the_bound_stops_holding_the_purge_floor(
    change_db: ChangeDb,
) -> None:
    # The pinner: subscribed at the oldest watermark, acking now and then
    # (inside every timeout), it held the floor for ever. Once connected for longer
    # than the bound and further behind than it, it is dropped and the log is purged;
    # resuming from where it was, it learns its watermark is too old.
    svc = Service(change_db, subscriber_max_lag_s=60.0)
    try:
        stream = await svc.stream()
        stream.push_all([*txn("02"), *txn("03")])
        await svc.durable("03")
        pinner = svc.subscribe("02", id="pinner")
        assert loads(whole(await asyncio.wait_for(pinner.get(), 10)))[0] == "status"
        pinner.ack_next()
        await eventually(
            lambda: ("pinner", "02") in svc.service.forwarder.named_acks(), "the pinner's ack"
        )
        svc.timers.advance(30)
        stream.push_all(txn("04"))
        await svc.durable("04")
        svc.service.backups.track("04")
        svc.timers.advance(30)  # the pass, 60 s after it joined: inside the bound
        await svc.service.purger.idle()
        assert svc.service.purger.floor_holder == "subscriber pinner"
        assert {w for w, _ in await svc.stored()} >= {"02"}
        stream.push_all(txn("05"))
        await svc.durable("05")
        svc.service.backups.track("05")
        svc.timers.advance(61)  # joined 121 s ago, its ack's commit 91 s behind
        await svc.service.purger.idle()
        assert ("pinner", "02") not in svc.service.forwarder.named_acks()  # dropped
        assert {w for w, _ in await svc.stored()} == {"05"}
        assert pinner.closed
        resumed = svc.subscribe("02", id="pinner")
        msgs = await collect(resumed, 1)
        assert msgs[0][0] == "error"
        assert msgs[0][1]["type"] == int(ErrorType.WATERMARK_TOO_OLD)
    finally:
        await svc.stop()


async def test_cleanup_without_subscribers_reaches_the_backup_and_is_not_rearmed(
    svc: Service,
) -> None:
    stream = await svc.stream()
    stream.push_all([*txn("02"), *txn("03")])
    await svc.durable("03")
    svc.service.backups.track("03")
    svc.timers.advance(30)
    await svc.service.purger.idle()
    assert {w for w, _ in await svc.stored()} == {"03"}
    assert 30.0 not in svc.timers.pending()


async def test_snapshot_reservation_needs_backups(svc: Service) -> None:
    with pytest.raises(Exception, match="backups are not configured"):
        svc.service.start_snapshot_reservation("task-1")


async def reserved_at_03(change_db: ChangeDb) -> tuple[Service, Reservation, str]:
    """A service with backups, 02 and 03 stored, and task-1's reservation confirmed
    at a backup of 03: the service, the reservation and its status."""
    s = Service(change_db, backup_url="file:///backups/replica")
    stream = await s.stream()
    stream.push_all([*txn("02"), *txn("03")])
    await s.durable("03")
    reservation = s.service.start_snapshot_reservation("task-1")
    s.service.backups.track("03")
    status = await asyncio.wait_for(anext(aiter(reservation)), 10)
    return s, reservation, status


async def test_a_reservation_is_confirmed_at_the_backup_and_closed_by_the_subscription(
    change_db: ChangeDb,
) -> None:
    s, reservation, status = await reserved_at_03(change_db)
    assert loads(status) == [
        "status",
        {
            "tag": "status",
            "backupURL": "file:///backups/replica",
            "replicaVersion": "01",
            "minWatermark": "03",
        },
    ]
    s.subscribe("03", id="restored")
    s.service.subscribe(
        SubscriberContext(6, "restored-2", "serving", REPLICA_VERSION, "03", task_id="task-1")
    )
    await asyncio.wait_for(reservation.closed, 10)
    assert reservation.outcome == "completed"
    await s.stop()


async def test_a_reservation_ends_when_its_task_subscribes_at_a_wrong_replica_version(
    change_db: ChangeDb,
) -> None:
    # Its restore is over, and it will not catch up here: nothing should stay held.
    s, reservation, _ = await reserved_at_03(change_db)
    assert s.service.reservations.reserved_watermarks() == ["03"]
    downstream = s.service.subscribe(
        SubscriberContext(6, "restored", "serving", "00", "03", task_id="task-1")
    )
    await asyncio.wait_for(reservation.closed, 10)
    assert s.service.reservations.reserved_watermarks() == []
    assert not s.service.reservations.is_open("task-1")
    assert downstream is not None
    await s.stop()


async def test_upstream_death_behind_a_wedged_storer_rolls_back_at_once(
    change_db: ChangeDb,
) -> None:
    s = Service(change_db, back_pressure_bytes=100)
    ds = s.subscribe(REPLICA_VERSION)
    stream = await s.stream()
    # Hold the single writer connection (and SQLite's write lock): the log is wedged.
    blocker = await change_db.writer.connect()
    await blocker.begin()
    try:
        # The commit of 02 makes the storer write, and wait for the connection;
        # what follows queues up behind it.
        stream.push_all(txn("02"))
        stream.push_all([begin("03"), *[insert(i) for i in range(50)]])
        # 03 has begun downstream (a stream that dies before its begin is
        # forwarded owes no rollback), and its changes hold the upstream back.
        while True:
            msg = loads(whole(await asyncio.wait_for(ds.get(), 10)))
            ds.ack_next()
            if msg == begin("03"):
                break
        await eventually(
            lambda: s.service.storer.ready_for_more() is not None, "upstream is held back"
        )
        stream.fail(ConnectionError("upstream died"))
        # The rollback arrives while the storer is still stuck.
        while True:
            msg = loads(whole(await asyncio.wait_for(ds.get(), 10)))
            ds.ack_next()
            if msg[0] == "rollback":
                break
        assert len(s.source.streams) == 1
    finally:
        await blocker.rollback()
        await blocker.close()
    # Once the log drains (02 gets stored, 03 was dropped), the service
    # reconnects from the last stored commit.
    second = await s.stream(2)
    assert second.after_watermark == "02"
    await s.stop()


async def test_a_storer_that_cannot_drain_stops_the_service(change_db: ChangeDb) -> None:
    s = Service(change_db, drain_timeout_s=0.3)
    stream = await s.stream()
    stream.push_all(txn("02"))
    await s.durable("02")
    # Hold the single writer connection (and SQLite's write lock).
    blocker = await change_db.writer.connect()
    await blocker.begin()
    try:
        stream.push_all(txn("03"))
        # 03 is taken in; the failure comes after it (as the stream orders them).
        await eventually(lambda: stream.queued == 0, "the service to read 03")
        stream.fail(ConnectionError("upstream died"))
        with pytest.raises(AbortError, match="did not drain within 300ms"):
            await asyncio.wait_for(s.run, 20)
        assert len(s.source.streams) == 1  # no reconnect
    finally:
        await blocker.rollback()
        await blocker.close()


async def test_start_stream_is_retried_at_the_watermark_of_the_last_big_transaction(
    svc: Service,
) -> None:
    stream = await svc.stream()
    stream.push_all(txn("02", *[insert(i, pad="q" * 1000) for i in range(300)]))
    stream.end()
    second = await svc.stream(2)
    assert second.after_watermark == "02"  # the storer drained before the restart


async def test_an_abort_error_from_the_source_stops_the_service(svc: Service) -> None:
    stream = await svc.stream()
    stream.fail(AbortError("another change-streamer took over the slot"))
    with pytest.raises(AbortError, match="took over the slot"):
        await asyncio.wait_for(svc.run, 10)
    assert len(svc.source.streams) == 1


async def test_a_dropped_change_log_schema_stops_the_service_cleanly(pg_url: str) -> None:
    shard = Shard(f"drop{os.getpid()}", 0)
    db = create_change_db(parse_change_db_url(pg_url), shard)
    await migrated(db, replica_version=REPLICA_VERSION, auto_reset=True)
    s = Service(db)
    try:
        stream = await s.stream()
        stream.push_all(txn("02"))
        await s.durable("02")
        async with db.writer.begin() as conn:
            await conn.execute(text(f'DROP SCHEMA "{shard.cdc_schema}" CASCADE'))
        stream.push_all(txn("03"))
        await asyncio.wait_for(s.run, 20)  # returns: no exception, no retry loop
        assert not s.service.running
    finally:
        await s.stop()
        async with db.writer.begin() as conn:
            await conn.execute(text(f'DROP SCHEMA IF EXISTS "{shard.cdc_schema}" CASCADE'))
        await db.dispose()


async def test_backup_lag_is_the_age_of_the_oldest_commit_no_backup_covers(svc: Service) -> None:
    stream = await svc.stream()
    assert svc.service.backups.lag_s() is None  # no backup watermark yet
    stream.push_all(txn("02"))
    await svc.durable("02")
    svc.timers.advance(5)
    stream.push_all(txn("03"))
    await svc.durable("03")
    svc.service.backups.track("01")
    svc.timers.advance(2)
    assert svc.service.backups.lag_s() == pytest.approx(7.0)  # 02 waits since t=0
    svc.service.backups.track("02")
    assert svc.service.backups.lag_s() == pytest.approx(2.0)  # 03 waits since t=5
    svc.service.backups.track("03")
    assert svc.service.backups.lag_s() == 0.0


async def test_the_coverage_gate_needs_a_backup_at_the_replica_s_start_position(
    change_db: ChangeDb,
) -> None:
    s = Service(change_db, backup_url="file:///b")
    assert not s.service.backups.covered()
    s.service.backups.track("01")
    assert not s.service.backups.covered()  # the monitor has not read the replica yet
    s.service.backups.set_coverage_target("01")  # what it read
    assert s.service.backups.covered()
    await s.stop()


async def test_a_snapshot_is_a_copy_of_the_service_at_one_moment(change_db: ChangeDb) -> None:
    s = Service(change_db, backup_url="file:///b")
    s.service.backups.set_coverage_target("01")  # the replica's position at start
    stream = await s.stream()
    stream.push_all(txn("02"))
    await s.durable("02")
    ds = s.subscribe("02", id="watcher")
    await s.live(ds)
    s.service.backups.track("01")
    before = s.service.snapshot()
    stream.push_all(txn("03"))
    await s.durable("03")
    s.service.backups.track("03")
    assert (before.transactions, before.durable_watermark) == (1, "02")
    assert (before.backup.watermark, before.backup.covered) == ("01", True)
    assert [(sub.id, sub.state) for sub in before.subscribers] == [("watcher", "active")]
    assert (before.active_subscribers, before.queued_subscribers) == (1, 0)
    after = s.service.snapshot()
    assert (after.transactions, after.durable_watermark, after.backup.watermark) == (2, "03", "03")
    with pytest.raises(AttributeError):
        after.transactions = 0  # type: ignore[misc]
    ds.close()
    await s.stop()


@pytest.mark.parametrize(
    ("body", "tag"),
    [
        ({"tag": "begin"}, "begin"),
        ({"tag": "commit"}, "commit"),
        ({"tag": "begin", "skipAck": True}, "begin"),
        ({"tag": "commit", "commitTimeMs": 1.0}, "commit"),  # JS writes 1
        ({"tag": "commit"}, "begin"),  # not the usual body for the tag: serialized
        ({"json": "p", "tag": "begin"}, "begin"),
    ],
)
def test_begin_and_commit_bodies_are_their_canonical_json(body: dict[str, Any], tag: str) -> None:
    from app.protocol.codec import reconstruct
    from app.streamer.service import _bookend

    assert _bookend(body, tag, "0a") == reconstruct("0a", tag, dumps(body))


async def test_the_loop_lag_monitor_keeps_the_worst_of_its_window() -> None:
    lag = loop_lag.LoopLag()
    lag.record(100.0, 0.002)
    lag.record(101.0, 0.300)
    lag.record(102.0, 0.001)
    assert (lag.latest_s, lag.max_s()) == (0.001, 0.300)
    assert lag.max_s(0.5) == 0.001  # only the newest sample is that recent
    lag.record(101.0 + loop_lag.WINDOW_S + 0.5, 0.004)  # the 300 ms sample ages out
    assert lag.max_s() == 0.004
    # Running, it measures a real stall of the loop.
    lag = loop_lag.LoopLag()
    lag.start()
    await asyncio.sleep(0)  # its first sleep is scheduled
    hold_the_loop(0.2)  # as a big value's copy would
    try:
        await eventually(lambda: lag.max_s() > 0, "the late wake-up to be recorded")
    finally:
        await lag.stop()
    assert lag.max_s() >= 0.15


def hold_the_loop(seconds: float) -> None:
    # The stall is the behaviour under test: the loop blocked, as by a big copy.
    time.sleep(seconds)


async def test_a_subscriber_that_acks_nothing_does_not_hold_the_loop(svc: Service) -> None:
    """Until its first ack (its status) flow control does not wait for a
    subscriber: a crowd of clients that connect and never read cannot stall the
    stream for those that do."""
    row = insert(1, pad="x" * 1000)
    silent = svc.subscribe(REPLICA_VERSION)
    steady = svc.subscribe(REPLICA_VERSION)
    stream = await svc.stream()
    await svc.live(silent, ack=False)
    await svc.live(steady)
    stream.push_all(txn("02", *[row] * 200))  # ~3 checkpoints' worth
    received: list[str] = []
    while len(received) < 202:
        received.append(loads(whole(await asyncio.wait_for(steady.get(), 10)))[0])
        steady.ack_next()
    assert received[-1] == "commit"
    await svc.durable("02")


async def test_streams_that_fail_before_storing_anything_back_off(svc: Service) -> None:
    """The retry delay starts over after durable progress, not when a stream opens:
    one that opens and fails at once every time (a full disk) backs off."""
    backoff = svc.service._backoff
    for n in range(1, 4):
        stream = await svc.stream(n)
        stream.fail(ConnectionError("disk full, say"))
    await svc.stream(4)
    assert backoff._next_s > backoff._initial_s  # grown: three failures, no progress
    stream = await svc.stream(4)
    stream.push_all(txn("02"))
    await svc.durable("02")
    assert backoff._next_s == backoff._initial_s
