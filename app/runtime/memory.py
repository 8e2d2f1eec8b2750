"""Freed large buffers go back to the operating system (glibc's allocator).

glibc serves a request above its *mmap threshold* with a mapping of its own, which
``free`` unmaps at once; smaller ones come from the heap, whose freed space stays
in the process. The threshold is dynamic: each time a mapped block is freed it
rises to that block's size (up to 32 MiB on 64-bit), so after one 20 MB value every
later 20 MB buffer — the value's text, its JSON, its frame — comes from the heap
and is kept after use (``bench.big_values``: the service stayed ~2× the largest
value above its level). Setting the threshold fixes it (glibc then stops adjusting
it): buffers of ``LARGE_BYTES`` and more are mapped and returned when freed, at the
price of an ``mmap`` per such buffer, which only large values make.

``MALLOC_MMAP_THRESHOLD_`` in the environment gives the child processes started
afterwards (the SQLite writer, the replica follower) the same setting at their
start.

Small blocks still come from the heap, and what a crowd of connections left there
stayed after they closed (``bench.churn``'s flood: +110 MiB after 2,000 connections
came and went; the heap now returns to its size). ``trim_periodically`` calls
``malloc_trim(0)`` every ``TRIM_INTERVAL_S`` in a worker thread (ctypes releases
the GIL; the loop goes on), which gives the free pages inside the heap back as
well. Elsewhere than glibc all of this does nothing. Python's own small-object
arenas are not glibc's: what a flood leaves there (docs/reliability.md, "Churn and
floods") is free space an arena keeps while one live object is in it, and a later
flood reuses it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Any, Final

__all__ = ["LARGE_BYTES", "TRIM_INTERVAL_S", "return_large_frees", "trim_periodically"]

log = logging.getLogger(__name__)

LARGE_BYTES: Final = 1 << 20
_M_MMAP_THRESHOLD: Final = -3  # glibc's malloc.h
ENV: Final = "MALLOC_MMAP_THRESHOLD_"


TRIM_INTERVAL_S: Final = 10.0


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


async def trim_periodically(interval_s: float = TRIM_INTERVAL_S) -> None:
    """Returns the heap's free pages to the OS every ``interval_s`` until cancelled;
    ends at once where there is no ``malloc_trim``."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(trim, 0)


def return_large_frees(threshold: int = LARGE_BYTES) -> bool:
    """Sets the mmap threshold in this process and for its later children; True if
    the allocator took it. An operator's own ``MALLOC_MMAP_THRESHOLD_`` (which glibc
    read at start) is left as it is."""
    if ENV in os.environ:
        return True
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    taken = bool(mallopt(_M_MMAP_THRESHOLD, threshold))
    if taken:
        os.environ[ENV] = str(threshold)
    if not taken:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", threshold)
    return taken
