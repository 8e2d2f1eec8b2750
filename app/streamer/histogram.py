"""Observations counted into fixed buckets, for ``/metrics`` and OTLP to read.

The streamer's stages count their events here where they already happen (a
commit forwarded, a group commit, a catch-up done, a checkpoint released): one
bisect and two additions, no metrics library and no lock, since only the event
loop's thread writes and reads them; pages and exporters read a
``HistogramReading`` copy (in the service's snapshot, ``app/streamer/snapshot.py``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

# zero-cache's latency buckets (observability/metrics.ts, in seconds): 1 ms to 5 s
# in ~2x steps, 10 s and 30 s for broken states. Same bounds, same quantiles.
LATENCY_BOUNDS_S: tuple[float, ...] = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
)
# A catch-up reads anything from the tail in memory (ms) to a long log (minutes).
CATCHUP_BOUNDS_S: tuple[float, ...] = (*LATENCY_BOUNDS_S, 60.0, 120.0, 300.0, 600.0)
# Rows in one change-log group commit (ZERO_CHANGE_LOG_BATCH_SIZE, default 10,000,
# stops a group at whole transactions, so one may pass it).
GROUP_ROWS_BOUNDS: tuple[float, ...] = (
    1,
    2,
    5,
    10,
    20,
    50,
    100,
    200,
    500,
    1_000,
    2_000,
    5_000,
    10_000,
    20_000,
    50_000,
)


class Histogram:
    """Counts per bucket (``counts[i]``: values in ``(bounds[i-1], bounds[i]]``, the
    last one above every bound) and the sum of the values."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bucket bounds must be increasing: {bounds}")
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True, slots=True)
class HistogramReading:
    """A copy of a ``Histogram``: counts per bucket (the last one above every bound)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @classmethod
    def of(cls, histogram: Histogram) -> HistogramReading:
        return cls(histogram.bounds, tuple(histogram.counts), histogram.sum)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations at or below it)``, ending with ``+inf``."""
        out: list[tuple[float, int]] = []
        total = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out
