"""A fresh scratch database per test (``cs_<module>_<random>``), dropped with its slots;
and a libpq environment of none of the runner's ``PG*`` variables or files."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.pgdb import scratch_database


@pytest.fixture
async def db_url(pg_url: str, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    async with scratch_database(pg_url, f"cs_{module}_{uuid.uuid4().hex[:10]}") as url:
        yield url


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No PG* variable, ~/.pgpass or ~/.postgresql of whoever runs the tests."""
    for name in list(os.environ):
        if name.startswith("PG"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
