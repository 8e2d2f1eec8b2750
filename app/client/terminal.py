"""``tail`` and ``status`` for a person at a terminal: rich tables, in colour.

Only when stdout is a terminal (:func:`app.client.render.message_printer`,
:func:`app.client.status.status`); through a pipe or into a file both commands print
their plain text, unchanged, for scripts. rich honours ``NO_COLOR`` and
``TERM=dumb``. Nothing else imports rich, and only these two paths import this module.

``tail``'s table streams: a header, then each message as one row the moment it
arrives (a transaction is never held back until its commit), its columns of fixed
width so that the rows line up::

    WATERMARK      CHANGE       TABLE                   ROW
    02             begin
    02             insert       public.issues           {"id":"a","title":"x"}
    02             commit

``status`` prints one table per stats group.

Every cell, title and value is built by :func:`_text`, which spells out control
characters (:func:`app.logs.escape_controls`): rich passes ESC and C1 codes through.
"""

from __future__ import annotations

import json
from typing import Any, Final, TextIO

from rich import box
from rich.console import Console
from rich.highlighter import JSONHighlighter
from rich.table import Table
from rich.text import Text

from app.client.change_text import change_parts
from app.client.subscription import SubscriptionMessage
from app.logs import escape_controls
from app.protocol.canonical_json import dumps
from app.protocol.messages import Begin, Commit, Data, Rollback
from app.protocol.subscription_messages import DownstreamStatus

__all__ = ["TableMessagePrinter", "print_statz"]

# (title, width, style) of tail's columns; the last one takes the rest of the line.
_COLUMNS: Final = (
    ("WATERMARK", 14, "cyan"),
    ("CHANGE", 12, ""),
    ("TABLE", 24, "bold"),
    ("ROW", None, ""),
)
_CHANGE_STYLES: Final = {
    "begin": "dim",
    "commit": "dim",
    "rollback": "bold red",
    "insert": "green",
    "update": "yellow",
    "delete": "red",
    "truncate": "bold magenta",
    "backfill": "blue",
}
_SCHEMA_CHANGE_STYLE: Final = "bold blue"  # create-table, add-column, …


class TableMessagePrinter:
    """``tail``'s readable form as a table (see the module docstring); ``status``
    messages are left out, as in the text form."""

    def __init__(self, out: TextIO) -> None:
        self._console = Console(file=out, highlight=False)
        self._transaction: str | None = None
        self._header_printed = False

    def write(self, message: SubscriptionMessage) -> None:
        row = self._row(message)
        if row is None:
            return
        if not self._header_printed:
            self._header_printed = True
            self._print([Text(title, style="bold underline") for title, _, _ in _COLUMNS])
        self._print(row)
        self._console.file.flush()

    def _row(self, message: SubscriptionMessage) -> list[Text] | None:
        if isinstance(message, DownstreamStatus):
            return None
        if isinstance(message, Begin):
            self._transaction = message.commit_watermark
            return self._cells(message.commit_watermark, "begin")
        if isinstance(message, Data):
            tag, tables, rest = change_parts(message.body)
            return self._cells(self._transaction or "?", tag, tables, rest)
        if isinstance(message, Commit):
            self._transaction = None
            return self._cells(message.watermark, "commit")
        assert isinstance(message, Rollback)
        watermark, self._transaction = self._transaction, None
        return self._cells(watermark or "", "rollback")

    @staticmethod
    def _cells(watermark: str, change: str, tables: str = "", rest: str = "") -> list[Text]:
        change_style = _CHANGE_STYLES.get(change, _SCHEMA_CHANGE_STYLE)
        return [
            _text(watermark, _COLUMNS[0][2]),
            _text(change, change_style),
            _text(tables, _COLUMNS[2][2]),
            _text(rest),
        ]

    def _print(self, cells: list[Text]) -> None:
        grid = Table.grid(padding=(0, 1), expand=True)
        for _, width, _ in _COLUMNS:
            if width is None:
                grid.add_column(ratio=1, overflow="fold")
            else:
                grid.add_column(width=width, no_wrap=False, overflow="fold")
        grid.add_row(*cells)
        self._console.print(grid)


def print_statz(stats: Any, out: TextIO) -> None:
    """A ``/statz?format=json`` document as one table per group (a document that is
    not an object of groups: as indented JSON)."""
    console = Console(file=out)
    if not isinstance(stats, dict):
        # Not print_json: it would parse the escaped text and write C1 controls raw again.
        text = escape_controls(json.dumps(stats, indent=2, ensure_ascii=False), in_json=True)
        console.print(JSONHighlighter()(Text(text, no_wrap=True)))
        return
    for group, values in stats.items():
        table = Table(
            title=_text(str(group), "bold"),
            title_justify="left",
            box=box.ROUNDED,
            show_header=False,
            expand=False,
        )
        table.add_column(style="cyan", no_wrap=True)
        table.add_column(overflow="fold")
        rows = values.items() if isinstance(values, dict) else [("", values)]
        for key, value in rows:
            table.add_row(_text(str(key)), _value(value))
        console.print(table)


def _value(value: Any) -> Text:
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, bool) or value is None:
        return _text(dumps(value), "italic magenta")
    if isinstance(value, int | float):
        return _text(dumps(value), "bold green")
    return _text(dumps(value), "dim")


def _text(text: str, style: str = "") -> Text:
    """A cell of what the server sent, its control characters spelled out."""
    return Text(escape_controls(text), style=style)
