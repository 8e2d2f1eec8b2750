"""The environment a child process gets: an allow-list, never the whole of ours.

Our own environment holds the upstream URL with its password
(``ZERO_UPSTREAM_DB``), the admin and operator passwords and whatever else the
deployment sets; a child that inherited it all would hold secrets it never reads
(and show them to anyone who can read its ``/proc/<pid>/environ`` or a crash
dump of it). So every child we start gets what ``child_env`` builds: what any
process needs (the locale, the time zone, the search path, the allocator and
loader settings), and, when asked, what a Python child or litestream reads —
plus the few values its caller names explicitly (``extra``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

__all__ = ["child_env"]

# What any process reads: the search path, home, locale, time zone, temporary
# directory, the allocator (app/runtime/memory.py sets MALLOC_MMAP_THRESHOLD_ for
# the children) and the loader (faketime's LD_PRELOAD in tests, for one).
_BASE_NAMES: Final = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "LD_LIBRARY_PATH"}
)
_BASE_PREFIXES: Final = ("LC_", "MALLOC_", "LD_PRELOAD", "FAKETIME")

# A Python child of ours: the interpreter's own settings, the virtualenv, the
# C-helpers switch (app/speedups.py).
_PYTHON_NAMES: Final = frozenset({"VIRTUAL_ENV", "CHANGESTREAMER_SPEEDUPS"})
_PYTHON_PREFIXES: Final = ("PYTHON",)

# litestream (Go) and its VFS extension: storage credentials and endpoints as the
# AWS, Azure and Google SDKs read them, litestream's own LITESTREAM_* variables,
# TLS trust, proxies, and the Go runtime's knobs.
_STORAGE_NAMES: Final = frozenset(
    {
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "GOMAXPROCS",
        "GOMEMLIMIT",
        "GOGC",
        "GODEBUG",
    }
)
_STORAGE_PREFIXES: Final = ("AWS_", "LITESTREAM_", "AZURE_", "GOOGLE_")


def child_env(
    *,
    python: bool = False,
    storage: bool = False,
    extra: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The allow-listed part of ``environ`` (default ours), plus ``extra``.

    ``python``: the child is a Python process of ours. ``storage``: it reaches the
    backup destination (litestream, the VFS worker). Nothing named ``ZERO_*`` passes
    unless the caller puts it in ``extra``.
    """
    source = os.environ if environ is None else environ
    names = set(_BASE_NAMES)
    prefixes = list(_BASE_PREFIXES)
    if python:
        names |= _PYTHON_NAMES
        prefixes += _PYTHON_PREFIXES
    if storage:
        names |= _STORAGE_NAMES
        prefixes += _STORAGE_PREFIXES
    chosen = tuple(prefixes)
    env = {k: v for k, v in source.items() if k in names or k.startswith(chosen)}
    if extra:
        env.update(extra)
    return env
