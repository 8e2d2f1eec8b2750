"""A fresh scratch database per test (``cs_<module>_<random>``), dropped with its slots."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from tests.pgdb import scratch_database


@pytest.fixture
async def db_url(pg_url: str, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    async with scratch_database(pg_url, f"cs_{module}_{uuid.uuid4().hex[:10]}") as url:
        yield url
