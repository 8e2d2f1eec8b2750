"""Subscriber: status first, backlog during catch-up, watermark filter, acks, closing."""

from __future__ import annotations

import pytest

from app.protocol.errors import ErrorType
from app.streamer.subscriber import Change

from .helpers import drain, make_sub, settle, tx


async def test_status_is_sent_only_once_catch_up_starts() -> None:
    sub, ds = make_sub("01")
    sub.send_status()
    assert drain(ds) == []
    sub.catchup([tx("02")[0]])
    sub.send_status()
    assert [m[0] for m in drain(ds)] == ["status", "begin", "status"]


async def test_protocol_1_gets_no_status() -> None:
    sub, ds = make_sub("01", version=1)
    sub.set_caught_up()
    await settle()
    assert drain(ds) == []


async def test_live_changes_wait_in_the_backlog_until_caught_up_then_flow_in_order() -> None:
    sub, ds = make_sub("01")
    for change in tx("03"):
        assert sub.send([change]) is None  # buffered, below high water
    for change in tx("02"):
        sub.catchup([change])
    sub.set_caught_up()
    await settle()
    kinds = [(m[0], m[-1]) if m[0] != "data" else ("data",) for m in drain(ds)]
    assert [k[0] for k in kinds] == ["status", "begin", "data", "commit", "begin", "data", "commit"]
    assert not sub.backlogged
    assert sub.watermark == "03"


async def test_changes_at_or_below_the_watermark_are_dropped_on_both_paths() -> None:
    sub, ds = make_sub("05")
    for change in tx("04") + tx("05"):
        assert sub.catchup([change]) is None
    sub.set_caught_up()
    await settle()
    for change in tx("05"):
        assert sub.send([change]) is None
    for change in tx("06"):
        sub.send([change])
    assert [m[0] for m in drain(ds)] == ["status", "begin", "data", "commit"]
    # A replay of 06 is ignored.
    for change in tx("06"):
        assert sub.send([change]) is None
    assert drain(ds) == []


async def test_acked_advances_only_when_a_commit_is_consumed() -> None:
    sub, ds = make_sub("01")
    sub.set_caught_up()
    await settle()
    for change in tx("02"):
        sub.send([change])
    assert sub.watermark == "02"
    drain(ds, ack=False)
    assert sub.acked == "01"
    ds.ack_next()  # status
    ds.ack_next()  # begin
    ds.ack_next()  # data
    await settle()
    assert sub.acked == "01"
    ds.ack_next()  # commit
    await settle()
    assert sub.acked == "02"


async def test_a_full_backlog_returns_a_gate_that_opens_at_low_water() -> None:
    sub, ds = make_sub("01", high_water=1000)
    big = Change("02", "insert", '["data",{"tag":"insert","x":"' + "x" * 500 + '"}]')
    assert (
        sub.send([Change("02", "begin", '["begin",{"tag":"begin"},{"commitWatermark":"02"}]')])
        is None
    )
    assert sub.send([big]) is None
    gate = sub.send([big])
    assert gate is not None
    assert not gate.done()
    sub.set_caught_up()
    await settle()
    assert not gate.done()  # drained but not consumed: still buffered
    drain(ds)
    await settle()
    assert gate.done()


async def test_a_backlog_past_its_hard_bound_is_dropped_and_releases_its_gate() -> None:
    """The gate bounds a backlog only where flow control waits on it; past twice
    high water (or its count of changes) the backlog is dropped instead, for the
    next catch-up round to read from the change log."""
    sub, _ = make_sub("01", high_water=1000, max_backlog_changes=50)
    big = Change("02", "insert", '["data","' + "x" * 600 + '"]')
    gate = sub.send([big, big])
    assert gate is not None
    assert not gate.done()
    assert sub.send([big, big]) is None  # 2,400 bytes: past 2,000
    await settle()
    assert gate.done()
    assert (sub.backlog_size, sub.buffered_bytes, sub.backlog_drops) == (0, 0, 1)
    assert sub.send([big]) is None  # kept out until the next round
    assert sub.backlog_size == 0
    small, _ = make_sub("01", max_backlog_changes=50)
    for change in tx("02", 60):  # 62 changes of a few bytes
        small.send([change])
        assert small.backlog_size <= 50
    assert small.backlog_drops == 1


async def test_closing_releases_the_backlog_gate() -> None:
    sub, ds = make_sub("01", high_water=100)
    gate = sub.send([Change("02", "insert", '["data",' + '"' + "y" * 140 + '"]')])
    assert gate is not None
    sub.close()
    await settle()
    assert gate.done()
    assert ds.closed


async def test_update_table_metadata_is_not_sent_below_protocol_5() -> None:
    change = Change("02", "update-table-metadata", '["data",{"tag":"update-table-metadata"}]')
    old, old_ds = make_sub("01", version=4)
    new, new_ds = make_sub("01", version=5)
    for sub in (old, new):
        sub.set_caught_up()
    await settle()
    old.send([change])
    new.send([change])
    assert [m[0] for m in drain(old_ds)] == ["status"]
    assert [m[0] for m in drain(new_ds)] == ["status", "data"]


@pytest.mark.parametrize(
    "error_type", [ErrorType.WATERMARK_TOO_OLD, ErrorType.STREAM_TOO_FAR_BEHIND]
)
async def test_close_with_an_error_sends_it_then_closes_once_consumed(
    error_type: ErrorType,
) -> None:
    sub, ds = make_sub("01")
    sub.close(error_type, "earliest supported watermark is 04 (requested 01)")
    assert not ds.closed
    assert drain(ds) == [
        [
            "error",
            {
                "type": int(error_type),
                "message": "earliest supported watermark is 04 (requested 01)",
            },
        ]
    ]
    await settle()
    assert ds.closed


async def test_fail_closes_silently() -> None:
    sub, ds = make_sub("01")
    sub.fail(RuntimeError("storer broke"))
    assert ds.closed
    assert drain(ds) == []
