"""The streamer's bucket arrays: Prometheus' ``le`` buckets, read as cumulative counts."""

from __future__ import annotations

import math

import pytest

from app.streamer.histogram import (
    CATCHUP_BOUNDS_S,
    GROUP_ROWS_BOUNDS,
    LATENCY_BOUNDS_S,
    Histogram,
    HistogramReading,
)


def test_a_value_counts_in_the_first_bucket_whose_bound_it_does_not_exceed() -> None:
    h = Histogram([1, 2, 5])
    for v in (0, 1, 1.5, 2, 5, 5.01, 1e9):
        h.observe(v)
    assert h.counts == [2, 2, 1, 2]  # ≤1, ≤2, ≤5, above
    assert h.count == 7
    assert h.sum == pytest.approx(0 + 1 + 1.5 + 2 + 5 + 5.01 + 1e9)


def test_a_reading_is_a_copy_with_cumulative_buckets_ending_at_infinity() -> None:
    h = Histogram([0.5, 1])
    h.observe(0.25)
    h.observe(3)
    reading = HistogramReading.of(h)
    h.observe(0.75)  # after the reading: not in it
    assert reading.cumulative() == [(0.5, 1), (1.0, 1), (math.inf, 2)]
    assert (reading.count, reading.sum) == (2, 3.25)


@pytest.mark.parametrize("bounds", [[1, 1], [2, 1]])
def test_bounds_must_increase(bounds: list[float]) -> None:
    with pytest.raises(ValueError, match="increasing"):
        Histogram(bounds)


def test_the_bounds_in_use_increase() -> None:
    for bounds in (LATENCY_BOUNDS_S, CATCHUP_BOUNDS_S, GROUP_ROWS_BOUNDS):
        assert list(bounds) == sorted(set(bounds))
