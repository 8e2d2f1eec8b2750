"""Base URI handling and the readable rendering of schema changes."""

from __future__ import annotations

import pytest

from app.client.change_text import describe_change
from app.client.urls import parse_base_url, without_userinfo


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


@pytest.mark.parametrize(
    "url",
    [
        "ws://zero:s3cr-t@h:4849/replication/v6/changes?id=a",
        "ws://:s3cr%40t@h:4849/replication/v6/changes",
        "ws://h:4849/replication/v6/changes",
    ],
)
def test_an_error_names_the_url_without_user_info_or_query(url: str) -> None:
    assert without_userinfo(url) == "ws://h:4849/replication/v6/changes"
    base = parse_base_url("ws://zero@h:4849").with_password("p@ss")
    assert without_userinfo(base.websocket("/x", {"taskID": "t"})) == "ws://h:4849/x"


@pytest.mark.parametrize("uri", ["ftp://h", "h:4849", "ws://", ""])
def test_other_uris_are_rejected(uri: str) -> None:
    with pytest.raises(ValueError, match="change-streamer URI"):
        parse_base_url(uri)


def test_schema_changes_render_as_their_tag_and_compact_json() -> None:
    body = {"tag": "drop-table", "id": {"schema": "public", "name": "t"}}
    assert describe_change(body) == 'drop-table {"id":{"schema":"public","name":"t"}}'
