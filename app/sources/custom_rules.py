"""The rules a custom change source must keep (spec/source.md §1.6, §1.7, §1.8, §2.4).

The message parser already refuses a watermark that is not a LexiVersion
(``major`` or ``major.minor``); :class:`StreamRules` checks what one message alone
cannot show, in stream order:

* a transaction's commit watermark (known at its ``begin``) is greater than the
  ``lastWatermark`` the stream was started with and than the previous commit of the
  stream — the change log's key is the commit watermark, so a repeated or older one
  would collide with a stored transaction or break the subscribers' resume order;
* ``commit`` carries its ``begin``'s commit watermark;
* status and commit watermarks together never go backwards (a status is a position
  "the log has reached here"; what follows it cannot be behind it);
* ``create-table`` / ``add-column`` carry no ``backfill`` field: custom sources
  cannot be asked for backfills on restart (they refuse backfill requests), so a
  column announced as "filled later" would stay hidden in the replica for good;
* every column default (``dflt``) of a ``create-table`` / ``add-column`` is a literal
  the replica accepts (:func:`app.replica.ddl.map_default`, the one rule: a number,
  ``true``/``false``, a quoted string with a ``::type`` cast, an empty array, or
  none). The replica splices an added column's default into SQLite DDL, and so
  does every zero-cache that replicates from this change log: anything else could
  carry SQL in (issue 25), so it is refused before it is stored.

Checked at ``begin`` where possible, so nothing of a transaction that breaks them is
forwarded. The Postgres source derives its watermarks from commit LSNs, which keep
these rules by construction; only the custom source checks them.

Framing errors (``data`` or ``commit`` outside a transaction, ``begin`` inside one)
are the service's to detect (``app/streamer/service.py``); these rules ignore them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from app.protocol.messages import Begin, ChangeSourceMessage, Commit, Data, Rollback, Status
from app.replica.ddl import lite_table_name, map_default, shown_default
from app.replica.errors import UnsupportedColumnDefaultError

__all__ = ["StreamRules"]

# Schema changes that may name columns to backfill and carry column defaults
# (spec/source.md §1.6).
_BACKFILL_TAGS: Final = frozenset({"create-table", "add-column"})


class StreamRules:
    """Checks one stream's messages in order; ``check`` returns the broken rule or None.

    The text completes "custom change source … sent …" (the stream's error line).
    ``after_watermark`` is the stream's ``lastWatermark`` (None for an initial sync).
    """

    def __init__(self, after_watermark: str | None) -> None:
        self._after = after_watermark
        self._last_commit: str | None = None
        # The newest commit or status watermark: the stream's reported position.
        self._position: str | None = None
        self._position_kind = ""
        self._open: str | None = None  # the open transaction's commit watermark

    def check(self, message: ChangeSourceMessage) -> str | None:
        kind = type(message)
        if kind is Data:
            assert isinstance(message, Data)
            return _backfill_problem(message) or _default_problem(message)
        if kind is Begin:
            assert isinstance(message, Begin)
            return self._begin(message.commit_watermark)
        if kind is Commit:
            assert isinstance(message, Commit)
            return self._commit(message.watermark)
        if kind is Status:
            assert isinstance(message, Status)
            return self._status(message.watermark)
        if kind is Rollback:
            self._open = None  # its watermark was never committed: it may come again
        return None

    def _begin(self, watermark: str) -> str | None:
        if self._after is not None and watermark <= self._after:
            return (
                f"a begin with commitWatermark {watermark}, not after lastWatermark "
                f"{self._after} the stream was started with (it is stored already)"
            )
        if self._last_commit is not None and watermark <= self._last_commit:
            return (
                f"a begin with commitWatermark {watermark}, not after the previous commit "
                f"{self._last_commit} (commit watermarks must strictly increase)"
            )
        if self._position is not None and watermark < self._position:
            return (
                f"a begin with commitWatermark {watermark}, behind the {self._position_kind} "
                f"watermark {self._position} sent before it (watermarks never go backwards)"
            )
        self._open = watermark
        return None

    def _commit(self, watermark: str) -> str | None:
        open_tx, self._open = self._open, None
        if open_tx is None:
            return None  # no begin: the service's framing check says so
        if watermark != open_tx:
            return f"a commit with watermark {watermark}, not its begin's commitWatermark {open_tx}"
        self._last_commit = watermark
        self._advance(watermark, "commit")
        return None

    def _status(self, watermark: str) -> str | None:
        if self._position is not None and watermark < self._position:
            return (
                f"a status with watermark {watermark}, behind the {self._position_kind} "
                f"watermark {self._position} sent before it (watermarks never go backwards)"
            )
        self._advance(watermark, "status")
        return None

    def _advance(self, watermark: str, kind: str) -> None:
        self._position = watermark
        self._position_kind = kind


def _backfill_problem(message: Data) -> str | None:
    if message.tag not in _BACKFILL_TAGS or "backfill" not in message.body:
        return None
    return (
        f"{_schema_change(message)} with a 'backfill' field "
        "(custom change sources cannot backfill: leave it out and send the rows)"
    )


def _default_problem(message: Data) -> str | None:
    """A column default that is not a literal the replica accepts, named with its column."""
    if message.tag not in _BACKFILL_TAGS:
        return None
    body = message.body  # its shape is checked already (app.protocol.changes)
    if message.tag == "create-table":
        table, columns = body["spec"], body["spec"]["columns"].items()
    else:
        table, columns = body["table"], [(body["column"]["name"], body["column"]["spec"])]
    for column, spec in columns:
        dflt = spec.get("dflt")
        try:
            map_default(lite_table_name(table["schema"], table["name"]), column, dflt)
        except UnsupportedColumnDefaultError:
            return (
                f"{_schema_change(message)} whose column {column} has the default "
                f"{shown_default(dflt)}, not a literal (a column default must be a number, "
                "true, false, a quoted string with a ::type cast such as 'x'::text, an empty "
                "array, or null)"
            )
    return None


def _schema_change(message: Data) -> str:
    """``a create-table of public.t`` / ``an add-column of public.t``."""
    body = message.body
    table: Any = body.get("spec") if message.tag == "create-table" else body.get("table")
    name = f"{table.get('schema')}.{table.get('name')}" if isinstance(table, Mapping) else "a table"
    article = "an" if message.tag == "add-column" else "a"
    return f"{article} {message.tag} of {name}"
