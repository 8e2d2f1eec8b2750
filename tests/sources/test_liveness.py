"""The keep-alive rule: an interval without a message or pong ends the connection."""

from __future__ import annotations

from app.sources.liveness import Liveness


def test_the_first_interval_counts_the_connection_itself_as_activity() -> None:
    liveness = Liveness()
    assert liveness.tick(reader_waiting=True)
    assert not liveness.tick(reader_waiting=True)


def test_a_message_or_pong_during_the_interval_keeps_the_connection() -> None:
    liveness = Liveness()
    liveness.tick(reader_waiting=True)
    liveness.activity()
    assert liveness.tick(reader_waiting=True)
    assert not liveness.tick(reader_waiting=True)


def test_activity_only_counts_for_the_interval_it_happened_in() -> None:
    liveness = Liveness()
    liveness.activity()
    liveness.activity()
    assert liveness.tick(reader_waiting=True)
    assert not liveness.tick(reader_waiting=True)


def test_a_busy_reader_is_back_pressure_not_silence() -> None:
    liveness = Liveness()
    liveness.tick(reader_waiting=True)
    assert liveness.tick(reader_waiting=False)
    assert liveness.tick(reader_waiting=False)
    assert not liveness.tick(reader_waiting=True)
