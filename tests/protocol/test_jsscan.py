"""The C scan of orjson's output (app/protocol/_jsscan.c) against the Python one."""

from __future__ import annotations

import math

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.protocol import _jsscan, canonical_json
from app.protocol.canonical_json import scan_py

INTEGRAL, EXPONENT, NULL = 1, 2, 4


def test_the_c_scan_is_built_and_used() -> None:
    # scripts/bootstrap compiles it; without it every dumps pays ~1.2 us more.
    assert canonical_json._scan is _jsscan.scan


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
        _jsscan.scan("[1.0]")  # type: ignore[arg-type]


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
