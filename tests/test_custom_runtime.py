"""``serve``'s custom upstream: the start-up checks (app/runtime/custom.py)."""

from __future__ import annotations

import pytest

from app.config import load_settings
from app.runtime.custom import check_custom_settings, publications_mismatch


def check(**env: str) -> str | None:
    return check_custom_settings(load_settings(environ=env, env_file=None))


def test_pg_and_the_demo_are_not_checked() -> None:
    assert check() is None
    assert check(ZERO_UPSTREAM_DB="postgres://u@h/db") is None


def test_a_custom_upstream_needs_a_websocket_url() -> None:
    assert check(ZERO_UPSTREAM_TYPE="custom", ZERO_UPSTREAM_DB="wss://cs/changes/v0/stream") is None
    assert check(ZERO_UPSTREAM_TYPE="custom", ZERO_UPSTREAM_DB="http://cs/x?apiKey=k") is None
    assert check(ZERO_UPSTREAM_TYPE="custom") == (
        "ZERO_UPSTREAM_TYPE=custom needs ZERO_UPSTREAM_DB: the custom change source's URL "
        "(ws://host/changes/v0/stream)"
    )
    assert check(ZERO_UPSTREAM_TYPE="custom", ZERO_UPSTREAM_DB="postgres://u@h/db") == (
        "ZERO_UPSTREAM_DB: custom change source URL must be ws:// or wss://, got 'postgres'"
    )


@pytest.mark.parametrize(
    ("configured", "synced"),
    [
        (["b", "a"], ("a", "b")),  # compared sorted
        ([], ("a",)),  # none configured: any replica, as in zero
        ([], ()),
    ],
)
def test_matching_publications_pass(configured: list[str], synced: tuple[str, ...]) -> None:
    assert publications_mismatch(configured, synced) is None


def test_other_publications_are_one_line() -> None:
    assert publications_mismatch(["c", "a"], ("b", "a")) == (
        "ZERO_APP_PUBLICATIONS ['a', 'c'] do not match the publications the replica was "
        "synced with ['a', 'b']"
    )
    assert publications_mismatch(["a"], ()) is not None
