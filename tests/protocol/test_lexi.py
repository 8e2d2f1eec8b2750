"""LexiVersion, LSN and state-version behaviour (spec/source.md §2)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.protocol.lexi import (
    MAX_LEXI_VALUE,
    InvalidWatermarkError,
    StateVersion,
    from_lexi,
    is_state_version,
    lsn_to_watermark,
    parse_state_version,
    to_lexi,
    watermark_fraction,
    watermark_to_lsn,
)

U64 = st.integers(min_value=0, max_value=2**64 - 1)
ANY_LEXI_VALUE = st.integers(min_value=0, max_value=MAX_LEXI_VALUE)
U32 = st.integers(min_value=0, max_value=2**32 - 1)


@pytest.mark.parametrize(
    ("lsn", "value", "lexi"),
    [
        ("0/0", 0, "00"),
        ("0/1529750", 22_189_904, "4d7lu8"),
        ("16/B374D848", 97_500_059_720, "718sh0nk8"),
        ("FFFFFFFF/FFFFFFFF", 2**64 - 1, "c3w5e11264sgsf"),
    ],
)
def test_worked_examples_from_the_spec_hold_exactly(lsn: str, value: int, lexi: str) -> None:
    assert to_lexi(value) == lexi
    assert from_lexi(lexi) == value
    assert lsn_to_watermark(lsn) == lexi
    assert watermark_to_lsn(lexi) == lsn


@pytest.mark.parametrize(
    ("value", "lexi"), [(0, "00"), (10, "0a"), (35, "0z"), (36, "110"), (46655, "2zzz")]
)
def test_small_values_encode_as_in_the_spec(value: int, lexi: str) -> None:
    assert to_lexi(value) == lexi
    assert from_lexi(lexi) == value


def test_spec_ordering_example_holds() -> None:
    a, b, c = (lsn_to_watermark(x) for x in ("0/FFFFFF", "0/1000000", "1/0"))
    assert (a, b, c) == ("49zldr", "49zlds", "61z141z4")
    assert a < b < c


def test_zero_padded_and_lower_case_lsns_name_the_same_position() -> None:
    assert lsn_to_watermark("00000000/01529750") == "4d7lu8"
    assert lsn_to_watermark("16/b374d848") == lsn_to_watermark("16/B374D848")


def test_largest_value_uses_36_digits_and_one_more_is_rejected() -> None:
    assert to_lexi(MAX_LEXI_VALUE) == "z" + "z" * 36
    assert from_lexi("z" + "z" * 36) == MAX_LEXI_VALUE
    with pytest.raises(InvalidWatermarkError, match="more than 36 base-36 digits"):
        to_lexi(MAX_LEXI_VALUE + 1)


@given(U64, U64)
def test_lexi_preserves_order_for_all_64_bit_values(a: int, b: int) -> None:
    assert (to_lexi(a) < to_lexi(b)) == (a < b)
    assert (to_lexi(a) == to_lexi(b)) == (a == b)


@given(ANY_LEXI_VALUE, ANY_LEXI_VALUE)
def test_lexi_preserves_order_beyond_64_bits(a: int, b: int) -> None:
    assert (to_lexi(a) < to_lexi(b)) == (a < b)


@given(ANY_LEXI_VALUE)
def test_lexi_round_trips_exactly(n: int) -> None:
    encoded = to_lexi(n)
    assert from_lexi(encoded) == n
    assert len(encoded) >= 2
    assert encoded == encoded.lower()


@given(U32, U32)
def test_lsn_round_trips_through_its_watermark(high: int, low: int) -> None:
    lsn = f"{high:X}/{low:X}"
    watermark = lsn_to_watermark(lsn)
    assert from_lexi(watermark) == (high << 32) + low
    assert watermark_to_lsn(watermark) == lsn


@given(U64, st.integers(min_value=0, max_value=1000), U64)
def test_state_version_order_equals_string_order(major: int, minor: int, other: int) -> None:
    versions = [
        StateVersion(major),
        StateVersion(major, minor),
        StateVersion(major, minor + 1),
        StateVersion(other),
    ]
    for x in versions:
        for y in versions:
            assert (x < y) == (x.format() < y.format())
            assert (x <= y) == (x.format() <= y.format())
            assert parse_state_version(x.format()) == x


def test_state_version_minor_sorts_between_commits() -> None:
    base = parse_state_version("4d7lu8")
    backfill = parse_state_version("4d7lu8.01")
    nxt = parse_state_version(to_lexi(from_lexi("4d7lu8") + 1))
    assert backfill == StateVersion(22_189_904, 1)
    assert str(backfill) == "4d7lu8.01"
    assert base < backfill < nxt
    assert "4d7lu8" < "4d7lu8.01" < nxt.format()


def test_watermark_to_lsn_uses_only_the_major_part() -> None:
    assert watermark_to_lsn("4d7lu8.01") == "0/1529750"


def test_watermark_beyond_64_bits_has_no_lsn() -> None:
    with pytest.raises(InvalidWatermarkError, match="exceeds the 64-bit LSN range"):
        watermark_to_lsn(to_lexi(2**64))


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "shorter than 2 characters"),
        ("0", "shorter than 2 characters"),
        ("1a", "prefix '1' announces 2 digit(s) but the body has 1"),
        ("00a", "prefix '0' announces 1 digit(s) but the body has 2"),
        ("100", "leading zero"),
        ("0A", "only lower-case base-36 digits"),
        ("4D7LU8", "only lower-case base-36 digits"),
        ("0-", "only lower-case base-36 digits"),
        (" 00", "only lower-case base-36 digits"),
        ("00\n", "only lower-case base-36 digits"),
        ("0é", "only lower-case base-36 digits"),
    ],
)
def test_malformed_lexi_is_rejected_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(InvalidWatermarkError) as info:
        from_lexi(text)
    assert repr(text) in str(info.value)
    assert reason in str(info.value)


def test_non_string_lexi_is_rejected() -> None:
    with pytest.raises(InvalidWatermarkError, match="expected a string, got int"):
        from_lexi(12)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("4d7lu8.", "minor part: invalid LexiVersion ''"),
        (".01", "major part: invalid LexiVersion ''"),
        ("4d7lu8.01.01", "more than one '.'"),
        ("4d7lu8.1", "minor part"),
        ("4d7lu.01", "major part"),
    ],
)
def test_malformed_state_version_names_the_bad_part(text: str, reason: str) -> None:
    with pytest.raises(InvalidWatermarkError) as info:
        parse_state_version(text)
    assert repr(text) in str(info.value)
    assert reason in str(info.value)


@pytest.mark.parametrize(
    "lsn",
    ["", "0", "0/", "/0", "1/2/3", "G/0", "0/123456789", "-1/0", "+1/0", "0x1/0", " 0/0", "1_0/0"],
)
def test_malformed_lsn_is_rejected(lsn: str) -> None:
    with pytest.raises(InvalidWatermarkError) as info:
        lsn_to_watermark(lsn)
    assert repr(lsn) in str(info.value)
    assert "1 to 8 hex digits" in str(info.value)


def test_negative_values_cannot_be_encoded() -> None:
    with pytest.raises(InvalidWatermarkError, match=r"-1 .*negative"):
        to_lexi(-1)


@pytest.mark.parametrize("value", [True, 1.0, "1", None])
def test_only_ints_can_be_encoded(value: object) -> None:
    with pytest.raises(TypeError, match="must be an int"):
        to_lexi(value)  # type: ignore[arg-type]


def test_state_version_refuses_unencodable_parts() -> None:
    with pytest.raises(InvalidWatermarkError, match="negative"):
        StateVersion(1, -1)


def test_catch_up_progress_is_the_position_between_start_and_target() -> None:
    assert watermark_fraction("01", "0b", "01") == 0.0
    assert watermark_fraction("01", "0b", "06") == 0.5
    assert watermark_fraction("01", "0b", "0c") == 1.0  # live changes drained after it
    assert watermark_fraction("01", "01", "01") == 1.0  # nothing to read
    assert watermark_fraction("01", None, "01") is None  # the read has not started
    assert watermark_fraction("01", "0b", "zz") is None  # not a watermark


def _parses(text: object) -> bool:
    try:
        parse_state_version(text)  # type: ignore[arg-type]
    except InvalidWatermarkError:
        return False
    return True


# Text near the canonical form: lexi digits, upper case, dots, other characters.
NEAR_LEXI = st.text(alphabet="0123456789abcdefghijklmnopqrstuvwxyzAZ.é\n ", max_size=40)


@given(st.one_of(NEAR_LEXI, ANY_LEXI_VALUE.map(to_lexi)))
def test_is_state_version_agrees_with_the_parser_on_any_text(text: str) -> None:
    assert is_state_version(text) == _parses(text)


@given(ANY_LEXI_VALUE, st.one_of(st.none(), ANY_LEXI_VALUE))
def test_is_state_version_accepts_every_encoded_state_version(
    major: int, minor: int | None
) -> None:
    text = to_lexi(major) if minor is None else f"{to_lexi(major)}.{to_lexi(minor)}"
    assert is_state_version(text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0",
        "1a",
        "00a",
        "100",
        "0A",
        "00\n",
        "0é",
        "4d7lu8.",
        ".01",
        "4d7lu8.01.01",
        "4d7lu8.1",
        "4d7lu.01",
        "z" + "1" * 35,
        "z" + "1" * 37,
    ],
)
def test_is_state_version_refuses_what_the_parser_refuses(text: str) -> None:
    assert not _parses(text)
    assert not is_state_version(text)


@pytest.mark.parametrize("value", [None, 12, b"00", ["00"]])
def test_is_state_version_refuses_non_strings(value: object) -> None:
    assert not is_state_version(value)
