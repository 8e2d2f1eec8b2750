"""Reconnect delays for the service's stream loop: 25 ms doubling up to 10 s.

The service asks for ``next_delay()`` after each failed or broken stream and calls
``reset()`` once a stream has made progress (zero resets after a stored commit),
so a healthy upstream that drops now and then reconnects quickly while a dead one
is retried at most every ``max_s``.
"""

from __future__ import annotations


class Backoff:
    """Exponential delays: ``initial_s``, then doubled each call, capped at ``max_s``."""

    def __init__(self, initial_s: float = 0.025, max_s: float = 10.0, factor: float = 2.0) -> None:
        if initial_s <= 0:
            raise ValueError(f"initial_s must be positive, got {initial_s}")
        if max_s < initial_s:
            raise ValueError(f"max_s ({max_s}) must not be below initial_s ({initial_s})")
        if factor < 1:
            raise ValueError(f"factor must be at least 1, got {factor}")
        self._initial_s = initial_s
        self._max_s = max_s
        self._factor = factor
        self._next_s = initial_s

    def next_delay(self) -> float:
        """The delay to wait now; the following call returns a longer one (up to the cap)."""
        delay = self._next_s
        self._next_s = min(self._max_s, self._next_s * self._factor)
        return delay

    def reset(self) -> None:
        """Starts over at ``initial_s`` (call it after a stream made progress)."""
        self._next_s = self._initial_s
