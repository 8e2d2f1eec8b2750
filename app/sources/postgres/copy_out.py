"""``COPY … TO STDOUT`` rows straight from libpq, for a blocking copy thread.

psycopg's ``Copy`` objects cost a generator round trip per row (several µs: most of a
1,000,000-row initial sync). Here each row is one blocking ``get_copy_data`` call (C)
on the connection the thread owns. The connection must be idle (in a transaction or
not) and is idle again when the iteration ends normally; after an error the caller
closes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import pq

__all__ = ["CopyOutError", "copy_out_rows", "finish_copy", "start_copy"]


class CopyOutError(Exception):
    """The COPY failed (the server's message, and its SQLSTATE when it sent one), or
    the connection was lost (``sqlstate`` None)."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def copy_out_rows(conn: psycopg.Connection[Any], query: bytes) -> Iterator[bytes]:
    """Runs ``query`` (a ``COPY … TO STDOUT``) and yields its rows as bytes."""
    pg = start_copy(conn, query)
    try:
        while True:
            n, data = pg.get_copy_data(0)  # blocking
            if n < 0:
                break
            yield bytes(data)
    except psycopg.Error as e:
        raise CopyOutError(f"connection lost during COPY: {e}", e.sqlstate) from e
    finish_copy(pg)


def start_copy(conn: psycopg.Connection[Any], query: bytes) -> pq.abc.PGconn:
    """Sends ``query`` (a ``COPY … TO STDOUT``); the libpq connection, now in COPY OUT.

    Its rows are read with ``get_copy_data`` until it returns a negative count, then
    :func:`finish_copy` reads the COPY's result.
    """
    pg = conn.pgconn
    try:
        pg.send_query(query)
        result = pg.get_result()
    except psycopg.Error as e:
        raise CopyOutError(f"connection lost during COPY: {e}", e.sqlstate) from e
    if result is None or result.status != pq.ExecStatus.COPY_OUT:
        raise CopyOutError(_message(result, "COPY did not start"), _sqlstate(result))
    return pg


def finish_copy(pg: pq.abc.PGconn) -> None:
    """After the last row (or a failed read): the COPY's result, an error if it failed.

    The connection is idle again when this returns normally.
    """
    try:
        final = pg.get_result()
        if final is None or final.status != pq.ExecStatus.COMMAND_OK:
            raise CopyOutError(_message(final, "COPY did not finish"), _sqlstate(final))
        while pg.get_result() is not None:  # the end marker after the last result
            pass
    except psycopg.Error as e:
        raise CopyOutError(f"connection lost during COPY: {e}", e.sqlstate) from e


def _message(result: pq.abc.PGresult | None, default: str) -> str:
    if result is None:
        return default
    text = result.error_message.decode(errors="replace").strip()
    return text or f"{default} (status {pq.ExecStatus(result.status).name})"


def _sqlstate(result: pq.abc.PGresult | None) -> str | None:
    if result is None:
        return None
    code = result.error_field(pq.DiagnosticField.SQLSTATE)
    return code.decode() if code else None
