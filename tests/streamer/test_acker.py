"""UpstreamAcker: which acks the change source gets, and when (core.md §2.7, §7 items 30, 65)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from app.protocol.messages import (
    Begin,
    Commit,
    Rollback,
    Status,
    parse_change_source_message,
)
from app.streamer.acker import UpstreamAcker


def begin(w: str, **extra: Any) -> Begin:
    msg = parse_change_source_message(["begin", {"tag": "begin", **extra}, {"commitWatermark": w}])
    assert isinstance(msg, Begin)
    return msg


def commit(w: str, **extra: Any) -> Commit:
    msg = parse_change_source_message(["commit", {"tag": "commit", **extra}, {"watermark": w}])
    assert isinstance(msg, Commit)
    return msg


def rollback() -> Rollback:
    msg = parse_change_source_message(["rollback", {"tag": "rollback"}])
    assert isinstance(msg, Rollback)
    return msg


def status(w: str, *, ack: bool | None = None) -> Status:
    body: dict[str, Any] = {} if ack is None else {"ack": ack}
    msg = parse_change_source_message(["status", body, {"watermark": w}])
    assert isinstance(msg, Status)
    return msg


def tx(acker: UpstreamAcker, w: str, **extra: Any) -> None:
    """An upstream transaction (begin + commit) as the acker sees it."""
    acker.on_upstream(begin(w))
    acker.on_upstream(commit(w, **extra))


def commit_ack(w: str) -> list[Any]:
    return ["status", {"tag": "commit"}, {"watermark": w}]


def status_ack(w: str, body: dict[str, Any] | None = None) -> list[Any]:
    return ["status", {} if body is None else body, {"watermark": w}]


class Sink:
    def __init__(self) -> None:
        self.acks: list[list[Any]] = []

    def __call__(self, ack: list[Any]) -> None:
        self.acks.append(ack)

    def take(self) -> list[list[Any]]:
        out, self.acks = self.acks, []
        return out


@pytest.fixture
def sink() -> Sink:
    return Sink()


def connected(
    sink: Sink, *, with_change_log: bool = True, with_backup: bool = False
) -> UpstreamAcker:
    acker = UpstreamAcker(with_change_log=with_change_log, with_backup=with_backup)
    acker.reset(sink)
    return acker


# -- item 65 ---------------------------------------------------------------------


def test_requires_at_least_one_store() -> None:
    with pytest.raises(ValueError, match="at least one store"):
        UpstreamAcker(with_change_log=False, with_backup=False)


def test_change_log_only_acks_each_commit_once_it_is_stored(sink: Sink) -> None:
    acker = connected(sink)
    tx(acker, "09")
    tx(acker, "0a")
    assert sink.take() == []

    acker.track_change_log("09")
    assert sink.take() == [commit_ack("09")]
    acker.track_change_log("0a")
    assert sink.take() == [commit_ack("0a")]


def test_backup_only_acks_what_the_backup_holds(sink: Sink) -> None:
    acker = connected(sink, with_change_log=False, with_backup=True)
    tx(acker, "09")
    tx(acker, "0a")
    acker.track_change_log("0a")  # not a tracked store here
    assert sink.take() == []

    acker.track_backup("09")
    assert sink.take() == [commit_ack("09")]
    acker.track_backup("0a")
    assert sink.take() == [commit_ack("0a")]


def test_change_log_and_backup_ack_the_minimum_of_both(sink: Sink) -> None:
    acker = connected(sink, with_backup=True)
    tx(acker, "09")
    tx(acker, "0a")
    tx(acker, "0b")

    acker.track_change_log("0b")
    assert sink.take() == []  # the backup has not reported yet
    acker.track_backup("09")
    assert sink.take() == [commit_ack("09")]
    acker.track_backup("0b")
    assert sink.take() == [commit_ack("0b")]
    assert acker.durable == "0b"


def test_no_re_ack_of_an_acked_watermark(sink: Sink) -> None:
    acker = connected(sink)
    tx(acker, "09")
    acker.track_change_log("09")
    assert sink.take() == [commit_ack("09")]

    acker.track_change_log("09")  # repeated progress
    acker.track_change_log("05")  # older progress is ignored (monotonic max)
    acker.on_upstream(status("08"))  # a status below what was acked
    tx(acker, "0a")
    assert sink.take() == []
    assert acker.last_ack == "09"


def test_status_is_acked_after_preceding_commits(sink: Sink) -> None:
    acker = connected(sink)
    tx(acker, "09")
    tx(acker, "0a")
    acker.on_upstream(status("0b"))
    assert sink.take() == []

    acker.track_change_log("09")
    assert sink.take() == [commit_ack("09")]  # 0a is still outstanding
    acker.track_change_log("0a")
    assert sink.take() == [commit_ack("0a"), status_ack("0b")]


def test_immediate_status_ack_with_no_outstanding_commit(sink: Sink) -> None:
    acker = connected(sink)
    acker.on_upstream(status("0c", ack=True))
    assert sink.take() == [status_ack("0c", {"ack": True})]


def test_status_with_ack_false_is_ignored(sink: Sink) -> None:
    acker = connected(sink)
    acker.on_upstream(status("0c", ack=False))
    assert sink.take() == []

    tx(acker, "0d")
    acker.track_change_log("0d")
    assert sink.take() == [commit_ack("0d")]  # and no echo of the ack:false status


def test_replayed_commit_is_acked_immediately_with_the_covering_watermark(sink: Sink) -> None:
    acker = UpstreamAcker()
    acker.track_change_log("0c")  # stored by an earlier connection
    acker.reset(sink)

    acker.on_upstream(begin("0a"))
    assert sink.take() == [commit_ack("0c")]  # the first input acks what is stored
    acker.on_upstream(commit("0a"))
    assert sink.take() == []  # already covered by 0c


def test_reset_re_acks_on_progress(sink: Sink) -> None:
    acker = connected(sink)
    tx(acker, "09")
    acker.track_change_log("09")
    assert sink.take() == [commit_ack("09")]

    second = Sink()
    acker.reset(second)
    assert second.take() == []  # nothing is sent until something happens
    acker.on_upstream(status("09"))
    # The new connection gets the durable watermark again; the status at the same
    # watermark is covered by it.
    assert second.take() == [commit_ack("09")]
    tx(acker, "0a")
    acker.track_change_log("0a")
    assert second.take() == [commit_ack("0a")]
    assert sink.take() == []


# -- item 30: with a (litestream v5) backup ----------------------------------------


def test_ack_is_withheld_until_the_backup_catches_up(sink: Sink) -> None:
    acker = connected(sink, with_backup=True)
    tx(acker, "09")
    acker.track_change_log("09")
    assert sink.take() == []
    acker.track_backup("08")
    assert sink.take() == [commit_ack("08")]
    acker.track_backup("09")
    assert sink.take() == [commit_ack("09")]


def test_ack_is_withheld_until_the_change_log_catches_up(sink: Sink) -> None:
    acker = connected(sink, with_backup=True)
    tx(acker, "09")
    acker.track_backup("09")
    assert sink.take() == []
    acker.track_change_log("09")
    assert sink.take() == [commit_ack("09")]


def test_ack_is_the_minimum_of_both_stores_across_commits(sink: Sink) -> None:
    acker = connected(sink, with_backup=True)
    for w in ("09", "0a", "0b", "0c"):
        tx(acker, w)
    acker.track_change_log("0a")
    acker.track_backup("09")
    assert sink.take() == [commit_ack("09")]
    acker.track_backup("0c")
    assert sink.take() == [commit_ack("0a")]
    acker.track_change_log("0c")
    assert sink.take() == [commit_ack("0c")]


def test_status_echo_waits_for_the_backup_too(sink: Sink) -> None:
    acker = UpstreamAcker(with_backup=True)
    acker.track_change_log("0a")  # stored by an earlier connection
    acker.track_backup("08")
    acker.reset(sink)
    acker.on_upstream(status("0b"))
    # Transactions up to 0a are not in the backup yet: the echo would ack them.
    assert sink.take() == [commit_ack("08")]
    acker.track_backup("0a")
    assert sink.take() == [commit_ack("0a"), status_ack("0b")]


# -- rules the spec leaves to the implementation ------------------------------------


def test_commit_ack_echoes_the_commit_body_as_received(sink: Sink) -> None:
    acker = connected(sink)
    tx(acker, "09", commitTimeMs=1764426733675, commitLsn="0/16B3748")
    acker.track_change_log("09")
    assert sink.take() == [
        [
            "status",
            {"tag": "commit", "commitTimeMs": 1764426733675, "commitLsn": "0/16B3748"},
            {"watermark": "09"},
        ]
    ]


def test_ack_between_commits_uses_a_bare_commit_body(sink: Sink) -> None:
    acker = connected(sink, with_change_log=False, with_backup=True)
    tx(acker, "0a", commitTimeMs=5)
    acker.track_backup("09")  # a backup position that is not this connection's commit
    assert sink.take() == [commit_ack("09")]
    acker.track_backup("0a")
    assert sink.take() == [["status", {"tag": "commit", "commitTimeMs": 5}, {"watermark": "0a"}]]


def test_commit_bodies_are_bounded(sink: Sink) -> None:
    acker = UpstreamAcker(recent_commits=2)
    acker.reset(sink)
    for w in ("01", "02", "03"):
        tx(acker, w, commitTimeMs=int(w))
    acker.track_change_log("01")  # evicted: acked with a bare body
    acker.track_change_log("03")
    assert sink.take() == [
        commit_ack("01"),
        ["status", {"tag": "commit", "commitTimeMs": 3}, {"watermark": "03"}],
    ]


def test_skip_ack_transaction_is_never_acked_and_does_not_hold_statuses(sink: Sink) -> None:
    acker = connected(sink)
    tx(acker, "09")
    acker.track_change_log("09")
    assert sink.take() == [commit_ack("09")]

    acker.on_upstream(begin("09.01", json="s", skipAck=True))
    acker.on_upstream(commit("09.01"))
    acker.on_upstream(status("0a"))
    # The backfill commit is not lastTx, so the status is echoed without waiting
    # for it (the storer never reports skipAck commits).
    assert sink.take() == [status_ack("0a")]


def test_status_inside_a_transaction_waits_for_its_commit(sink: Sink) -> None:
    acker = connected(sink)
    acker.on_upstream(begin("0b"))
    acker.on_upstream(status("0b"))
    assert sink.take() == []
    acker.on_upstream(commit("0b"))
    assert sink.take() == []  # 0b is not stored yet
    acker.track_change_log("0b")
    assert sink.take() == [commit_ack("0b")]  # the status at 0b is covered


def test_status_inside_a_rolled_back_transaction_is_echoed_after_the_rollback(
    sink: Sink,
) -> None:
    acker = connected(sink)
    acker.on_upstream(begin("0b"))
    acker.on_upstream(status("0a"))
    assert sink.take() == []
    acker.on_upstream(rollback())
    assert sink.take() == [status_ack("0a")]


def test_acks_without_a_sink_are_dropped(sink: Sink) -> None:
    acker = UpstreamAcker()
    tx(acker, "09")
    acker.track_change_log("09")
    acker.on_upstream(status("0a"))
    assert acker.last_ack == ""

    acker.reset(sink)
    acker.reset(None)  # the stream ended
    acker.track_change_log("0b")
    assert sink.take() == []


def test_a_failing_sink_is_dropped_until_the_next_stream(
    sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[list[Any]] = []

    def broken(ack: list[Any]) -> None:
        calls.append(ack)
        raise ConnectionError("closed")

    acker = UpstreamAcker()
    acker.reset(broken)
    with caplog.at_level(logging.WARNING):
        acker.track_change_log("09")
        acker.track_change_log("0a")
    assert calls == [commit_ack("09")]
    assert "dropping acks" in caplog.text

    acker.reset(sink)
    acker.on_upstream(status("0a"))
    assert sink.take() == [commit_ack("0a")]
