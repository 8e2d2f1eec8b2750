"""encode_rows in C (app/streamer/_rowrun.c) against its Python twin, and the
run's stopping rules that the main loop relies on."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app import speedups
from app.protocol.canonical_json import dumps, encode_fast
from app.protocol.messages import Begin, Commit, Data, parse_change_source_message
from app.streamer import rowrun
from app.streamer.rowrun import encode_rows_py
from app.streamer.subscriber import Change
from tests.c_helpers import built, needs

_rowrun = built("app.streamer._rowrun")
if _rowrun is not None and not speedups.ENABLED:  # rowrun set it up only if it uses it
    _rowrun.setup(Data, Change, encode_fast)
needs_c = needs(_rowrun, "app/streamer/_rowrun.c")
# Both when the C one is built (they must agree), else the Python one alone.
ENCODERS = [encode_rows_py] if _rowrun is None else [_rowrun.encode_rows, encode_rows_py]

W = "0a"


def row(i: int, **new: Any) -> Data:
    message = parse_change_source_message(
        [
            "data",
            {
                "tag": "insert",
                "relation": {
                    "schema": "public",
                    "name": "t",
                    "rowKey": {"columns": ["id"], "type": "default"},
                },
                "new": {"id": i, **new},
            },
        ]
    )
    assert isinstance(message, Data)
    return message


def begin() -> Begin:
    message = parse_change_source_message(["begin", {"tag": "begin"}, {"commitWatermark": W}])
    assert isinstance(message, Begin)
    return message


def commit() -> Commit:
    message = parse_change_source_message(["commit", {"tag": "commit"}, {"watermark": W}])
    assert isinstance(message, Commit)
    return message


def schema_change() -> Data:
    message = parse_change_source_message(
        ["data", {"tag": "drop-table", "id": {"schema": "public", "name": "t"}}]
    )
    assert isinstance(message, Data)
    return message


def both(messages: list[Any], start: int = 0, budget: int = 1 << 30) -> tuple[Any, ...]:
    """Runs the C (if built) and the Python function; asserts they agree; returns the
    result."""
    results = []
    for encode in ENCODERS:
        changes: list[Change] = []
        end, used = encode(messages, start, W, changes, budget)
        assert all(type(c) is Change for c in changes)
        results.append((end, used, changes))
    assert all(result == results[0] for result in results)
    return results[0]


def test_the_c_run_is_used_when_built_unless_speedups_are_off() -> None:
    # Without it each row costs ~1-2 us more.
    if speedups.ENABLED and _rowrun is not None:
        assert rowrun.encode_rows is _rowrun.encode_rows
    else:
        assert rowrun.encode_rows is encode_rows_py


def test_a_run_encodes_each_row_once_for_the_log_and_the_wire() -> None:
    messages: list[Begin | Data | Commit] = [begin(), row(1), row(2, name="é ✓"), row(3), commit()]
    end, used, changes = both(messages, start=1)
    assert end == 4
    assert changes == [Change(W, "insert", f'["data",{dumps(m.body)}]') for m in messages[1:4]]
    assert used == sum(len(c.json) for c in changes)


@pytest.mark.parametrize(
    ("stopper", "why"),
    [
        (commit(), "not a data message"),
        (row(9, price=1.0), "JS writes 1.0 as 1: the general path formats it"),
        (row(9, big=2**70), "beyond orjson: the general path writes it"),
    ],
)
def test_a_run_stops_before_what_it_does_not_handle(stopper: Any, why: str) -> None:
    end, _, changes = both([row(1), row(2), stopper, row(3)])
    assert end == 2, why
    assert len(changes) == 2


def test_a_schema_change_is_encoded_in_the_run() -> None:
    """The storer finds a schema change's bookkeeping by its tag (Storer.append):
    the run need not stop for it."""
    end, _, changes = both([row(1), schema_change(), row(3)])
    assert end == 3
    assert changes[1] == Change(W, "drop-table", f'["data",{dumps(schema_change().body)}]')


def test_a_run_that_cannot_start_encodes_nothing() -> None:
    assert both([begin(), row(1)]) == (0, 0, [])
    assert both([row(1)], start=1) == (1, 0, [])


def test_a_run_stops_after_the_row_that_fills_the_budget() -> None:
    messages = [row(i) for i in range(10)]
    one = len(f'["data",{dumps(messages[0].body)}]')
    end, used, changes = both(messages, budget=2 * one + 1)
    assert end == 3  # the third row crosses the budget: the caller's checkpoint
    assert used == 3 * one
    assert len(changes) == 3


@needs_c
def test_bad_arguments_are_type_errors() -> None:
    assert _rowrun is not None  # needs_c
    with pytest.raises(TypeError):
        _rowrun.encode_rows((row(1),), 0, W, [], 10)
    with pytest.raises(TypeError):
        _rowrun.encode_rows([row(1)], 0, W, [])
    with pytest.raises(ValueError, match="start"):
        _rowrun.encode_rows([row(1)], -1, W, [], 10)


values = st.one_of(
    st.integers(min_value=-(2**65), max_value=2**65),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.none(),
    st.booleans(),
)
messages = st.lists(
    st.one_of(
        st.builds(lambda i, v: row(i, v=v), st.integers(0, 99), values),
        st.sampled_from([begin(), commit(), schema_change()]),
    ),
    max_size=12,
)


@needs_c
@settings(max_examples=400, deadline=None)
@given(messages, st.integers(0, 12), st.integers(1, 2000))
def test_c_and_python_agree_on_any_run(batch: list[Any], start: int, budget: int) -> None:
    both(batch, start=min(start, len(batch)), budget=budget)
