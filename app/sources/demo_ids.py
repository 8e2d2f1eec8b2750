"""Which rows the demo source may update or delete: ids it inserted, per table.

The demo only touches rows it inserted earlier, and only rows the change log can
hold: a transaction that was sent but never stored (the stream broke first) is
re-generated differently on the next stream, so its effects must be forgotten.
Hence two views:

* ``confirmed``: the effect of every transaction known to be stored (acked, or at
  or below the ``after_watermark`` of a new stream);
* ``working``: ``confirmed`` plus the journal of transactions sent since, which is
  what the generator draws from.

Both are bounded (``max_ids`` per table; an insert beyond that is simply not
tracked), and so is the journal (``max_journal`` unconfirmed transactions; beyond
that the oldest is folded in as if stored). Everything lives in memory: after a
restart the demo knows no ids and inserts until it has some again.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable
from typing import Literal

__all__ = ["BoundedIdSet", "LiveIds", "RowOp"]

# ("insert" | "delete", table, id)
RowOp = tuple[Literal["insert", "delete"], str, str]


class BoundedIdSet:
    """A set of at most ``cap`` ids with O(1) add, remove and random choice."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._ids: list[str] = []
        self._index: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, item: object) -> bool:
        return item in self._index

    def add(self, item: str) -> None:
        if item in self._index or len(self._ids) >= self._cap:
            return
        self._index[item] = len(self._ids)
        self._ids.append(item)

    def discard(self, item: str) -> None:
        i = self._index.pop(item, None)
        if i is None:
            return
        last = self._ids.pop()
        if i < len(self._ids):  # move the last id into the hole
            self._ids[i] = last
            self._index[last] = i

    def choice(self, rng: random.Random) -> str:
        return self._ids[rng.randrange(len(self._ids))]

    def copy(self) -> BoundedIdSet:
        other = BoundedIdSet(self._cap)
        other._ids = list(self._ids)
        other._index = dict(self._index)
        return other


class LiveIds:
    """Confirmed and working id sets per table, plus the journal between them."""

    def __init__(self, tables: Iterable[str], *, max_ids: int, max_journal: int) -> None:
        self._tables = tuple(tables)
        self._max_ids = max_ids
        self._max_journal = max_journal
        self._confirmed = {t: BoundedIdSet(max_ids) for t in self._tables}
        self._working = {t: BoundedIdSet(max_ids) for t in self._tables}
        self._journal: deque[tuple[int, list[RowOp]]] = deque()

    def working(self, table: str) -> BoundedIdSet:
        """The ids the next transaction may update or delete (it updates this as it goes)."""
        return self._working[table]

    def confirmed_count(self, table: str) -> int:
        return len(self._confirmed[table])

    def record(self, watermark: int, ops: list[RowOp]) -> None:
        """Journals a sent transaction whose ops were already applied to ``working``."""
        self._journal.append((watermark, ops))
        while len(self._journal) > self._max_journal:
            self._fold(self._journal.popleft()[1])

    def confirm(self, watermark: int) -> None:
        """Everything up to ``watermark`` is stored."""
        while self._journal and self._journal[0][0] <= watermark:
            self._fold(self._journal.popleft()[1])

    def restart_at(self, watermark: int) -> None:
        """A new stream starts after ``watermark``: later transactions were never stored."""
        self.confirm(watermark)
        self._journal.clear()
        self._working = {t: s.copy() for t, s in self._confirmed.items()}

    def clear(self) -> None:
        """The tables are (re-)created empty."""
        self._confirmed = {t: BoundedIdSet(self._max_ids) for t in self._tables}
        self._working = {t: BoundedIdSet(self._max_ids) for t in self._tables}
        self._journal.clear()

    def _fold(self, ops: list[RowOp]) -> None:
        for op, table, row_id in ops:
            ids = self._confirmed[table]
            if op == "insert":
                ids.add(row_id)
            else:
                ids.discard(row_id)
