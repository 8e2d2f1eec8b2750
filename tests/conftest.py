"""Fixtures shared by the whole suite.

Tests that touch Postgres use the real server on 127.0.0.1:5432 that the README's
test command makes sure is running (``scripts/ensure-postgres``). They do not skip
when it is missing: a missing database is a failed setup, not a passed test.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator

import pytest

from app.logs import UVICORN_LOGGERS

PG_URL = os.environ.get(
    "CHANGESTREAMER_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/changestreamer_test"
)


@pytest.fixture(scope="session")
def pg_url() -> str:
    return PG_URL


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Undoes ``app.logs.configure_logging`` (which a command run in-process calls)."""
    root = logging.getLogger()
    handlers, level, hook = list(root.handlers), root.level, sys.excepthook
    uvicorn = {
        n: (list(logging.getLogger(n).handlers), logging.getLogger(n).propagate)
        for n in UVICORN_LOGGERS
    }
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        sys.excepthook = hook
        logging.captureWarnings(False)
        for name, (old, propagate) in uvicorn.items():
            logging.getLogger(name).handlers[:] = old
            logging.getLogger(name).propagate = propagate


@pytest.fixture
def usual_umask() -> Iterator[None]:
    """The umask most systems start with (022): a file made without care is then 0644."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)
