"""Log lines of bounded length for what clients control (request paths, say).

uvicorn's access lines carry the whole request path: an 8 KiB query string made an
8 KiB log line for every request. ``LineLimit`` shortens every string argument of
a record (and a message without arguments) beyond ``MAX_PART_CHARS``, keeping its
start and saying how much went; the arguments stay arguments, since uvicorn's
access formatter unpacks them.
"""

from __future__ import annotations

import logging
from typing import Final

__all__ = ["MAX_PART_CHARS", "LineLimit", "limit_lines"]

MAX_PART_CHARS: Final = 512

# The loggers whose lines quote requests: uvicorn's access log and its error log
# (which logs websocket requests, "WebSocket /path" [accepted]).
_LOGGERS: Final = ("uvicorn.access", "uvicorn.error")


def _cut(text: str, max_chars: int) -> str:
    return f"{text[:max_chars]}... ({len(text) - max_chars} more characters)"


class LineLimit(logging.Filter):
    def __init__(self, max_chars: int = MAX_PART_CHARS) -> None:
        super().__init__()
        self.max_chars = max_chars

    def filter(self, record: logging.LogRecord) -> bool:
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
