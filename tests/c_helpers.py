"""The C helpers as the tests see them.

The tests that compare a C helper with its pure-Python twin import the helper
directly: ``CHANGESTREAMER_SPEEDUPS`` decides what the service runs (app/speedups.py),
not whether a built helper can be checked. Without a C compiler at install time a
helper is not built and the tests of it skip, saying so.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def built(module: str) -> ModuleType | None:
    """The extension ``module`` if the install built it, else None."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def needs(module: ModuleType | None, name: str) -> pytest.MarkDecorator:
    """Skips a test of the C helper ``name`` when it is not built."""
    return pytest.mark.skipif(
        module is None, reason=f"{name} is not built (no C compiler when the package was installed)"
    )
