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
"""

from __future__ import annotations

from typing import Any, TextIO

from app.client.subscription import SubscriptionMessage
from app.protocol.canonical_json import dumps
from app.protocol.downstream import DownstreamStatus
from app.protocol.messages import Begin, Commit, Data, Rollback

__all__ = ["MessagePrinter", "describe_change"]


def _table(relation: Any) -> str:
    if isinstance(relation, dict):
        return f"{relation.get('schema')}.{relation.get('name')}"
    return dumps(relation)


def describe_change(body: dict[str, Any]) -> str:
    """``<tag> <details>`` of a data message's body."""
    tag = body.get("tag")
    if tag == "insert":
        return f"insert {_table(body['relation'])} {dumps(body['new'])}"
    if tag == "update":
        text = f"update {_table(body['relation'])} {dumps(body['new'])}"
        key = body.get("key")
        return text if key is None else f"{text} key {dumps(key)}"
    if tag == "delete":
        return f"delete {_table(body['relation'])} {dumps(body['key'])}"
    if tag == "truncate":
        return "truncate " + ", ".join(_table(r) for r in body["relations"])
    if tag == "backfill":
        return f"backfill {_table(body['relation'])} {len(body['rowValues'])} rows"
    rest = {k: v for k, v in body.items() if k != "tag"}
    return f"{tag} {dumps(rest)}"


class MessagePrinter:
    """Writes messages to ``out`` in the readable or the JSON form; flushes each line."""

    def __init__(self, out: TextIO, *, json_output: bool = False) -> None:
        self._out = out
        self._json = json_output
        self._transaction: str | None = None

    def write(self, message: SubscriptionMessage) -> None:
        line = self._line(message)
        if line is not None:
            self._out.write(line + "\n")
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
