"""The durable end of the change log, kept in memory for catch-ups near the head.

A subscriber that reconnects a moment after it left (a view-syncer's socket
dropped, a deploy rolling through) resumes a few transactions behind the head.
Its catch-up used to read those rows back from the change DB: a thread hop and a
SQLite read per batch, which under churn took the GIL from the live stream
(``bench.churn``, decision 43). ``LogTail`` keeps the rows of the last durable
transactions, the very tuples the storer wrote, up to a budget of memory; a catch-up
whose starting transaction is still held reads from here, and any other reads
the change DB as before. Both give the same rows, so what the subscriber
receives is the same either way (``tests/streamer/test_tail.py``).

What it holds is always a contiguous run of whole transactions ending at the
storer's durable watermark: a transaction too big for the budget, or rows the
storer did not write itself (another owner's, after a takeover), empty it, and
every purge of the change log drops what is below its floor first
(``ChangeLog.before_purge``), so a watermark a purge made too old is refused
exactly as before.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from app.storage import StoredRow

__all__ = ["DEFAULT_TAIL_BYTES", "LogTail"]

# 16 MiB of memory: at bench.churn's saturating pace (~30k small changes a second)
# about half a second of the stream, far more at everyday rates.
DEFAULT_TAIL_BYTES = 16 * 1024 * 1024
# What a held transaction costs besides its text, so the budget bounds memory, not
# text: a row's tuple and its text's str header (~120 bytes), a transaction's list
# and its entries here. Counting text alone, a 1-row transaction (~220 bytes of
# text) held 3.1 times its count (tracemalloc; tests/streamer/test_tail.py).
ROW_BYTES = 120
TX_BYTES = 120


class LogTail:
    """Whole durable transactions, oldest first, in at most about ``budget_bytes`` of
    memory (their text, and ``ROW_BYTES`` a row and ``TX_BYTES`` a transaction)."""

    def __init__(self, budget_bytes: int = DEFAULT_TAIL_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be at least 0, got {budget_bytes}")
        self._budget = budget_bytes
        # Parallel lists from index _first on (dropping from the front moves
        # _first; the lists are compacted once half of them is dropped).
        self._marks: list[str] = []  # commit watermarks, ascending
        self._rows: list[list[StoredRow]] = []
        self._sizes: list[int] = []
        self._first = 0
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._marks) - self._first

    @property
    def first(self) -> str | None:
        return self._marks[self._first] if len(self) else None

    @property
    def last(self) -> str | None:
        return self._marks[-1] if len(self) else None

    def add(self, watermark: str, rows: list[StoredRow], text_bytes: int) -> None:
        """The transaction that became durable right after the last one held
        (``text_bytes``: the UTF-8 length of its rows' changes)."""
        size = text_bytes + len(rows) * ROW_BYTES + TX_BYTES
        if size > self._budget:
            self.clear()
            return
        if len(self) and watermark <= self._marks[-1]:
            raise ValueError(f"transaction {watermark} does not follow {self._marks[-1]}")
        self._marks.append(watermark)
        self._rows.append(rows)
        self._sizes.append(size)
        self.bytes += size
        while self.bytes > self._budget:
            self._drop_first()

    def clear(self) -> None:
        self._marks, self._rows, self._sizes = [], [], []
        self._first = 0
        self.bytes = 0

    def forget_before(self, watermark: str) -> None:
        """Drops the transactions below ``watermark`` (a purge is about to delete them)."""
        while len(self) and self._marks[self._first] < watermark:
            self._drop_first()

    def rows_from(self, start: str, up_to: str) -> list[list[StoredRow]] | None:
        """The rows of transaction ``start`` and of those after it through ``up_to``,
        a list per transaction (not joined: a reader that leaves early costs only
        what it read), or None unless all of them are held."""
        if not len(self) or up_to > self._marks[-1]:
            return None
        i = bisect_left(self._marks, start, self._first)
        if i == len(self._marks) or self._marks[i] != start:
            return None
        return self._rows[i : bisect_right(self._marks, up_to, i)]

    def _drop_first(self) -> None:
        i = self._first
        self.bytes -= self._sizes[i]
        self._rows[i] = []  # let go of the rows now, not at the compaction
        self._first = i + 1
        if self._first == len(self._marks):
            self.clear()
        elif self._first > 64 and self._first * 2 > len(self._marks):
            del self._marks[: self._first], self._rows[: self._first], self._sizes[: self._first]
            self._first = 0
