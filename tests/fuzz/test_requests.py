"""Replication requests and watermarks (app/server/replication.py, app/protocol/lexi.py).

A subscriber's path and query string reach ``protocol_version`` and
``subscriber_context`` before anything is accepted; the watermarks in them (and in
every change-source message) reach ``parse_state_version``. Each gives a value or
its one error (``RequestError``, ``InvalidWatermarkError``); what parses is
canonical, so it formats back to the very text it came from, and the order of
LexiVersion strings is the order of their values.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from app.protocol.lexi import (
    MAX_LEXI_VALUE,
    InvalidWatermarkError,
    from_lexi,
    lsn_to_watermark,
    parse_state_version,
    to_lexi,
    watermark_to_lsn,
)
from app.server.replication import RequestError, protocol_version, subscriber_context
from app.versions import MAX_PROTOCOL_VERSION, MIN_PROTOCOL_VERSION
from tests.fuzz.conftest import fuzz_settings

lexi_values = st.integers(min_value=0, max_value=MAX_LEXI_VALUE)
# Near-LexiVersions: the base-36 alphabet and its look-alikes, of every length.
lexi_like = st.text(alphabet="0123456789abcdefghijklmnopqrstuvwxyzAZ.-_ \u0661\u00b2", max_size=40)
watermark_texts = (
    lexi_like
    | st.text(max_size=12)
    | lexi_values.map(to_lexi)
    | st.tuples(lexi_values, lexi_values).map(lambda t: f"{to_lexi(t[0])}.{to_lexi(t[1])}")
)

# Paths like the router sees: /replication/v<N>/<endpoint> and their near misses.
paths = st.one_of(
    st.text(max_size=40),
    st.builds(
        lambda prefix, digits, endpoint, suffix: (
            f"{prefix}/replication/v{digits}/{endpoint}{suffix}"
        ),
        st.sampled_from(["", "/x", "/replication"]),
        st.from_regex(r"[0-9]{0,12}", fullmatch=True) | st.text(max_size=3),
        st.sampled_from(["changes", "snapshot", "subscribe", "Changes", ""]),
        st.sampled_from(["", "/", "?x=1", "\n"]),
    ),
)


@fuzz_settings()
@given(paths)
@example("/replication/v" + "1" * 5000 + "/changes")
@example("/replication/v\u0666/changes")
@example("/replication/v007/changes")
def test_a_path_names_a_supported_version_or_is_a_request_error(path: str) -> None:
    try:
        version = protocol_version(path)
    except RequestError:
        return
    assert MIN_PROTOCOL_VERSION <= version <= MAX_PROTOCOL_VERSION


def test_a_version_of_thousands_of_digits_is_a_request_error() -> None:
    # Found by fuzzing: int() of the digits raised ValueError past 4300 of them.
    with pytest.raises(RequestError, match="invalid path"):
        protocol_version("/replication/v" + "1" * 5000 + "/changes")


query_names = st.sampled_from(
    ["id", "mode", "replicaVersion", "watermark", "initial", "taskID", "wsBatched", "x"]
)
queries = st.dictionaries(
    query_names, watermark_texts | st.sampled_from(["", "backup", "serving", "true"]), max_size=8
)


@fuzz_settings()
@given(paths, queries)
def test_a_changes_request_is_a_subscriber_context_or_a_request_error(
    path: str, query: dict[str, str]
) -> None:
    try:
        ctx = subscriber_context(path, query)
    except RequestError:
        return
    assert ctx.id == query["id"]
    parse_state_version(ctx.replica_version)
    parse_state_version(ctx.watermark)
    assert ctx.mode == ("backup" if query.get("mode") == "backup" else "serving")


# --- LexiVersions and state versions -------------------------------------------------


@fuzz_settings()
@given(watermark_texts)
def test_a_lexi_version_is_canonical_or_an_invalid_watermark(text: str) -> None:
    try:
        value = from_lexi(text)
    except InvalidWatermarkError:
        return
    assert 0 <= value <= MAX_LEXI_VALUE
    assert to_lexi(value) == text


@fuzz_settings()
@given(st.none() | st.integers() | st.binary(max_size=4) | st.lists(st.text(max_size=2)))
def test_a_lexi_version_that_is_not_a_string_is_an_invalid_watermark(value: Any) -> None:
    with pytest.raises(InvalidWatermarkError):
        from_lexi(value)
    with pytest.raises(InvalidWatermarkError):
        parse_state_version(value)


@fuzz_settings()
@given(lexi_values, lexi_values)
def test_lexi_versions_sort_as_their_values(a: int, b: int) -> None:
    assert from_lexi(to_lexi(a)) == a
    assert (to_lexi(a) < to_lexi(b)) == (a < b)


@fuzz_settings()
@given(watermark_texts)
def test_a_state_version_formats_back_to_its_text_or_is_an_invalid_watermark(text: str) -> None:
    try:
        version = parse_state_version(text)
    except InvalidWatermarkError:
        return
    assert version.format() == text


@fuzz_settings()
@given(watermark_texts, watermark_texts)
def test_state_versions_sort_as_their_strings(a: str, b: str) -> None:
    try:
        va, vb = parse_state_version(a), parse_state_version(b)
    except InvalidWatermarkError:
        return
    assert (va < vb) == (a < b)


lsn_texts = st.text(max_size=20) | st.from_regex(
    r"[0-9A-Fa-f]{0,9}/[0-9A-Fa-f]{0,9}", fullmatch=True
)


@fuzz_settings()
@given(lsn_texts)
def test_an_lsn_is_a_watermark_that_converts_back_or_an_invalid_watermark(lsn: str) -> None:
    try:
        watermark = lsn_to_watermark(lsn)
    except InvalidWatermarkError:
        return
    high, low = lsn.split("/")
    assert watermark_to_lsn(watermark) == f"{int(high, 16):X}/{int(low, 16):X}"


@fuzz_settings()
@given(watermark_texts)
def test_any_watermark_converts_to_an_lsn_or_is_an_invalid_watermark(text: str) -> None:
    try:
        lsn = watermark_to_lsn(text)
    except InvalidWatermarkError:
        return
    assert to_lexi(parse_state_version(text).major) == lsn_to_watermark(lsn)
