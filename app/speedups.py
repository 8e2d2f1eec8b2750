"""Which C helpers run: the one place that imports them.

Six small C extensions, built by the package build when a compiler is there
(setup.py, optional: without one the install still succeeds), each with a
pure-Python twin that has the same contract (docs/architecture.md, decisions 29,
30, 32, 35 and 38):

* ``jsscan`` — ``app/protocol/_jsscan.c``: canonical JSON's scan and fast path
  (``app/protocol/canonical_json.py``)
* ``wsfast`` — ``app/protocol/_wsfast.c``: v6 frames written, ack frames read
  (``app/protocol/wsframes.py``)
* ``rowrun`` — ``app/streamer/_rowrun.c``: a run of row changes in one call
  (``app/streamer/rowrun.py``)
* ``fanout`` — ``app/streamer/_fanout.c``: the per-subscriber fan-out loops
  (``app/streamer/subscriber.py``, ``app/streamer/downstream.py``)
* ``pgrows`` — ``app/sources/postgres/_pgrows.c``: a pgoutput row change decoded
  and mapped in one call (``app/sources/postgres/mapper.py``)
* ``copyload`` — ``app/sources/postgres/_copyload.c``: an initial sync's COPY rows
  from libpq into the replica, a batch per call without the GIL
  (``app/sources/postgres/copy_load.py``)

``module(name)`` is the loaded extension, or None when its twin runs. Each is
imported on first request, not when this module is: importing ``app.protocol._jsscan``
imports the ``app.protocol`` package, whose ``canonical_json`` asks for it.
``CHANGESTREAMER_SPEEDUPS=0`` forces every twin (``1``, or unset, uses what was
built); it is read once, when this module is first imported, from the process
environment. Any other value raises :class:`SpeedupsSettingError` right then.

Stdlib only, so every layer may import it.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Final

__all__ = [
    "ENABLED",
    "ENV",
    "NAMES",
    "SpeedupsSettingError",
    "active",
    "load",
    "module",
    "requested",
    "summary",
]

ENV: Final = "CHANGESTREAMER_SPEEDUPS"

# name -> the extension module (setup.py builds each one from its .c beside it).
_MODULES: Final[Mapping[str, str]] = {
    "jsscan": "app.protocol._jsscan",
    "wsfast": "app.protocol._wsfast",
    "rowrun": "app.streamer._rowrun",
    "fanout": "app.streamer._fanout",
    "pgrows": "app.sources.postgres._pgrows",
    "copyload": "app.sources.postgres._copyload",
}
NAMES: Final = tuple(_MODULES)


class SpeedupsSettingError(ValueError):
    """``CHANGESTREAMER_SPEEDUPS`` has a value other than 0 or 1; one line naming it."""


def requested(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` allows the C helpers: ``CHANGESTREAMER_SPEEDUPS`` unset,
    empty (unset, as for every setting) or ``1``; ``0`` forbids them."""
    value = environ.get(ENV, "").strip()
    if value in ("", "1"):
        return True
    if value == "0":
        return False
    raise SpeedupsSettingError(
        f"invalid setting {ENV}: must be 0 (pure Python) or 1 (the C helpers) (got {value!r})"
    )


# Read once: which implementation a module picked at import cannot change later.
ENABLED: Final = requested(os.environ)


def load(module: str) -> ModuleType | None:
    """``module`` imported, or None when speedups are off or it was not built.

    For the service's six (below) and for helpers outside the package that follow
    the same switch (the benchmark subscriber's ``bench._rawscan``).
    """
    if not ENABLED:
        return None
    try:
        return importlib.import_module(module)
    except ImportError:  # not built here (no C compiler): same answers, slower
        return None


@functools.cache
def module(name: str) -> ModuleType | None:
    """The C helper ``name`` (one of ``NAMES``), or None: its pure-Python twin runs."""
    return load(_MODULES[name])


def active() -> dict[str, bool]:
    """Each helper's name → True when its C version runs."""
    return {name: module(name) is not None for name in NAMES}


def summary() -> str:
    """One line for the start-up log and ``/statz``: ``C (jsscan, wsfast, rowrun,
    fanout, pgrows, copyload)``, ``pure Python (CHANGESTREAMER_SPEEDUPS=0)``, ``pure Python (not
    built)``, or ``C (jsscan, wsfast); pure Python: rowrun, fanout (not built)``."""
    if not ENABLED:
        return f"pure Python ({ENV}=0)"
    on = [name for name, is_on in active().items() if is_on]
    off = [name for name, is_on in active().items() if not is_on]
    if not on:
        return "pure Python (not built)"
    if not off:
        return f"C ({', '.join(on)})"
    return f"C ({', '.join(on)}); pure Python: {', '.join(off)} (not built)"
