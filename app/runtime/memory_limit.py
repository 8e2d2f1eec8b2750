"""The memory this process may use: its cgroup's limit, else the machine's RAM.

zero sizes its back-pressure buffer as a fraction of V8's heap limit
(``ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_HEAP_PROPORTION`` × ``--max-old-space-size``).
CPython has no heap limit; what ends a process that holds too much is the
container's memory limit (an OOM kill), or the machine's RAM without one. So the
proportion applies to that: the cgroup v2 ``memory.max`` or cgroup v1
``memory.limit_in_bytes`` of this process, when it sets one below the RAM.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Final

__all__ = ["DEFAULT_CGROUP_ROOT", "back_pressure_bytes", "memory_limit_bytes"]

log = logging.getLogger(__name__)

DEFAULT_CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
PROC_CGROUP: Final = Path("/proc/self/cgroup")  # which cgroups this process is in


def memory_limit_bytes(
    cgroup_root: Path = DEFAULT_CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP
) -> int | None:
    """The smaller of the cgroup memory limit and the physical RAM (None: neither known)."""
    limits = [
        n for n in (_cgroup_limit(cgroup_root, proc_cgroup), _physical_ram()) if n is not None
    ]
    return min(limits) if limits else None


def back_pressure_bytes(
    explicit: int | None,
    proportion: float | None,
    default: int,
    *,
    limit: int | None = None,
) -> int:
    """The storer's byte budget: ``explicit`` if set (it always wins), else
    ``proportion`` × the memory limit if both are known, else ``default``."""
    if explicit is not None:
        return explicit
    if proportion is None:
        return default
    total = limit if limit is not None else memory_limit_bytes()
    if total is None:
        log.warning(
            "the memory limit is unknown: back pressure uses the default %d bytes instead of "
            "ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_HEAP_PROPORTION=%g",
            default,
            proportion,
        )
        return default
    budget = max(1, int(total * proportion))
    log.info(
        "back pressure at %d bytes queued (%g of the %d-byte memory limit)",
        budget,
        proportion,
        total,
    )
    return budget


def _cgroup_limit(root: Path, proc_cgroup: Path) -> int | None:
    """The tightest memory limit on this process's cgroup and its ancestors (v2's
    ``memory.max`` or v1's ``memory.limit_in_bytes``), None if none is set."""
    try:
        lines = proc_cgroup.read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    candidates: list[Path] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, group = rest.partition(":")
        if hierarchy == "0" and not controllers:  # cgroup v2 (unified)
            candidates += _up(root, group, "memory.max")
            candidates += _up(root / "unified", group, "memory.max")
        elif "memory" in controllers.split(","):  # cgroup v1
            candidates += _up(root / "memory", group, "memory.limit_in_bytes")
    # Without /proc (or in a private cgroup namespace): the mount's root is our group.
    candidates += [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    limits = [n for n in map(_read_limit, candidates) if n is not None]
    return min(limits) if limits else None


def _up(mount: Path, group: str, name: str) -> list[Path]:
    """``name`` in ``group`` and in each of its ancestors under ``mount``."""
    parts = [p for p in group.strip().split("/") if p]
    return [mount.joinpath(*parts[:n], name) for n in range(len(parts), -1, -1)]


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    if not text.isdigit():
        return None  # "max": no limit
    value = int(text)
    # cgroup v1 says "no limit" with a huge number (PAGE_COUNTER_MAX × page size).
    return value if value < 1 << 60 else None


def _physical_ram() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
