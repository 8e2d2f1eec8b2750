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
start. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Final

__all__ = ["LARGE_BYTES", "return_large_frees"]

log = logging.getLogger(__name__)

LARGE_BYTES: Final = 1 << 20
_M_MMAP_THRESHOLD: Final = -3  # glibc's malloc.h
ENV: Final = "MALLOC_MMAP_THRESHOLD_"


def return_large_frees(threshold: int = LARGE_BYTES) -> bool:
    """Sets the mmap threshold in this process and for its later children; True if
    the allocator took it. An operator's own ``MALLOC_MMAP_THRESHOLD_`` (which glibc
    read at start) is left as it is."""
    if ENV in os.environ:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is None:
        return False
    taken = bool(mallopt(_M_MMAP_THRESHOLD, threshold))
    if taken:
        os.environ[ENV] = str(threshold)
    if not taken:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", threshold)
    return taken
