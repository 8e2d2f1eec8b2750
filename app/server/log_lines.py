"""Log lines that clients cannot multiply or lengthen without bound.

uvicorn's access lines carry the whole request path: an 8 KiB query string made an
8 KiB log line for every request. ``LineLimit`` shortens every string argument of
a record (and a message without arguments) beyond ``MAX_PART_CHARS``, keeping its
start and saying how much went; the arguments stay arguments, since uvicorn's
access formatter unpacks them.

A flood of refused requests must not become a flood of lines either:
``RefusalLog`` logs the first refusal of each status at once and the rest as one
summary line per interval. uvicorn's own line for each refused websocket upgrade
(``"WebSocket /path" 401``) is dropped, since the refusal is logged, bounded, by
whoever refused it (``replication_access.py``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Final

__all__ = ["MAX_PART_CHARS", "LineLimit", "RefusalLog", "limit_lines"]

MAX_PART_CHARS: Final = 512

# The loggers whose lines quote requests: uvicorn's access log and its error log
# (which logs websocket requests, "WebSocket /path" [accepted]).
_LOGGERS: Final = ("uvicorn.access", "uvicorn.error")


# uvicorn's line for an upgrade answered with an HTTP response (the ASGI denial
# extension), as websockets_sansio_impl.py spells it.
_UVICORN_DENIAL_LINE: Final = '%s - "WebSocket %s" %d'


def _cut(text: str, max_chars: int) -> str:
    return f"{text[:max_chars]}... ({len(text) - max_chars} more characters)"


class LineLimit(logging.Filter):
    def __init__(self, max_chars: int = MAX_PART_CHARS) -> None:
        super().__init__()
        self.max_chars = max_chars

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _UVICORN_DENIAL_LINE:
            return False
        limit = self.max_chars
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(
                _cut(a, limit) if isinstance(a, str) and len(a) > limit else a for a in record.args
            )
        elif not record.args and isinstance(record.msg, str) and len(record.msg) > limit:
            record.msg = _cut(record.msg, limit)
        return True


def limit_lines(max_chars: int = MAX_PART_CHARS) -> None:
    """Installs one ``LineLimit`` on each of uvicorn's loggers (once configured)."""
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, LineLimit) for f in logger.filters):
            logger.addFilter(LineLimit(max_chars))


class RefusalLog:
    """Refusals of one kind (``what``: "connection", say), logged at INFO: the
    first of each status at once; later ones counted and logged as one line once
    ``interval_s`` has passed (at the next refusal)."""

    def __init__(self, what: str, logger: logging.Logger, interval_s: float) -> None:
        self._what = what
        self._logger = logger
        self._interval_s = interval_s
        self._logged: set[int] = set()
        self._counts: Counter[int] = Counter()
        self._since = time.monotonic()

    def refused(self, status: int, client: str, why: str) -> None:
        if status not in self._logged:
            self._logged.add(status)
            self._logger.info("refused a %s from %s: %d (%s)", self._what, client, status, why)
            return
        self._counts[status] += 1
        now = time.monotonic()
        if now - self._since >= self._interval_s:
            counts = ", ".join(f"{n} × {code}" for code, n in sorted(self._counts.items()))
            self._logger.info(
                "refused %s more %ss in %.0f s (last from %s: %d, %s)",
                counts,
                self._what,
                now - self._since,
                client,
                status,
                why,
            )
            self._counts.clear()
            self._since = now
