"""The /dashboard page in a real browser: Debian's chromium, driven by PyPI's
playwright (which downloads no browser of its own; ``scripts/ensure-tools``
installs chromium), against real ``serve`` processes (``tests/serve_pg``'s)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Browser, async_playwright

# The serve processes and scratch upstream databases of tests/serve_pg.
from tests.serve_pg.conftest import serve_factory, upstream  # noqa: F401

CHROMIUM = "chromium"

# Screenshots the tests saved, listed at the end of the run (pytest_terminal_summary).
SCREENSHOTS: list[Path] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if SCREENSHOTS:
        terminalreporter.section("dashboard screenshots")
        for path in SCREENSHOTS:
            terminalreporter.write_line(str(path))


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    executable = shutil.which(CHROMIUM)
    if executable is None:
        pytest.skip(
            "no chromium on PATH: scripts/ensure-tools installs Debian's (apt-get install "
            "chromium), and could not here"
        )
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=executable)
        try:
            yield launched
        finally:
            await launched.close()
