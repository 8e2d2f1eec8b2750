"""Base URI handling and the readable rendering of schema changes."""

from __future__ import annotations

import pytest

from app.client.render import describe_change
from app.client.urls import parse_base_url


@pytest.mark.parametrize(
    ("uri", "websocket", "http"),
    [
        ("ws://h:4849", "ws://h:4849/x", "http://h:4849/x"),
        ("http://h:4849/base/path?q=1", "ws://h:4849/x", "http://h:4849/x"),
        ("https://h/", "wss://h/x", "https://h/x"),
        ("WSS://h:1", "wss://h:1/x", "https://h:1/x"),
    ],
)
def test_the_path_and_query_of_the_base_are_discarded(uri: str, websocket: str, http: str) -> None:
    base = parse_base_url(uri)
    assert base.websocket("/x") == websocket
    assert base.http("/x") == http


def test_query_parameters_are_encoded() -> None:
    assert (
        parse_base_url("ws://h").websocket("/s", {"taskID": "a b&c"}) == "ws://h/s?taskID=a+b%26c"
    )


@pytest.mark.parametrize("uri", ["ftp://h", "h:4849", "ws://", ""])
def test_other_uris_are_rejected(uri: str) -> None:
    with pytest.raises(ValueError, match="change-streamer URI"):
        parse_base_url(uri)


def test_schema_changes_render_as_their_tag_and_compact_json() -> None:
    body = {"tag": "drop-table", "id": {"schema": "public", "name": "t"}}
    assert describe_change(body) == 'drop-table {"id":{"schema":"public","name":"t"}}'
