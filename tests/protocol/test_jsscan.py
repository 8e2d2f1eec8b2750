"""The C fast path of dumps (app/protocol/_jsscan.c) against its Python twins."""

from __future__ import annotations

import math

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app import speedups
from app.protocol import canonical_json
from app.protocol.canonical_json import _encode_fast_py, scan_py

_jsscan = pytest.importorskip(
    "app.protocol._jsscan", reason="not built (no C compiler when the package was installed)"
)
if not speedups.ENABLED:  # canonical_json set it up only if it uses it
    _jsscan.setup(orjson.dumps, canonical_json._ORJSON_OPTIONS, canonical_json._may_hold_non_finite)

INTEGRAL, EXPONENT, NULL = 1, 2, 4


def test_the_c_scan_is_used_unless_speedups_are_off() -> None:
    # Without it every dumps pays ~1.2 us more.
    if speedups.ENABLED:
        assert canonical_json._scan is _jsscan.scan
        assert canonical_json.encode_fast is _jsscan.encode
    else:
        assert canonical_json._scan is scan_py
        assert canonical_json.encode_fast is _encode_fast_py


@pytest.mark.parametrize(
    ("data", "flags"),
    [
        (b"[1.0]", INTEGRAL),
        (b'{"a":2.0,"b":1}', INTEGRAL),
        (b"[1.05]", 0),
        (b"1.0", 0),  # no token end after it
        (b"[1e+16]", EXPONENT),
        (b'{"x":1e-7}', EXPONENT),
        (b"[1e+]", 0),
        (b"[1e16]", 0),  # no sign: orjson's exponents have one
        (b"[1e+16", 0),
        (b'{"a":null}', NULL),
        (b"nul", 0),
        (b'["v1.0,"]', INTEGRAL),  # a look-alike in a string: the slow path, as in Python
        (b"[null,2.0,3e-9]", INTEGRAL | EXPONENT | NULL),
        (b"", 0),
    ],
)
def test_known_cases(data: bytes, flags: int) -> None:
    assert _jsscan.scan(data) == flags
    assert scan_py(data) == flags


def test_only_bytes_are_scanned() -> None:
    with pytest.raises(TypeError):
        _jsscan.scan("[1.0]")


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet='e.0123456789+-,]}nul "x[{', max_size=40))
def test_agrees_with_python_on_dense_look_alikes(text: str) -> None:
    data = text.encode()
    assert _jsscan.scan(data) == scan_py(data)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([1.0, 1e16, 1e21, 1e-6, 1e-7, 0.5, -0.0, 123456789012345.6])
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=6), children, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=1000, deadline=None)
@given(json_values)
def test_agrees_with_python_on_orjson_output(value: object) -> None:
    data = orjson.dumps(value)
    assert _jsscan.scan(data) == scan_py(data)


def test_non_finite_floats_still_raise() -> None:
    # orjson writes them as null; the null flag sends dumps to its check.
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="NaN and Infinity are rejected"):
            canonical_json.dumps({"a": [1, bad]})


@settings(max_examples=1000, deadline=None)
@given(json_values)
def test_encode_agrees_with_python(value: object) -> None:
    text = _jsscan.encode(value)
    assert text == _encode_fast_py(value)
    if text is not None:  # whatever the fast path answers is the canonical text
        assert text == canonical_json.dumps(value)


@pytest.mark.parametrize(
    "value",
    [
        {"a": 1.0},  # integral float: JS writes 1
        [1e16],  # exponent float: JS writes 1e+16
        {"a": [math.nan]},  # orjson writes null
        [2**64],  # beyond orjson
        {"a": "\ud800"},  # lone surrogate: orjson refuses it
        {1: "x"},  # a key that is not a string
        "top-level str",  # only containers take the fast path
        7,
    ],
)
def test_encode_leaves_what_it_cannot_vouch_for_to_python(value: object) -> None:
    assert _jsscan.encode(value) is None
    assert _encode_fast_py(value) is None


def test_encode_passes_nulls_that_hide_nothing() -> None:
    assert _jsscan.encode({"a": None, "b": [None, 1]}) == '{"a":null,"b":[null,1]}'


def test_encode_reports_a_failing_pre_check() -> None:
    def broken(_value: object) -> bool:
        raise RuntimeError("pre-check failed")

    _jsscan.setup(orjson.dumps, canonical_json._ORJSON_OPTIONS, broken)
    try:
        with pytest.raises(RuntimeError, match="pre-check failed"):
            _jsscan.encode({"a": None})
    finally:
        _jsscan.setup(
            orjson.dumps, canonical_json._ORJSON_OPTIONS, canonical_json._may_hold_non_finite
        )
