"""Encoding a run of row changes in one call: the main loop's per-row hot path.

Most of an upstream stream is row changes (insert, update, delete, truncate,
backfill) inside a transaction: each one is serialized once, into the message
text ``["data",<change>]`` of a :class:`~app.streamer.subscriber.Change`, which the
storer (``Storer.append``, which keeps the change object's part) and the
subscribers (``Forwarder.forward``) both take. ``encode_rows`` does that for
consecutive row changes of a batch, so the main loop pays one call per run
instead of a dispatch per row (see docs/architecture.md, decision 30).

It stops *before* any message it does not handle the common way — not a data
message, or a change whose canonical JSON is not orjson's text as-is — and the
caller dispatches that one the general way. Schema changes are row changes here:
the storer finds their bookkeeping by tag (``Storer.append``).

It stops *after* the change that fills the flow-control ``budget`` of forwarded
bytes, so the caller can make that change the checkpoint.

``app/streamer/_rowrun.c`` is the same function in C; this one is the fallback
and the reference the tests compare it against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app import speedups
from app.protocol.canonical_json import encode_fast
from app.protocol.codec import data_message
from app.protocol.messages import Data
from app.streamer.subscriber import Change

__all__ = ["encode_rows"]

EncodeRows = Callable[[list[Any], int, str, list[Change], int], tuple[int, int]]


def encode_rows_py(
    messages: list[Any],
    start: int,
    watermark: str,
    changes: list[Change],
    budget: int,
) -> tuple[int, int]:
    """Encodes the row changes of transaction ``watermark`` at ``messages[start:]``.

    Appends each one's message to ``changes``.
    Returns the index after the last change encoded (``start`` if none) and the
    bytes of message text appended.
    """
    i = start
    end = len(messages)
    used = 0
    while i < end:
        message = messages[i]
        if type(message) is not Data:
            break
        tag = message.tag
        change_json = encode_fast(message.body)
        if change_json is None:
            break
        text = data_message(change_json)
        changes.append(Change(watermark, tag, text))
        used += len(text)
        i += 1
        if used >= budget:
            break
    return i, used


encode_rows: EncodeRows
_rowrun = speedups.module("rowrun")
if _rowrun is None:  # not built here, or CHANGESTREAMER_SPEEDUPS=0: same results, slower
    encode_rows = encode_rows_py
else:
    _rowrun.setup(Data, Change, encode_fast)
    encode_rows = _rowrun.encode_rows
