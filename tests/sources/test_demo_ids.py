"""The demo's id bookkeeping: bounded sets, and forgetting what was never stored."""

from __future__ import annotations

import random

from app.sources.demo_ids import BoundedIdSet, LiveIds


def test_bounded_set_ignores_ids_beyond_its_cap() -> None:
    ids = BoundedIdSet(2)
    for item in ("a", "b", "c"):
        ids.add(item)
    assert len(ids) == 2
    assert "c" not in ids


def test_bounded_set_removal_keeps_the_rest_choosable() -> None:
    ids = BoundedIdSet(10)
    for item in "abcde":
        ids.add(item)
    ids.discard("b")
    ids.discard("e")
    ids.discard("missing")
    rng = random.Random(1)
    assert {ids.choice(rng) for _ in range(200)} == {"a", "c", "d"}


def test_acked_transactions_survive_a_restart_and_later_ones_do_not() -> None:
    live = LiveIds(["t"], max_ids=100, max_journal=100)
    for wm, row in ((10, "a"), (11, "b"), (12, "c")):
        live.working("t").add(row)
        live.record(wm, [("insert", "t", row)])
    live.working("t").discard("a")
    live.record(13, [("delete", "t", "a")])
    live.confirm(11)
    assert live.confirmed_count("t") == 2
    live.restart_at(12)  # the change log also holds 12, not 13
    assert {live.working("t").choice(random.Random(s)) for s in range(100)} == {"a", "b", "c"}
    live.restart_at(12)
    assert len(live.working("t")) == 3


def test_a_long_unconfirmed_journal_is_folded_oldest_first() -> None:
    live = LiveIds(["t"], max_ids=100, max_journal=2)
    for wm, row in ((1, "a"), (2, "b"), (3, "c")):
        live.working("t").add(row)
        live.record(wm, [("insert", "t", row)])
    assert live.confirmed_count("t") == 1
    live.restart_at(0)
    assert len(live.working("t")) == 1


def test_clear_forgets_everything() -> None:
    live = LiveIds(["t"], max_ids=100, max_journal=100)
    live.working("t").add("a")
    live.record(1, [("insert", "t", "a")])
    live.confirm(1)
    live.clear()
    assert live.confirmed_count("t") == 0
    assert len(live.working("t")) == 0
