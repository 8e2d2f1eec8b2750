"""A data message's body in words, for the readable printers (``render`` and
``terminal``): ``("update", "public.issues", '{"id":"a"} key {"id":"b"}')``."""

from __future__ import annotations

from typing import Any

from app.protocol.canonical_json import dumps

__all__ = ["change_parts", "describe_change"]


def _table(relation: Any) -> str:
    if isinstance(relation, dict):
        return f"{relation.get('schema')}.{relation.get('name')}"
    return dumps(relation)


def change_parts(body: dict[str, Any]) -> tuple[str, str, str]:
    """A data message's body as (tag, the tables it touches, the rest): ``("update",
    "public.issues", '{"id":"a"} key {"id":"b"}')``; no tables for schema changes."""
    tag = body.get("tag")
    if tag == "insert":
        return "insert", _table(body["relation"]), dumps(body["new"])
    if tag == "update":
        key = body.get("key")
        rest = dumps(body["new"]) if key is None else f"{dumps(body['new'])} key {dumps(key)}"
        return "update", _table(body["relation"]), rest
    if tag == "delete":
        return "delete", _table(body["relation"]), dumps(body["key"])
    if tag == "truncate":
        return "truncate", ", ".join(_table(r) for r in body["relations"]), ""
    if tag == "backfill":
        return "backfill", _table(body["relation"]), f"{len(body['rowValues'])} rows"
    return str(tag), "", dumps({k: v for k, v in body.items() if k != "tag"})


def describe_change(body: dict[str, Any]) -> str:
    """``<tag> <tables> <details>`` of a data message's body."""
    return " ".join(part for part in change_parts(body) if part)
