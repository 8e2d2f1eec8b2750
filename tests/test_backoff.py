"""Reconnect delays: 25 ms doubling up to 10 s, back to 25 ms after a reset."""

from __future__ import annotations

import pytest

from app.backoff import Backoff


def test_delays_double_from_25_ms_up_to_10_s() -> None:
    backoff = Backoff()
    delays = [backoff.next_delay() for _ in range(12)]
    assert delays[:5] == pytest.approx([0.025, 0.05, 0.1, 0.2, 0.4])
    assert delays[8] == pytest.approx(6.4)
    assert delays[9:] == [10.0, 10.0, 10.0]


def test_reset_starts_over_at_the_initial_delay() -> None:
    backoff = Backoff(initial_s=1.0, max_s=3.0)
    assert [backoff.next_delay() for _ in range(3)] == [1.0, 2.0, 3.0]
    backoff.reset()
    assert backoff.next_delay() == 1.0


@pytest.mark.parametrize(
    ("initial_s", "max_s", "factor"), [(0.0, 1.0, 2.0), (2.0, 1.0, 2.0), (1.0, 2.0, 0.5)]
)
def test_nonsensical_settings_are_rejected(initial_s: float, max_s: float, factor: float) -> None:
    with pytest.raises(ValueError, match="must"):
        Backoff(initial_s, max_s, factor)
