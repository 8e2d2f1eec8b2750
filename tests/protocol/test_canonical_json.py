"""Canonical JSON: JS-compatible output, exact big ints, strict number handling."""

from __future__ import annotations

import datetime
import math
from collections import OrderedDict
from enum import IntEnum
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.protocol import canonical_json
from app.protocol.canonical_json import dumps, loads
from app.protocol.js_number import format_js_number

# Any JSON value zero can carry: big ints, finite floats, any str (lone surrogates too).
JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    | st.text(alphabet=st.characters(codec=None, min_codepoint=0xD700, max_codepoint=0xE000))
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)


@pytest.mark.parametrize(
    "text",
    [
        '["begin",{"tag":"begin","json":"s","skipAck":true},{"commitWatermark":"01"}]',
        '["data",{"tag":"rename-table","old":{"schema":"public","name":"before"},'
        '"new":{"schema":"archive","name":"after"}}]',
        '["commit",{"tag":"commit"},{"watermark":"06"}]',
        '["rollback",{"tag":"rollback"}]',
        '["status",{"tag":"status","lagReport":{"lastTimings":{"sendTimeMs":150,'
        '"commitTimeMs":151,"receiveTimeMs":152},"nextSendTimeMs":234}}]',
        '["error",{"type":2,"message":"earliest supported watermark is 04 (requested 02)"}]',
    ],
)
def test_spec_examples_round_trip_byte_for_byte(text: str) -> None:
    assert dumps(loads(text)) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1.0, "1"),
        (1e21, "1e+21"),
        (1e-7, "1e-7"),
        (123456789012345680000.0, "123456789012345680000"),
        (0.000001, "0.000001"),
        (-0.0, "0"),
        (0.1 + 0.2, "0.30000000000000004"),
        (1e16, "10000000000000000"),
        (123e-20, "1.23e-18"),
        (5e-324, "5e-324"),
        (1.7976931348623157e308, "1.7976931348623157e+308"),
        (-1.5e-7, "-1.5e-7"),
        (1704164645123.456, "1704164645123.456"),
        (2.0**53, "9007199254740992"),
    ],
)
def test_floats_print_like_javascript(value: float, text: str) -> None:
    assert format_js_number(value) == text
    assert dumps(value) == text
    assert dumps([value]) == f"[{text}]"
    assert dumps({"v": value, "w": [value]}) == f'{{"v":{text},"w":[{text}]}}'


def test_parsed_integral_float_prints_like_an_int() -> None:
    assert dumps(loads("1.0")) == "1"
    assert dumps(loads('{"a":[1.0,-0.0,2.50,1E2]}')) == '{"a":[1,0,2.5,100]}'


@pytest.mark.parametrize(
    "text",
    [
        "9007199254740993",
        "-9007199254740993",
        "18446744073709551615",
        "18446744073709551616",
        "-9223372036854775809",
        "123456789012345678901234567890",
        "-" + "9" * 300,
    ],
)
def test_integers_of_any_size_parse_exactly_and_print_bare(text: str) -> None:
    value = loads(text)
    assert type(value) is int
    assert value == int(text)
    assert dumps(value) == text
    assert dumps([value, {"n": value}]) == f'[{text},{{"n":{text}}}]'
    assert loads(text.encode()) == int(text)


def test_big_integer_inside_a_message_keeps_every_digit() -> None:
    text = '["data",{"tag":"insert","new":{"id":123456789012345678901234567890,"s":"x"}}]'
    assert loads(text)[1]["new"]["id"] == 123456789012345678901234567890
    assert dumps(loads(text)) == text


def test_long_digit_runs_in_strings_do_not_change_the_result() -> None:
    text = '{"s":"12345678901234567890123","f":0.12345678901234567890123}'
    assert dumps(loads(text)) == '{"s":"12345678901234567890123","f":0.12345678901234568}'


@pytest.mark.parametrize(
    "value",
    [
        math.nan,
        math.inf,
        -math.inf,
        [1, math.nan],
        [None, math.inf],
        {"a": None, "b": {"c": [-math.inf]}},
        (None, math.nan),
        [None, [1.5, 2.0, math.nan]],
        {"k": OrderedDict(x=None, y=math.nan)},
    ],
)
def test_nan_and_infinity_are_rejected_wherever_they_are(value: Any) -> None:
    with pytest.raises(ValueError, match="NaN and Infinity are rejected"):
        dumps(value)


@pytest.mark.parametrize("text", ["1e400", "-1e400", "[1,2e999]", '{"a":1.5e309}'])
def test_numbers_beyond_the_double_range_are_rejected_on_parse(text: str) -> None:
    with pytest.raises(ValueError, match="outside the range of a double"):
        loads(text)


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", '{"a":-Infinity}'])
def test_nan_and_infinity_literals_are_not_json(text: str) -> None:
    with pytest.raises(ValueError, match="is not valid JSON"):
        loads(text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[1,]",
        "{'a':1}",
        "[01]",
        "[.5]",
        '"\x01"',
        "\ufeff[]",
        "[] []",
        '{"a"}',
        '"\\x41"',
        b"\xff\xfe",
        b'"\xed\xa0\x80"',
    ],
)
def test_invalid_json_raises_value_error(text: str | bytes) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the message comes from the parser
        loads(text)


