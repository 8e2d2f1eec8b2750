"""The oracle: Postgres is the truth; every follower and the replica must equal it.

* :func:`stream_counts` — per follower, from the ``seq`` values: *lost* = committed
  upstream but never received, *duplicated* = received more than once (a
  transaction delivered again after a resume).
* :func:`row_differences` — a follower's applied ``items`` against Postgres's,
  row by row, every column.
* :func:`replica_differences` — the service's replica file (``ZERO_REPLICA_FILE``,
  read-only) against Postgres, ``items`` and ``seq``, row by row.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from faults.subscriber import Follower
from faults.upstream import pg_rows

__all__ = [
    "Snapshot",
    "StreamCounts",
    "replica_differences",
    "row_differences",
    "snapshot",
    "stream_counts",
    "wait_replica_matches",
]

Row = tuple[int, str | None]


@dataclass(frozen=True)
class Snapshot:
    """Postgres's ``items`` (id → (n, s)) and ``seq`` values at one moment."""

    items: dict[int, Row]
    seqs: list[int]


async def snapshot(url: str) -> Snapshot:
    items = {r[0]: (r[1], r[2]) for r in await pg_rows(url, "SELECT id, n, s FROM items")}
    seqs = [r[0] for r in await pg_rows(url, "SELECT seq FROM seq ORDER BY seq")]
    return Snapshot(items, seqs)


@dataclass(frozen=True)
class StreamCounts:
    lost: list[int]
    duplicated: list[int]


def stream_counts(follower: Follower, truth: Snapshot) -> StreamCounts:
    got = Counter(follower.seqs)
    lost = [s for s in truth.seqs if s not in got]
    duplicated = sorted(s for s, n in got.items() if n > 1)
    return StreamCounts(lost, duplicated)


def _differences(label: str, expected: dict[int, Row], actual: dict[int, Row]) -> list[str]:
    return [
        f"{label} items {key}: upstream {expected.get(key)} {label} {actual.get(key)}"
        for key in sorted(expected.keys() | actual.keys())
        if expected.get(key) != actual.get(key)
    ]


def row_differences(follower: Follower, truth: Snapshot) -> list[str]:
    return _differences(follower.name, truth.items, follower.rows)


def _replica(path: Path) -> tuple[dict[int, Row], list[int]]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        items = {r[0]: (r[1], r[2]) for r in conn.execute("SELECT id, n, s FROM items")}
        seqs = [r[0] for r in conn.execute("SELECT seq FROM seq ORDER BY seq")]
    finally:
        conn.close()
    return items, seqs


def replica_differences(path: Path, truth: Snapshot) -> list[str]:
    items, seqs = _replica(path)
    problems = _differences("replica", truth.items, items)
    if seqs != truth.seqs:
        missing = sorted(set(truth.seqs) - set(seqs))
        extra = sorted(set(seqs) - set(truth.seqs))
        repeated = len(seqs) - len(set(seqs))
        problems.append(
            f"replica seq: missing {missing[:10]} ({len(missing)}), extra {extra[:10]}, "
            f"repeated {repeated}"
        )
    return problems


async def wait_replica_matches(url: str, path: Path, timeout_s: float) -> list[str]:
    """Until the replica equals Postgres (the writer stopped); [] or the differences."""
    deadline = time.monotonic() + timeout_s
    while True:
        truth = await snapshot(url)
        problems = await asyncio.to_thread(replica_differences, path, truth)
        if not problems or time.monotonic() >= deadline:
            return problems
        await asyncio.sleep(0.2)
