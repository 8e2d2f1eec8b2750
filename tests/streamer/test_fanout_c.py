"""The fan-out loops in C (app/streamer/_fanout.c) against their Python twins."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app import speedups
from app.protocol.pieces import Text
from app.streamer import downstream, subscriber
from app.streamer.downstream import _running_totals_py
from app.streamer.subscriber import Change, _select_live_py

_fanout = pytest.importorskip(
    "app.streamer._fanout", reason="not built (no C compiler when the package was installed)"
)


def test_the_c_loops_are_used_unless_speedups_are_off() -> None:
    # Without them fan-out costs ~0.3 us more per change per subscriber.
    if speedups.ENABLED:
        assert subscriber.select_live is _fanout.select_live
        assert downstream.running_totals is _fanout.running_totals
    else:
        assert subscriber.select_live is _select_live_py
        assert downstream.running_totals is _running_totals_py


def both_select(
    changes: list[Change], watermark: str, unsupported: frozenset[str], pushed: int
) -> tuple[str, list[Text], list[tuple[int, str]]]:
    results = []
    for select in (_fanout.select_live, _select_live_py):
        texts: list[Text] = []
        commits: deque[tuple[int, str]] = deque([(0, "00")])
        new_watermark = select(changes, watermark, unsupported, pushed, texts, commits)
        results.append((new_watermark, texts, list(commits)))
    assert results[0] == results[1]
    return results[0]


def tx(w: str) -> list[Change]:
    return [
        Change(w, "begin", f"b{w}"),
        Change(w, "insert", f"i{w}"),
        Change(w, "create-table", f"t{w}"),
        Change(w, "commit", f"c{w}"),
    ]


def test_a_subscriber_takes_what_is_past_its_watermark_and_supported() -> None:
    changes = [*tx("02"), *tx("03"), *tx("04")]
    watermark, texts, commits = both_select(changes, "02", frozenset({"create-table"}), 10)
    assert watermark == "04"
    assert texts == ["b03", "i03", "c03", "b04", "i04", "c04"]
    assert commits == [(0, "00"), (13, "03"), (16, "04")]


def test_nothing_new_leaves_the_watermark() -> None:
    assert both_select(tx("02"), "05", frozenset(), 0) == ("05", [], [(0, "00")])


def test_running_totals_continue_from_the_total() -> None:
    for totals in (_fanout.running_totals, _running_totals_py):
        ends = [5]
        assert totals(ends, ["ab", "", "cde"], 5) == 10
        assert ends == [5, 7, 7, 10]


def test_bad_arguments_are_type_errors() -> None:
    with pytest.raises(TypeError):
        _fanout.select_live(tuple(tx("02")), "01", frozenset(), 0, [], deque())
    with pytest.raises(TypeError):
        _fanout.select_live([("02", "begin")], "01", frozenset(), 0, [], deque())
    with pytest.raises(TypeError):
        _fanout.running_totals([], ["x", 3], 0)


watermarks = st.sampled_from(["01", "02", "03", "0a", "0b", "1"])
tags = st.sampled_from(["begin", "insert", "commit", "rollback", "create-table"])
changes = st.lists(
    st.builds(Change, watermarks, tags, st.text(max_size=5)),
    max_size=20,
)


@settings(max_examples=400, deadline=None)
@given(
    changes,
    watermarks,
    st.frozensets(tags, max_size=2),
    st.integers(0, 1000),
)
def test_c_and_python_agree_on_any_batch(
    batch: list[Change], watermark: str, unsupported: frozenset[str], pushed: int
) -> None:
    both_select(batch, watermark, unsupported, pushed)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=20), st.integers(0, 10**12))
def test_running_totals_agree(messages: list[Text], total: int) -> None:
    ends_c: list[int] = []
    ends_py: list[int] = []
    assert _fanout.running_totals(ends_c, messages, total) == _running_totals_py(
        ends_py, messages, total
    )
    assert ends_c == ends_py
