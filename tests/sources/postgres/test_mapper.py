"""Mapper details not visible through a real stream."""

from __future__ import annotations

from app.sources.postgres.mapper import _truncating_ms


def test_commit_time_ms_truncates_toward_zero_as_bigint_division() -> None:
    assert _truncating_ms(1764426733675649) == 1764426733675
    assert _truncating_ms(-1999) == -1  # floor division would give -2
    assert _truncating_ms(-(10**18) - 1) == -(10**15)  # exact, no float rounding
