"""Change-log codec: extract the stored change, rebuild the exact message."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.protocol.canonical_json import dumps
from app.protocol.codec import change_tag, extract_change, reconstruct
from app.protocol.lexi import to_lexi

# Hostile content for a position-based cut: commas, brackets, quotes, NUL, unicode.
NASTY_TEXT = st.text(alphabet=st.sampled_from(list(',]}[{"\\:\x00é😀\u2028 ab1')), max_size=12)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**100), max_value=2**100)
    | st.floats(allow_nan=False, allow_infinity=False)
    | NASTY_TEXT
    | st.text(max_size=6),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(NASTY_TEXT, children, max_size=4)
    ),
    max_leaves=20,
)
EXTRA_FIELDS = st.dictionaries(NASTY_TEXT.filter(lambda k: k != "tag"), JSON_VALUES, max_size=4)
WATERMARKS = st.integers(min_value=0, max_value=2**64).map(to_lexi) | st.tuples(
    st.integers(min_value=0, max_value=2**64), st.integers(min_value=0, max_value=99)
).map(lambda p: f"{to_lexi(p[0])}.{to_lexi(p[1])}")
DATA_TAGS = st.sampled_from(["insert", "update", "delete", "truncate", "create-table", "x"])


def _message(kind: str, tag: str, extra: dict[str, Any], watermark: str) -> list[Any]:
    body = {"tag": tag, **extra}
    if kind == "begin":
        return ["begin", body, {"commitWatermark": watermark}]
    if kind == "commit":
        return ["commit", body, {"watermark": watermark}]
    return [kind, body]


@pytest.mark.parametrize(
    ("message", "change"),
    [
        (
            '["begin",{"tag":"begin","json":"s","skipAck":true},{"commitWatermark":"01"}]',
            '{"tag":"begin","json":"s","skipAck":true}',
        ),
        ('["commit",{"tag":"commit"},{"watermark":"06"}]', '{"tag":"commit"}'),
        ('["rollback",{"tag":"rollback"}]', '{"tag":"rollback"}'),
        (
            '["data",{"tag":"rename-table","old":{"schema":"public","name":"before"},'
            '"new":{"schema":"archive","name":"after"}}]',
            '{"tag":"rename-table","old":{"schema":"public","name":"before"},'
            '"new":{"schema":"archive","name":"after"}}',
        ),
    ],
)
def test_extract_and_reconstruct_the_spec_examples(message: str, change: str) -> None:
    assert extract_change(message) == change
    tag = change.split('"')[3]
    watermark = message.rsplit('"', 2)[1] if tag in ("begin", "commit") else "01"
    assert reconstruct(watermark, tag, change) == message


def test_reconstruct_builds_each_shape() -> None:
    assert reconstruct("0a", "begin", "{}") == '["begin",{},{"commitWatermark":"0a"}]'
    assert reconstruct("0a", "commit", "{}") == '["commit",{},{"watermark":"0a"}]'
    assert reconstruct("0a", "rollback", "{}") == '["rollback",{}]'
    assert reconstruct("0a", "insert", "{}") == '["data",{}]'
    assert reconstruct("0a", "backfill-completed", "{}") == '["data",{}]'


@settings(deadline=None)  # CI machines are slow and noisy; no timing here
@given(
    st.sampled_from(["begin", "commit", "rollback", "data"]),
    DATA_TAGS,
    EXTRA_FIELDS,
    WATERMARKS,
)
def test_reconstruct_of_extract_is_the_original_message(
    kind: str, data_tag: str, extra: dict[str, Any], watermark: str
) -> None:
    tag = data_tag if kind == "data" else kind
    message = _message(kind, tag, extra, watermark)
    text = dumps(message)
    change = extract_change(text)
    assert change == dumps(message[1])
    assert reconstruct(watermark, tag, change) == text


def test_round_trip_keeps_big_ints_nul_quotes_backslashes_and_empties() -> None:
    body = {
        "tag": "insert",
        "relation": {"schema": "public", "name": "t", "rowKey": {"columns": []}},
        "new": {
            "big": 2**80,
            "neg": -(2**70),
            "nul": "\x00",
            "q": '",]',
            "bs": "\\",
            "u": "é😀\u2028\ud800",
            "o": {},
            "a": [],
            "f": 1.5,
        },
    }
    text = dumps(["data", body])
    assert reconstruct("4d7lu8", "insert", extract_change(text)) == text


@pytest.mark.parametrize("text", ["", "{}", '"begin"', "[1,2]", '["data"'])
def test_extract_rejects_text_that_is_not_a_message_tuple(text: str) -> None:
    with pytest.raises(ValueError, match="not a canonical message tuple"):
        extract_change(text)


def test_change_tag_reads_the_tag_whatever_the_key_order() -> None:
    assert change_tag('{"tag":"insert","new":{}}') == "insert"
    assert change_tag('{"new":{"tag":"x"},"tag":"update"}') == "update"
    assert change_tag('{"tag":"create-table","spec":{}}') == "create-table"
    with pytest.raises(ValueError, match="no string 'tag'"):
        change_tag('{"new":{}}')
