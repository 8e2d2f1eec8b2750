"""Frames from a custom change source (app/sources/custom.py, app/protocol/messages.py).

Every text frame a source sends goes through ``loads`` (``ValueError``: the stream
closes with "invalid JSON") and ``parse_change_source_message``
(``MessageValidationError``: "invalid change-source message"). Nothing else may
escape, since anything else would end the stream with a traceback instead of the
close code and reason the source is owed. What parses is kept as received
(relations normalized), so it serializes, and parses again to the same message.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from app.protocol.canonical_json import dumps, loads
from app.protocol.messages import (
    ChangeSourceMessage,
    MessageValidationError,
    parse_change_source_message,
    parse_data_plane,
)
from app.sources.custom import MAX_CLOSE_REASON_BYTES, close_reason
from tests.fuzz.conftest import fuzz_settings, mutated, mutated_json

REL = {"schema": "public", "name": "foo", "rowKey": {"columns": ["id"], "type": "default"}}
OLD_REL = {"schema": "public", "name": "foo", "keyColumns": ["id"], "replicaIdentity": "full"}
IDENT = {"schema": "public", "name": "foo"}
META = {"rowKey": {"id": {"attNum": 1}}}
COL = {"name": "bar", "spec": {"pos": 1, "dataType": "text", "notNull": None}}
WM = {"watermark": "0a"}

# One valid message of each kind and data tag: the seeds the mutations start from.
TEMPLATES: list[list[Any]] = [
    ["begin", {"tag": "begin", "json": "s", "skipAck": False}, {"commitWatermark": "0a"}],
    ["commit", {"tag": "commit", "commitTimeMs": 1.5}, WM],
    ["rollback", {"tag": "rollback"}],
    ["status", {"ack": True}, WM],
    [
        "status",
        {
            "lagReport": {
                "lastTimings": {"sendTimeMs": 1, "commitTimeMs": 2, "receiveTimeMs": 3},
                "nextSendTimeMs": 4,
            }
        },
        WM,
    ],
    ["control", {"tag": "reset-required", "message": "m", "errorDetails": {"a": 1}}],
    ["data", {"tag": "insert", "relation": REL, "new": {"id": 1, "v": None}}],
    ["data", {"tag": "update", "relation": OLD_REL, "key": None, "new": {"id": 2}}],
    ["data", {"tag": "delete", "relation": REL, "key": {"id": 1}}],
    ["data", {"tag": "truncate", "relations": [REL, OLD_REL]}],
    [
        "data",
        {
            "tag": "backfill",
            "relation": REL,
            "columns": ["v"],
            "watermark": "0a",
            "rowValues": [[1, "a"]],
            "status": {"rows": 1, "totalRows": 2, "totalBytes": 3},
        },
    ],
    [
        "data",
        {
            "tag": "create-table",
            "spec": {
                "schema": "public",
                "name": "foo",
                "primaryKey": ["id"],
                "columns": {"id": {"pos": 0, "dataType": "text", "pgTypeClass": "b"}},
            },
            "metadata": META,
            "backfill": {"id": {"attNum": 1}},
        },
    ],
    ["data", {"tag": "rename-table", "old": IDENT, "new": IDENT}],
    ["data", {"tag": "update-table-metadata", "table": IDENT, "old": META, "new": META}],
    ["data", {"tag": "add-column", "table": IDENT, "column": COL, "tableMetadata": META}],
    ["data", {"tag": "update-column", "table": IDENT, "old": COL, "new": COL}],
    ["data", {"tag": "drop-column", "table": IDENT, "column": "bar"}],
    ["data", {"tag": "drop-table", "id": IDENT}],
    [
        "data",
        {
            "tag": "create-index",
            "spec": {
                "schema": "public",
                "tableName": "foo",
                "name": "i",
                "unique": True,
                "columns": {"id": "ASC"},
            },
        },
    ],
    ["data", {"tag": "drop-index", "id": IDENT}],
    [
        "data",
        {"tag": "backfill-completed", "relation": REL, "columns": ["v"], "watermark": "0a"},
    ],
]

json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
    | st.sampled_from(["0a", "0a.00", "begin", "data", "insert", "ASC", "default", "b", "0A"])
)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


def mutated_messages() -> st.SearchStrategy[Any]:
    """A template with a few structural edits."""
    return st.sampled_from(TEMPLATES).flatmap(lambda m: mutated_json(m, json_values))


frames = st.one_of(
    st.text(max_size=60),
    json_values.map(dumps),
    mutated_messages().map(dumps),
    # Byte edits of a valid frame: broken JSON, broken UTF-8 decoded with replacement.
    st.sampled_from(TEMPLATES)
    .flatmap(lambda m: mutated(dumps(m).encode()))
    .map(lambda raw: raw.decode("utf-8", "replace")),
)


def received(frame: str) -> ChangeSourceMessage | None:
    """What CustomChangeStream does with a text frame: a message, or None where it
    closes the stream (an invalid frame); any other exception fails the test."""
    try:
        value = loads(frame)
    except ValueError:
        return None
    try:
        return parse_change_source_message(value)
    except MessageValidationError as e:
        error = str(e)
    # It goes into one close reason and one log line.
    assert len(error.splitlines()) == 1
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in error)
    return None


@fuzz_settings(2)
@given(frames)
@example('["data",{"tag":"insert","relation":{"schema":"s","name":"n"},"new":{}}]')
@example('["status",{},{"watermark":"' + "z" * 40 + '"}]')
@example('["begin",{"tag":"begin"},{"commitWatermark":"0a.0a.0a"}]')
@example("[" * 5000 + "]" * 5000)
# Found by the long profile (session 10): a key with a newline put one into the
# error's field path, so the close reason and the log line split.
@example(
    '["data",{"tag":"create-index","spec":{"schema":"public","tableName":"foo",'
    '"name":"i","unique":true,"columns":{"id":"ASC","\\n":null}}}]'
)
def test_a_frame_is_a_message_or_closes_the_stream_with_its_error(frame: str) -> None:
    message = received(frame)
    if message is None:
        return
    text = dumps(message.as_list())
    again = parse_change_source_message(loads(text))
    assert again == message
    assert dumps(again.as_list()) == text


@fuzz_settings()
@given(json_values | mutated_messages())
def test_a_decoded_value_is_a_message_or_a_message_validation_error(value: Any) -> None:
    before = copy.deepcopy(value)
    with contextlib.suppress(MessageValidationError):
        parse_change_source_message(value)
    assert value == before, "validation never changes its input"


@fuzz_settings()
@given(json_values | mutated_messages())
def test_the_data_plane_parse_accepts_a_subset_of_strings_as_watermarks(value: Any) -> None:
    try:
        strict = parse_data_plane(value)
    except MessageValidationError:
        strict = None
    try:
        lenient = parse_data_plane(value, strict_watermarks=False)
    except MessageValidationError:
        assert strict is None
        return
    if strict is not None:
        assert strict == lenient


@fuzz_settings()
@given(st.text(max_size=200))
def test_a_close_reason_fits_a_close_frame(text: str) -> None:
    reason = close_reason(text)
    assert len(reason.encode()) <= MAX_CLOSE_REASON_BYTES
    assert reason == text or (reason.endswith("...") and text.startswith(reason[:-3]))
