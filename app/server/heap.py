"""What the heap holds, for ``GET /heapz`` (wire.md §4.1; a Python port's own format).

Two views, as text:

* **objects by type**: how many objects the garbage collector tracks, by type
  (containers and instances: the things that pile up when something leaks);
* **allocations** (``tracemalloc``): the source lines whose allocations are still
  alive, biggest first. Tracing costs every allocation a few times its price, so
  it is on only for a window the request asks for (``seconds``), unless the
  operator started it for the whole process (``PYTHONTRACEMALLOC``). What the
  window shows is what was allocated during it and is still held at its end:
  growth, which is what a leak looks like.

A full snapshot can be downloaded instead and read with
``tracemalloc.Snapshot.load(path)`` (``statistics("traceback")`` for the stacks).
One tracing window at a time; reading the object counts walks every tracked
object on the event loop (tens of ms per million objects).
"""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile
import tracemalloc
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

__all__ = ["HeapBusy", "HeapTracer", "dump_bytes", "render_report"]

TRACE_FRAMES = 25  # frames kept per allocation: enough for an asyncio stack
TOP = 30  # lines per section


class HeapBusy(Exception):
    """A tracing window is already open."""


class HeapTracer:
    """Opens tracemalloc windows, one at a time."""

    def __init__(self) -> None:
        self._busy = False

    @property
    def busy(self) -> bool:
        return self._busy

    async def snapshot(
        self, seconds: float, window: Callable[[float], Awaitable[object]] = asyncio.sleep
    ) -> tracemalloc.Snapshot | None:
        """A snapshot of what was allocated in the next ``seconds`` and is still held
        (everything since start-up if the process traces already); None for
        ``seconds`` 0 without process-wide tracing. ``window(seconds)`` is the wait
        (it may end early: the caller's client left)."""
        if self._busy:
            raise HeapBusy("a heap tracing window is already open")
        already = tracemalloc.is_tracing()
        if seconds <= 0:
            return tracemalloc.take_snapshot() if already else None
        self._busy = True
        try:
            if not already:
                tracemalloc.start(TRACE_FRAMES)
            try:
                await window(seconds)
                return tracemalloc.take_snapshot()
            finally:
                if not already:
                    tracemalloc.stop()
        finally:
            self._busy = False


def render_report(snapshot: tracemalloc.Snapshot | None, seconds: float) -> str:
    lines = ["=== objects by type (tracked by the garbage collector) ==="]
    objects = gc.get_objects()
    counts = Counter(type(o).__qualname__ for o in objects)
    lines.append(f"total: {len(objects)}")
    del objects
    lines += [f"{n:>10}  {name}" for name, n in counts.most_common(TOP)]
    lines.append("")
    if snapshot is None:
        lines.append("=== allocations ===")
        lines.append("not traced: ask for a window with ?seconds=N (1 to 60)")
    else:
        window = f"the last {seconds:g} s" if seconds > 0 else "process start-up"
        stats = snapshot.statistics("lineno")
        total = sum(s.size for s in stats)
        lines.append(f"=== allocations still held, made since {window} (tracemalloc) ===")
        lines.append(f"total: {total / 1024:.1f} KiB in {sum(s.count for s in stats)} blocks")
        for s in stats[:TOP]:
            frame = s.traceback[0]
            lines.append(
                f"{s.size / 1024:>10.1f} KiB {s.count:>8}  {frame.filename}:{frame.lineno}"
            )
    return "\n".join(lines) + "\n"


def dump_bytes(snapshot: tracemalloc.Snapshot) -> bytes:
    """The snapshot in ``Snapshot.dump``'s format (a pickle), via a temporary file."""
    fd, name = tempfile.mkstemp(prefix="changestreamer-heap-", suffix=".tracemalloc")
    os.close(fd)
    path = Path(name)
    try:
        snapshot.dump(name)
        return path.read_bytes()
    finally:
        path.unlink(missing_ok=True)
