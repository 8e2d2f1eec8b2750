"""Printing subscription messages for people (``tail``) or programs (``tail --json``).

Readable form, one line per message, data lines prefixed by their
transaction's commit watermark::

    begin 02
    02  insert public.issues {"id":"a","title":"x"}
    02  update public.issues {"id":"a","title":"y"} key {"id":"a"}
    02  delete public.issues {"id":"a"}
    02  truncate public.issues, public.labels
    02  create-table {"spec":{...}}
    commit 02
    rollback 03

``status`` messages are not shown in the readable form. The JSON form prints
every message, status included, as its canonical JSON tuple on one line
(``["begin",{"tag":"begin"},{"commitWatermark":"02"}]``).

What the server sends reaches a terminal only with its control characters spelled
out (:func:`app.logs.escape_controls`): ``\\x1b[2J`` in a table name is printed as
those 7 characters, a newline in a value as ``\\n``; in the JSON form C1 controls,
DEL and U+2028/9 are ``\\u009b`` escapes (JSON already escapes C0 ones), the same value.

:func:`message_printer` picks the printer: on a terminal the readable form is
:mod:`app.client.terminal`'s table instead (same rows, in columns and colour);
through a pipe or into a file, and for ``--json``, it is the text above, unchanged.
"""

from __future__ import annotations

from typing import Protocol, TextIO

from app.client.change_text import describe_change
from app.client.subscription import SubscriptionMessage
from app.logs import escape_controls
from app.protocol.canonical_json import dumps
from app.protocol.messages import Begin, Commit, Data, Rollback
from app.protocol.subscription_messages import DownstreamStatus

__all__ = ["MessagePrinter", "Printer", "message_printer"]


class Printer(Protocol):
    def write(self, message: SubscriptionMessage) -> None: ...


def message_printer(out: TextIO, *, json_output: bool = False) -> Printer:
    """The table on a terminal (readable form only), the text lines anywhere else."""
    if json_output or not out.isatty():
        return MessagePrinter(out, json_output=json_output)
    from app.client.terminal import TableMessagePrinter  # rich: loaded for terminals only

    return TableMessagePrinter(out)


class MessagePrinter:
    """Writes messages to ``out`` in the readable or the JSON form; flushes each line."""

    def __init__(self, out: TextIO, *, json_output: bool = False) -> None:
        self._out = out
        self._json = json_output
        self._transaction: str | None = None

    def write(self, message: SubscriptionMessage) -> None:
        line = self._line(message)
        if line is not None:
            self._out.write(escape_controls(line, in_json=self._json) + "\n")
            self._out.flush()

    def _line(self, message: SubscriptionMessage) -> str | None:
        if self._json:
            return dumps(message.as_list())
        if isinstance(message, DownstreamStatus):
            return None
        if isinstance(message, Begin):
            self._transaction = message.commit_watermark
            return f"begin {message.commit_watermark}"
        if isinstance(message, Data):
            return f"{self._transaction or '?'}  {describe_change(message.body)}"
        if isinstance(message, Commit):
            self._transaction = None
            return f"commit {message.watermark}"
        assert isinstance(message, Rollback)
        watermark, self._transaction = self._transaction, None
        return "rollback" if watermark is None else f"rollback {watermark}"
