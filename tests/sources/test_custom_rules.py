"""The watermark rules of a custom change source's stream (spec/source.md §2.4)."""

from __future__ import annotations

from typing import Any

import pytest

from app.protocol.messages import parse_change_source_message
from app.sources.custom_rules import StreamRules


def begin(wm: str) -> list[Any]:
    return ["begin", {"tag": "begin"}, {"commitWatermark": wm}]


def commit(wm: str) -> list[Any]:
    return ["commit", {"tag": "commit"}, {"watermark": wm}]


def status(wm: str) -> list[Any]:
    return ["status", {"ack": True}, {"watermark": wm}]


ROLLBACK: list[Any] = ["rollback", {"tag": "rollback"}]
TABLE = {"schema": "public", "name": "t"}
CREATE = {
    "tag": "create-table",
    "spec": {**TABLE, "columns": {"id": {"pos": 1, "dataType": "int4"}}},
}
ADD = {
    "tag": "add-column",
    "table": TABLE,
    "column": {"name": "c", "spec": {"pos": 2, "dataType": "text"}},
}


def with_default(change: dict[str, Any], dflt: str | None) -> dict[str, Any]:
    """``change`` (CREATE or ADD) with ``dflt`` on its (last) column."""
    if change["tag"] == "create-table":
        spec = change["spec"]
        columns = {**spec["columns"], "c": {"pos": 2, "dataType": "text", "dflt": dflt}}
        return {**change, "spec": {**spec, "columns": columns}}
    column = change["column"]
    return {**change, "column": {**column, "spec": {**column["spec"], "dflt": dflt}}}


def problems(after: str | None, *messages: list[Any]) -> list[str | None]:
    rules = StreamRules(after)
    return [rules.check(parse_change_source_message(m)) for m in messages]


def test_a_well_behaved_stream_passes() -> None:
    stream = [
        status("05"),  # a status may precede everything, even at lastWatermark's level
        begin("06"),
        ["data", CREATE],
        ["data", ADD],
        ["data", with_default(CREATE, "'0'::integer")],
        ["data", with_default(ADD, None)],
        ["data", with_default(ADD, "'it''s'::text")],
        ["data", with_default(ADD, "-1.5")],
        ["data", with_default(ADD, "true")],
        ["data", with_default(ADD, "'{}'::text[]")],
        commit("06"),
        status("06"),  # non-decreasing: equal is fine
        begin("07"),
        ROLLBACK,
        begin("07"),  # a rolled-back watermark was never committed
        commit("07"),
        begin("07.01"),  # major.minor sorts after its major
        commit("07.01"),
        status("08"),
        begin("08"),
        commit("08"),
    ]
    assert problems("05", *stream) == [None] * len(stream)


def test_the_initial_sync_has_no_start_watermark() -> None:
    assert problems(None, begin("00"), commit("00")) == [None, None]


@pytest.mark.parametrize(
    ("after", "messages", "problem"),
    [
        (
            "0a",
            [begin("0a")],
            "a begin with commitWatermark 0a, not after lastWatermark 0a the stream was "
            "started with (it is stored already)",
        ),
        ("0a", [begin("09")], "a begin with commitWatermark 09, not after lastWatermark 0a"),
        (
            "01",
            [begin("0c"), commit("0c"), begin("0c")],
            "a begin with commitWatermark 0c, not after the previous commit 0c "
            "(commit watermarks must strictly increase)",
        ),
        (
            "01",
            [begin("0c"), commit("0c"), begin("0b")],
            "a begin with commitWatermark 0b, not after the previous commit 0c",
        ),
        (
            "01",
            [begin("0c"), commit("0d")],
            "a commit with watermark 0d, not its begin's commitWatermark 0c",
        ),
        (
            "01",
            [status("0e"), status("0d")],
            "a status with watermark 0d, behind the status watermark 0e sent before it "
            "(watermarks never go backwards)",
        ),
        (
            "01",
            [begin("0e"), commit("0e"), status("0d")],
            "a status with watermark 0d, behind the commit watermark 0e sent before it",
        ),
        (
            "01",
            [status("0e"), begin("0d")],
            "a begin with commitWatermark 0d, behind the status watermark 0e sent before it",
        ),
        (
            "01",
            [begin("02"), ["data", {**CREATE, "backfill": {"id": {"attNum": 1}}}]],
            "a create-table of public.t with a 'backfill' field (custom change sources cannot "
            "backfill: leave it out and send the rows)",
        ),
        (
            "01",
            [begin("02"), ["data", {**ADD, "backfill": {"attNum": 2}}]],
            "an add-column of public.t with a 'backfill' field",
        ),
        (
            "01",
            [begin("02"), ["data", with_default(ADD, "'x' CHECK (0) COLLATE 'binary'::text")]],
            "an add-column of public.t whose column c has the default "
            "'x' CHECK (0) COLLATE 'binary'::text, not a literal (a column default must be a "
            "number, true, false, a quoted string with a ::type cast such as 'x'::text, an "
            "empty array, or null)",
        ),
        (
            "01",
            [begin("02"), ["data", with_default(ADD, "1); DROP TABLE t; --")]],
            "an add-column of public.t whose column c has the default 1); DROP TABLE t; --, "
            "not a literal",
        ),
        (
            "01",
            [begin("02"), ["data", with_default(CREATE, "'x'::text;\nDROP TABLE t")]],
            "a create-table of public.t whose column c has the default "
            "\"'x'::text;\\nDROP TABLE t\", not a literal",
        ),
        (
            "01",
            [begin("02"), ["data", with_default(CREATE, "nextval('t_id_seq'::regclass)")]],
            "a create-table of public.t whose column c has the default "
            "nextval('t_id_seq'::regclass), not a literal",
        ),
    ],
)
def test_a_broken_rule_is_named(after: str, messages: list[list[Any]], problem: str) -> None:
    *before, last = problems(after, *messages)
    assert before == [None] * len(before)
    assert last is not None
    assert last.startswith(problem)


def test_framing_errors_are_left_to_the_service() -> None:
    # commit without begin: the service stops on it (a framing error, not a watermark one).
    assert problems("01", commit("05")) == [None]
