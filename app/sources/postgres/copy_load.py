"""A table's ``COPY … TO STDOUT`` rows into the replica, a batch per call.

An initial sync copies each table with :func:`copy_table`: it starts the COPY on the
copy thread's connection and calls :meth:`Loader.load` until the COPY ends. Each call
reads rows from libpq until about ``max_bytes`` of COPY text, inserts them into the
replica in one SQLite transaction (``BEGIN IMMEDIATE``: parallel copy threads take
turns at the write lock) and says how many rows and bytes it took and whether the
COPY ended.

Two implementations, one contract (docs/architecture.md, decision 29):

* the C helper ``_copyload.c`` (``speedups`` name ``copyload``): libpq's rows parsed
  and bound to the prepared INSERT in C, without the GIL for tables whose columns all
  go in as their text (text-like and integer types); a column with a converter calls
  it with the GIL, per row;
* its pure-Python twin :class:`PyLoader`: ``get_copy_data`` per row,
  :func:`~app.sources.postgres.copy_text.parse_copy_line`, the converters and
  ``executemany``.

The C helper calls the libpq that psycopg loaded and the SQLite that the ``sqlite3``
module loaded, through addresses resolved here: one copy of each library in the
process (``_copyload.c`` says why). Where they cannot be resolved (psycopg's pure
Python implementation, an SQLite linked into ``_sqlite3`` without exported symbols)
the twin runs, and :func:`active` says so.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sqlite3
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import psycopg
from psycopg import pq

from app import speedups
from app.sources.postgres.copy_out import CopyOutError, finish_copy, start_copy
from app.sources.postgres.copy_text import CopyFormatError, parse_copy_line

__all__ = [
    "BATCH_BYTES",
    "COPY_ENDED",
    "COPY_FAILED",
    "Converter",
    "Loader",
    "PyLoader",
    "active",
    "copy_table",
    "open_loader",
    "setup_helper",
]

log = logging.getLogger(__name__)

# COPY text per batch (one SQLite transaction): large enough that a transaction's
# fixed cost vanishes, small enough that progress moves and a stop is seen soon.
BATCH_BYTES: Final = 2 << 20

# Loader.load's third value.
MORE_ROWS: Final = 0
COPY_ENDED: Final = 1
COPY_FAILED: Final = 2  # libpq lost the connection; its error message says why

Converter = Callable[[str], Any]


class Loader(Protocol):
    def load(self, pgconn: pq.abc.PGconn, max_bytes: int) -> tuple[int, int, int]:
        """Reads rows from ``pgconn`` (in COPY OUT) until the COPY ends or ``max_bytes``
        of them were read, and inserts them in one transaction: (rows, bytes, state),
        ``state`` one of ``MORE_ROWS``, ``COPY_ENDED``, ``COPY_FAILED`` (then nothing
        of the batch was inserted). A row that does not parse raises
        :class:`CopyFormatError`, an insert that fails the ``sqlite3`` error; either
        way the batch is rolled back."""
        ...

    def parse_line(self, line: bytes | bytearray | memoryview) -> list[str | None]:
        """One COPY row split as :meth:`load` splits it (for the tests)."""
        ...

    def close(self) -> None: ...


class PyLoader:
    """The pure-Python twin of ``_copyload.Loader``."""

    def __init__(
        self, path: Path, insert: str, converters: Sequence[Converter | None], busy_timeout_ms: int
    ) -> None:
        self._insert = insert
        self._n = len(converters)
        self._converters = [(i, c) for i, c in enumerate(converters) if c is not None]
        self._lite = sqlite3.connect(
            path, isolation_level=None, timeout=busy_timeout_ms / 1000, check_same_thread=False
        )
        # The staging file is discarded on failure; the sync's last commit makes it
        # durable (initial_sync._commit).
        self._lite.execute("PRAGMA synchronous = OFF")

    def load(self, pgconn: pq.abc.PGconn, max_bytes: int) -> tuple[int, int, int]:
        rows: list[list[Any]] = []
        size = 0
        state = MORE_ROWS
        n = self._n
        while size < max_bytes:
            try:
                count, data = pgconn.get_copy_data(0)  # blocking
            except psycopg.OperationalError:
                state = COPY_FAILED
                break
            if count < 0:
                state = COPY_ENDED
                break
            size += count
            row: list[Any] = parse_copy_line(data, n)
            for i, convert in self._converters:
                value = row[i]
                if value is not None:
                    row[i] = convert(value)
            rows.append(row)
        if state == COPY_FAILED:
            return 0, size, state
        self._lite.execute("BEGIN IMMEDIATE")
        try:
            self._lite.executemany(self._insert, rows)
        except BaseException:
            self._lite.execute("ROLLBACK")
            raise
        self._lite.execute("COMMIT")
        return len(rows), size, state

    def parse_line(self, line: bytes | bytearray | memoryview) -> list[str | None]:
        return parse_copy_line(line, self._n)

    def close(self) -> None:
        self._lite.close()


def open_loader(
    path: Path, insert: str, converters: Sequence[Converter | None], busy_timeout_ms: int
) -> Loader:
    """A loader for one table: ``insert`` has a ``?`` per COPY column, ``converters``
    a converter (or None: the text as it is) per column."""
    helper = _helper()
    if helper is None:
        return PyLoader(path, insert, converters, busy_timeout_ms)
    loader: Loader = helper.Loader(str(path), insert, tuple(converters), busy_timeout_ms)
    return loader


def copy_table(
    conn: psycopg.Connection[Any],
    query: bytes,
    loader: Loader,
    on_batch: Callable[[int, int], None],
    *,
    max_bytes: int = BATCH_BYTES,
) -> None:
    """Runs ``query`` (a ``COPY … TO STDOUT``) on ``conn`` into ``loader``, calling
    ``on_batch(rows, bytes)`` after each committed batch (it may raise to stop)."""
    pg = start_copy(conn, query)
    while True:
        rows, size, state = loader.load(pg, max_bytes)
        if state == COPY_FAILED:
            message = pg.error_message.decode(errors="replace").strip()
            raise CopyOutError(f"connection lost during COPY: {message}")
        on_batch(rows, size)
        if state == COPY_ENDED:
            break
    finish_copy(pg)


def active() -> bool:
    """Whether the C helper loads the rows (else :class:`PyLoader`)."""
    return _helper() is not None


@functools.cache
def _helper() -> Any:
    module = speedups.module("copyload")
    if module is None or not setup_helper(module):
        return None
    return module


def setup_helper(module: Any) -> bool:
    """Gives the built helper ``module`` the functions it calls; False when they
    cannot be found here (then the twin runs). The tests call it directly."""
    addresses = _library_addresses(module.api_names())
    if addresses is None:
        return False
    module.setup(addresses, CopyFormatError, sqlite3.IntegrityError, sqlite3.OperationalError)
    return True


def _library_addresses(names: Sequence[str]) -> dict[str, int] | None:
    """Each of ``names`` (libpq's ``PQ…`` and SQLite's ``sqlite3_…``) at its address in
    the library the process already uses, or None when one cannot be found.

    ``dlsym`` on a shared object also searches the libraries it depends on, so
    psycopg's extension module leads to its libpq and ``_sqlite3`` to its SQLite.
    """
    import _sqlite3

    libpq_module = sys.modules.get(pq.PGconn.__module__)
    libpq_file = getattr(libpq_module, "__file__", None) or ""
    if not libpq_file.endswith((".so", ".pyd", ".dylib")):
        log.info("COPY rows load in Python: psycopg has no compiled libpq module here")
        return None
    libraries = {"PQ": libpq_file, "sqlite3_": _sqlite3.__file__}
    addresses: dict[str, int] = {}
    try:
        opened = {prefix: ctypes.CDLL(path) for prefix, path in libraries.items()}
        for name in names:
            library = next(lib for prefix, lib in opened.items() if name.startswith(prefix))
            address = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
            if not address:
                return None
            addresses[name] = address
    except (OSError, AttributeError, StopIteration) as e:
        log.info("COPY rows load in Python: %s", e)
        return None
    return addresses