def test_loads_accepts_only_text_or_bytes() -> None:
    with pytest.raises(TypeError, match="must be str or bytes"):
        loads(12)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("\x00", '"\\u0000"'),
        ("\x01\x1f", '"\\u0001\\u001f"'),
        ("\b\f\n\r\t", '"\\b\\f\\n\\r\\t"'),
        ("\x0b", '"\\u000b"'),
        ('"\\', '"\\"\\\\"'),
        ("/", '"/"'),
        ("\x7f", '"\x7f"'),
        ("\u2028\u2029", '"\u2028\u2029"'),
        ("é中😀", '"é中😀"'),
        ("\ud800", '"\\ud800"'),
        ("\udfff", '"\\udfff"'),
        ("a\udc00b\ud83d", '"a\\udc00b\\ud83d"'),
        ("\ud83d\ude00", '"😀"'),
    ],
)
def test_strings_are_escaped_like_javascript(value: str, text: str) -> None:
    assert dumps(value) == text
    assert dumps([value]) == f"[{text}]"
    assert dumps({value: value}) == f"{{{text}:{text}}}"


def test_lone_surrogate_escapes_parse_and_print_back_unchanged() -> None:
    text = '["\\ud800","x\\udfffy","\\ud83d\\ude00"]'
    assert loads(text) == ["\ud800", "x\udfffy", "😀"]
    assert dumps(loads(text)) == '["\\ud800","x\\udfffy","😀"]'


def test_a_python_str_holding_raw_surrogates_can_be_parsed() -> None:
    assert loads('"\ud800"') == "\ud800"


def test_object_keys_keep_insertion_order_and_duplicates_keep_the_last_value() -> None:
    assert dumps({"b": 1, "a": 2, "c": {"z": 1, "y": 2}}) == '{"b":1,"a":2,"c":{"z":1,"y":2}}'
    assert dumps(loads('{"a":1,"b":2,"a":3}')) == '{"a":3,"b":2}'


def test_tuples_and_subclasses_serialize_as_their_json_type() -> None:
    class Code(IntEnum):
        TWO = 2

    value = (Code.TWO, OrderedDict(a=(1, "x")), True, False, None)
    assert dumps(value) == '[2,{"a":[1,"x"]},true,false,null]'
    assert dumps([Code.TWO, 1.0, 2**70]) == "[2,1,1180591620717411303424]"


@pytest.mark.parametrize(
    "value",
    [
        {1: "x"},
        [datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)],
        [{1, 2}],
        [object()],
        [b"bytes"],
        [2**70, object()],
    ],
)
def test_non_json_values_raise_type_error(value: Any) -> None:
    with pytest.raises(TypeError):
        dumps(value)


def test_deep_nesting_beyond_orjson_limits_still_works() -> None:
    value: Any = []
    for _ in range(600):
        value = [value]
    text = "[" * 601 + "]" * 601
    assert dumps(value) == text
    assert loads(text) == value


def test_absurd_nesting_is_a_value_error_on_parse_and_fine_on_serialize() -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        loads("[" * 100_000 + "]" * 100_000)
    value: Any = []
    for _ in range(100_000):
        value = [value]
    assert dumps(value) == "[" * 100_001 + "]" * 100_001


@pytest.mark.parametrize(
    "s",
    ["1e-6", "1e+16", "1.0", ":1.0,", ',"1":2', "x:-0.0]", '"1.0,"', "null", "\\u0000", "g"],
)
def test_number_look_alikes_inside_strings_are_left_alone(s: str) -> None:
    assert (
        dumps({"k": s, "n": None, "f": 0.5})
        == f'{{"k":{orjson.dumps(s).decode()},"n":null,"f":0.5}}'
    )


@settings(deadline=None)  # CI machines are slow and noisy; no timing here
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_every_float_inside_a_container_prints_like_javascript(x: float) -> None:
    # Guards the fast path: orjson's own float text is kept only where it equals JS's.
    expected = format_js_number(x)
    assert dumps([x]) == f"[{expected}]"
    assert dumps({"a": "3f1e-6a7d", "x": x, "n": None}) == (
        f'{{"a":"3f1e-6a7d","x":{expected},"n":null}}'
    )


@settings(deadline=None)  # CI machines are slow and noisy; no timing here
@given(JSON_VALUES)
def test_fast_path_and_pure_python_encoder_agree(value: Any) -> None:
    assert dumps(value) == canonical_json._dumps_slow(value)


def _as_js_sees_it(value: Any) -> Any:
    """What JS holds for a Python value: adjacent surrogate halves form one character."""
    if isinstance(value, str):
        return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    if isinstance(value, dict):
        return {_as_js_sees_it(k): _as_js_sees_it(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_js_sees_it(v) for v in value]
    return value


def _has_unsafe_integral_float(value: Any) -> bool:
    if isinstance(value, float):
        return value.is_integer() and abs(value) >= 2**53
    if isinstance(value, dict):
        return any(_has_unsafe_integral_float(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_unsafe_integral_float(v) for v in value)
    return False


@settings(deadline=None)  # CI machines are slow and noisy; no timing here
@given(JSON_VALUES)
def test_dumps_output_is_a_fixed_point_of_loads_then_dumps(value: Any) -> None:
    text = dumps(value)
    assert dumps(loads(text)) == text
    assert dumps(loads(text.encode("utf-8"))) == text
    if not _has_unsafe_integral_float(value):
        assert loads(text) == _as_js_sees_it(value)


def test_integral_float_beyond_2_53_comes_back_as_an_int_like_a_js_bigint() -> None:
    # JS prints 4.833658649592862e16 as "48336586495928620"; parsing that integer
    # lexeme (outside the safe range) yields a BigInt, not the original double.
    text = dumps(4.833658649592862e16)
    assert text == "48336586495928620"
    assert loads(text) == 48336586495928620
    assert type(loads(text)) is int
