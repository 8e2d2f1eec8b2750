"""Files that hold every replicated row are created readable by their owner only.

SQLite creates a database file ``0644`` (less the umask) and its ``-wal``, ``-shm``
and journal files with the mode of the database file, so creating the empty file
``0600`` before SQLite's first open is enough for all of them (an empty file is an
empty database to SQLite). ``create_private`` does that for the replica
(``app.replica.schema.open_replica``) and the SQLite change DB
(``app.storage.engine``, ``app.storage.sqlite_writer``); a restored replica, which
litestream writes, is ``chmod``-ed before it replaces the replica
(``app.backup.restore``).

A file that is already there keeps its mode: an operator may have chosen one (a
group that reads backups, say). Stdlib only.
"""

from __future__ import annotations

import os
from typing import Final

__all__ = ["PRIVATE_MODE", "create_private"]

PRIVATE_MODE: Final = 0o600


def create_private(path: str | os.PathLike[str]) -> None:
    """Creates ``path`` empty and ``0600`` unless something is there already.

    ``O_EXCL``: a file or a link that is there, even one made a moment ago, is left
    as it is, never truncated or followed. Any other failure is left to SQLite's
    own open to report, in its words (a missing directory, a read-only disk)."""
    if os.fspath(path) in ("", ":memory:"):
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_MODE)
    except OSError:
        return
    os.close(fd)
