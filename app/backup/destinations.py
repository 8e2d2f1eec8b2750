"""Where a node's backups go: a destination of its own under the backup URL.

litestream v0.5 keeps one chain of LTX files per destination, numbered by the
transactions of the database it backs up. Two litestream processes writing one
destination — the old and the new node during a handoff, or an orphan beside its
successor — interleave two chains under the same numbers, and a restore assembles
pages of two databases: "database disk image is malformed". So, as zero-cache does
since it moved to litestream v0.5, every ``serve`` start backs up into a fresh
sub-path of ``ZERO_LITESTREAM_BACKUP_URL`` (``<ms since the epoch>-<task>-<random>``),
and at most one litestream ever writes a destination.

Who finds it: view-syncers restore from the ``backupURL`` of a reservation's status,
which is this destination; a replacement node restores from the sub-path the owner
recorded upstream when it took the replication slot over (the ``replicas`` row's
``subscriberContext``, ``app/sources/postgres/slots.py``), and from the backup URL
itself when none is recorded (the layout earlier versions wrote).
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Final
from urllib.parse import urlsplit, urlunsplit

__all__ = ["new_backup_path", "resolve"]

# A sub-path is made of these (safe in every URL scheme and file name), this long at most.
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9._-]+")
_TASK_CHARS: Final = 40


def new_backup_path(task_id: str | None, now_ms: int | None = None) -> str:
    """A sub-path for one node's backups: sorts by time, names the task, never repeats."""
    millis = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    task = _UNSAFE.sub("-", task_id or "node").strip("-.")[:_TASK_CHARS] or "node"
    return f"{millis}-{task}-{secrets.token_hex(3)}"


def resolve(base_url: str, path: str | None) -> str:
    """``path`` as a child of ``base_url`` (its query, e.g. ``?endpoint=``, kept);
    ``base_url`` itself without a path."""
    if not path:
        return base_url
    if "/" in path or path in (".", "..") or _UNSAFE.search(path):
        raise ValueError(f"not a backup sub-path: {path!r}")
    parts = urlsplit(base_url)
    joined = parts.path.rstrip("/") + "/" + path
    return urlunsplit((parts.scheme, parts.netloc, joined, parts.query, parts.fragment))
