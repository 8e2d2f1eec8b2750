"""SQLite's own allocated bytes, as the tests of released bindings read them.

``sqlite3_memory_used()`` of the library that Python's ``sqlite3`` module is linked
to (Debian's ``libsqlite3.so.0`` here). Python does not expose it; ctypes reaches
the same loaded library. ``probe()`` checks that the figure moves with a bound
value, so a test cannot pass because it reads another copy of the library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sqlite3

import pytest


def _library() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("sqlite3")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    lib.sqlite3_memory_used.restype = ctypes.c_int64
    return lib


_LIB = _library()


def memory_used() -> int:
    assert _LIB is not None
    return int(_LIB.sqlite3_memory_used())


def probe() -> None:
    """Skips unless ``memory_used`` sees the bindings of this process's sqlite3."""
    if _LIB is None:
        pytest.skip("libsqlite3 not found by ctypes")
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (v TEXT)")
    before = memory_used()
    conn.execute("INSERT INTO t VALUES (?)", ("x" * (4 << 20),))
    conn.execute("DELETE FROM t")
    held = memory_used() - before  # the cached INSERT still holds its binding
    conn.close()
    if held < 4 << 20:
        pytest.skip("sqlite3 is not linked to the libsqlite3 ctypes finds")
