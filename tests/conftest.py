"""Fixtures shared by the whole suite.

Tests that touch Postgres use the real server on 127.0.0.1:5432 that the README's
test command makes sure is running (``scripts/ensure-postgres``). They do not skip
when it is missing: a missing database is a failed setup, not a passed test.
"""

from __future__ import annotations

import os

import pytest

PG_URL = os.environ.get(
    "CHANGESTREAMER_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/changestreamer_test"
)


@pytest.fixture(scope="session")
def pg_url() -> str:
    return PG_URL
