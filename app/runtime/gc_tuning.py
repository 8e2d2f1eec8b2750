"""Garbage-collector settings for a long-running streaming process.

CPython's cyclic collector starts a young-generation pass every 700 net new
container objects (tuples, lists, dicts, instances). A change in flight is a few
such objects that live until it is stored and acked, so at tens of thousands of
changes a second the collector runs hundreds of times a second and mostly
traverses live, queued changes, promoting them to older generations that are
traversed again. Measured with ``bench.fanout`` (in process, K = 1): ~1,400
young passes per 200,000 changes and event-loop CPU per change 14–18 µs with the
settings below against 20–24 µs without.

* ``gc.freeze()`` after start-up moves everything built so far (modules, the
  app, configuration) out of the collector's view: full collections then cost in
  proportion to what the service holds, not to everything it ever imported.
* A young-generation threshold of 50,000: a pass then mostly finds changes that
  were already freed by reference counting. Short-lived cyclic garbage waits for
  at most one such pass; but what outlived two young passes is in the oldest
  generation, which a full pass examines rarely (after ten middle passes, and
  only once a quarter of the long-lived objects are new). So what a connection
  builds must not form reference cycles: each closed connection stayed in memory
  with its buffers until then (issue 25: +140 MiB after a 2,000-connection
  flood; ``tests/server/test_connection_cleanup.py`` runs one with the collector
  off).

``before_exit()`` collects everything once more when the server has stopped. An
aiosqlite connection runs a non-daemon thread that stops only when the
connection is closed or collected; one dropped inside a reference cycle (an
exception's traceback is enough) waits for a collector pass, and with the raised
threshold that pass may never come before the interpreter joins its threads at
exit: the process hung (seen once in a test that stops `serve` mid-stream).
"""

from __future__ import annotations

import gc
from typing import Final

YOUNG_THRESHOLD: Final = 50_000


def tune_for_streaming(young_threshold: int = YOUNG_THRESHOLD) -> None:
    """Freezes what start-up built and raises the young-generation threshold."""
    if young_threshold < 1:
        raise ValueError(f"young_threshold must be at least 1, got {young_threshold}")
    gc.collect()  # what is garbage now must not be frozen
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)


def before_exit() -> None:
    """Collects all cyclic garbage, frozen or not: what it holds (threads) can end."""
    gc.unfreeze()
    gc.collect()
