"""Postgres text values → zero's JSON values: every rule, the deliberate differences, errors."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.protocol import canonical_json
from app.sources.postgres.pgarray import ArrayLiteralError, parse_array
from app.sources.postgres.values import (
    PgValueError,
    TypeInfo,
    TypeRegistry,
    parse_date,
    parse_time,
    parse_timestamp,
)

REGISTRY = TypeRegistry()


def parse(oid: int, text: str, *, json_as_string: bool = True) -> Any:
    value = REGISTRY.parser(oid, json_as_string=json_as_string)(text)
    canonical_json.dumps([value])  # every output must be writable JSON
    return value


# --- scalars --------------------------------------------------------------------------


def test_bool() -> None:
    assert parse(16, "t") is True
    assert parse(16, "f") is False
    with pytest.raises(PgValueError, match="invalid bool value 'true'"):
        parse(16, "true")


@pytest.mark.parametrize(
    ("oid", "text", "value"),
    [
        (21, "-32768", -32768),
        (23, "2147483647", 2147483647),
        (26, "4294967295", 4294967295),
        (20, "9223372036854775807", 9223372036854775807),
        (20, "-9223372036854775808", -9223372036854775808),
    ],
)
def test_integers_are_exact_ints(oid: int, text: str, value: int) -> None:
    result = parse(oid, text)
    assert type(result) is int
    assert result == value


def test_int8_is_written_as_a_bare_integer() -> None:
    assert canonical_json.dumps([parse(20, "9223372036854775807")]) == "[9223372036854775807]"


@pytest.mark.parametrize(("oid", "name"), [(20, "int8"), (21, "int2"), (23, "int4"), (26, "oid")])
def test_malformed_integer_names_type_and_text(oid: int, name: str) -> None:
    with pytest.raises(PgValueError, match=f"invalid {name} value '1.5': not an integer"):
        parse(oid, "1.5")


@pytest.mark.parametrize("oid", [700, 701])
def test_floats(oid: int) -> None:
    assert parse(oid, "1.5") == 1.5
    assert parse(oid, "-1.25e-05") == -1.25e-05
    assert parse(oid, "1e+308") == 1e308
    # Integral values come back as int: the same JSON text as JS prints for 1.0.
    one = parse(oid, "1")
    assert (type(one), one) == (int, 1)
    assert canonical_json.dumps([parse(oid, "-0")]) == "[0]"
    assert canonical_json.dumps([parse(oid, "1e+16")]) == "[10000000000000000]"
    assert canonical_json.dumps([parse(oid, "1e+21")]) == "[1e+21]"


@pytest.mark.parametrize("oid", [700, 701, 1700])
def test_non_finite_numbers_are_strings_not_null(oid: int) -> None:
    assert parse(oid, "NaN") == "NaN"
    assert parse(oid, "Infinity") == "Infinity"
    assert parse(oid, "-Infinity") == "-Infinity"


@pytest.mark.parametrize("oid", [700, 701, 1700])
def test_malformed_number(oid: int) -> None:
    with pytest.raises(PgValueError, match="'abc': not a number"):
        parse(oid, "abc")


def test_numeric_goes_through_a_double_like_number_of_text() -> None:
    assert parse(1700, "123.4500") == 123.45
    assert parse(1700, "-0.001") == -0.001
    assert type(parse(1700, "42")) is int
    assert type(parse(1700, "42.000")) is int
    big = parse(1700, "12345678901234567890")
    assert canonical_json.dumps([big]) == "[12345678901234567000]"  # JS: Number(text)
    assert canonical_json.dumps([parse(1700, "0.1000000000000000055511151231257827")]) == "[0.1]"


def test_numeric_beyond_double_range_keeps_its_digits() -> None:
    huge = "1" + "0" * 400
    assert parse(1700, huge) == huge
    assert parse(1700, "-" + huge) == "-" + huge


def test_json_as_string_or_parsed() -> None:
    text = '{"a": [1, 2.5, null, true], "big": 12345678901234567890123}'
    for oid in (114, 3802):
        assert parse(oid, text, json_as_string=True) == text
        assert parse(oid, text, json_as_string=False) == {
            "a": [1, 2.5, None, True],
            "big": 12345678901234567890123,
        }
    assert parse(114, "null", json_as_string=False) is None
    with pytest.raises(PgValueError, match=re.escape("invalid jsonb value '{nope': not JSON")):
        parse(3802, "{nope", json_as_string=False)


def test_everything_else_is_the_text() -> None:
    for oid, text in [
        (25, "hello"),
        (1043, ""),
        (2950, "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
        (17, "\\x00ff"),
        (1186, "1 day 02:03:04"),
        (600, "(1,2)"),
        (22, "1 2 3"),  # int2vector: has an element type, but is not an array
        (987654, "an unknown type"),
    ]:
        assert parse(oid, text) == text


# --- timestamps -----------------------------------------------------------------------


@pytest.mark.parametrize("oid", [1114, 1184])
def test_timestamp_is_float_ms_keeping_microseconds(oid: int) -> None:
    suffix = "+00" if oid == 1184 else ""
    assert parse(oid, "2024-01-02 03:04:05.123456" + suffix) == 1704164645123.456
    assert parse(oid, "2024-01-02 03:04:05.1" + suffix) == 1704164645100
    assert parse(oid, "1970-01-01 00:00:00" + suffix) == 0


@pytest.mark.parametrize(
    ("offset", "shift_s"),
    [
        ("+00", 0),
        ("+05", 5 * 3600),
        ("-03", -3 * 3600),
        ("+05:30", 5 * 3600 + 30 * 60),
        ("-09:30", -(9 * 3600 + 30 * 60)),
        ("+05:53:28", 5 * 3600 + 53 * 60 + 28),  # a local mean time offset
        ("-00:01:15", -75),
    ],
)
def test_timestamptz_offsets(offset: str, shift_s: int) -> None:
    utc_ms = 1704164645123.456
    assert parse(1184, "2024-01-02 03:04:05.123456" + offset) == pytest.approx(
        utc_ms - shift_s * 1000, abs=1e-9
    )


def test_pre_1970_fractions_are_exact() -> None:
    assert parse(1184, "1969-12-31 23:59:59.5+00") == -500
    assert parse(1184, "1969-12-31 23:59:59.999999+00") == -0.001
    assert (
        parse(1114, "1960-06-15 12:00:00.000001") == -301233599999.999
    )  # JS: Date.UTC(1960, 5, 15, 12) - 0.001


def test_bc_and_far_future_timestamps() -> None:
    # JS: d = new Date(0); d.setUTCFullYear(-43, 2, 15); d.setUTCHours(12) → -63517780800000
    assert parse(1184, "0044-03-15 12:00:00+00 BC") == -63517780800000
    assert parse(1114, "0001-01-01 00:00:00 BC") == -62167219200000
    assert parse(1114, "0001-12-31 23:59:59.5 BC") == -62135596800000 - 500
    assert parse(1114, "4713-11-24 00:00:00 BC") == -210835180800000
    assert parse(1114, "10000-01-01 00:00:00") == 253402300800000
    # Beyond 2^53 ms: a float (zero would read an int this big as a BigInt).
    far = parse(1114, "294276-12-31 23:59:59.999999")
    assert type(far) is float


def test_infinite_timestamps_and_dates_keep_postgres_spelling() -> None:
    for oid in (1114, 1184, 1082):
        assert parse(oid, "infinity") == "infinity"
        assert parse(oid, "-infinity") == "-infinity"


@pytest.mark.parametrize(
    "text",
    [
        "Tue Jan 02 03:04:05.123456 2024 UTC",  # DateStyle Postgres
        "01/02/2024 03:04:05",  # DateStyle SQL
        "2024-13-02 03:04:05",
        "2024-01-02 25:04:05",
        "0000-01-01 00:00:00 BC",
        "Infinity",
        "",
    ],
)
def test_malformed_timestamp(text: str) -> None:
    with pytest.raises(PgValueError, match=re.escape(f"invalid timestamptz value {text!r}")):
        parse_timestamp(text)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _pg_offset(seconds: int) -> str:
    sign = "+" if seconds >= 0 else "-"
    h, rest = divmod(abs(seconds), 3600)
    m, s = divmod(rest, 60)
    out = f"{sign}{h:02d}"
    if m or s:
        out += f":{m:02d}"
    if s:
        out += f":{s:02d}"
    return out


@settings(max_examples=300, deadline=None)
@given(
    instant=st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),
    offset_s=st.integers(min_value=-15 * 3600 - 59 * 60, max_value=15 * 3600 + 59 * 60),
)
def test_timestamptz_matches_exact_micros(instant: datetime, offset_s: int) -> None:
    utc = instant.replace(tzinfo=UTC)
    local = utc + timedelta(seconds=offset_s)
    # Postgres prints the fraction without trailing zeros and omits it when zero.
    frac = f".{local.microsecond:06d}".rstrip("0") if local.microsecond else ""
    text = local.strftime("%Y-%m-%d %H:%M:%S").rjust(19, "0") + frac + _pg_offset(offset_s)
    if local.year < 1000:
        text = f"{local.year:04d}" + text[text.index("-") :]
    exact_us = (utc - _EPOCH) // timedelta(microseconds=1)
    assert parse_timestamp(text) == exact_us / 1000


@settings(max_examples=200, deadline=None)
@given(
    day=st.dates(),
    cycles=st.integers(min_value=1, max_value=30),
    micros=st.integers(min_value=0, max_value=86_400_000_000 - 1),
)
def test_bc_timestamps_follow_the_400_year_gregorian_cycle(
    day: Any, cycles: int, micros: int
) -> None:
    # Shifting a date back by whole 400-year cycles shifts it by exactly 146097 days.
    year = day.year - 400 * cycles  # astronomical; <= 0 is BC
    if year > 0:
        return
    hh, rest = divmod(micros, 3_600_000_000)
    mi, rest = divmod(rest, 60_000_000)
    ss, us = divmod(rest, 1_000_000)
    text = f"{1 - year:04d}-{day.month:02d}-{day.day:02d} {hh:02d}:{mi:02d}:{ss:02d}.{us:06d} BC"
    ad = datetime(day.year, day.month, day.day, tzinfo=UTC) + timedelta(microseconds=micros)
    exact_us = (ad - _EPOCH) // timedelta(microseconds=1) - cycles * 146097 * 86_400_000_000
    assert parse_timestamp(text) == exact_us / 1000


# --- dates and times ------------------------------------------------------------------


def test_date_is_ms_at_utc_midnight() -> None:
    assert parse_date("1970-01-01") == 0
    assert parse_date("2024-02-29") == 1709164800000
    assert parse_date("1969-12-31") == -86400000
    assert parse_date("0001-01-01 BC") == -62167219200000
    assert parse_date("0044-03-15 BC") == -63517824000000
    # 12345 = 9945 + 6 Gregorian cycles of 400 years (146097 days each).
    days = (datetime(9945, 6, 7, tzinfo=UTC) - _EPOCH).days + 6 * 146097
    assert parse_date("12345-06-07") == days * 86400000
    assert type(parse_date("5874897-12-31")) is float  # beyond 2^53 ms
    for bad in ["2024-1-02", "02-01-2024", "2024-01-32", "2024-01-02 00:00:00"]:
        with pytest.raises(PgValueError, match=f"invalid date value {bad!r}"):
            parse_date(bad)


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("00:00:00", 0),
        ("12:34:56", 45296000),
        ("12:34:56.789999", 45296789),  # truncated, not rounded, as the reference
        ("12:34:56.7", 45296700),
        ("23:59:59.999999", 86399999),
        ("24:00:00", 86400000),
    ],
)
def test_time_is_integer_ms_of_day(text: str, ms: int) -> None:
    assert parse(1083, text) == ms
    assert parse(1266, text + "+00") == ms


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("12:00:00+01", 11 * 3600_000),
        ("12:00:00-01", 13 * 3600_000),
        ("00:30:00+01", 84600000),  # wrapped back into the day
        ("23:30:00-01", 1800000),
        ("23:00:00-01", 86400000),  # exactly the end of the day stays
        ("12:00:00+05:30", 6 * 3600_000 + 30 * 60_000),
        ("12:00:00-05:30:15", 17 * 3600_000 + 30 * 60_000 + 15_000),
        ("00:00:00.5+15:59", 8 * 3600_000 + 60_000 + 500),
    ],
)
def test_timetz_subtracts_the_offset(text: str, ms: int) -> None:
    assert parse(1266, text) == ms


@pytest.mark.parametrize("bad", ["12:60:00", "25:00:00", "24:00:01", "1:2:3", "noon", ""])
def test_malformed_time(bad: str) -> None:
    with pytest.raises(PgValueError, match=f"invalid time value {bad!r}"):
        parse_time(bad)


# --- arrays ---------------------------------------------------------------------------


def test_arrays_convert_elements_by_element_type() -> None:
    assert parse(1007, "{1,2,3}") == [1, 2, 3]
    assert parse(1000, "{t,f}") == [True, False]
    assert parse(1022, "{1.5,NaN,-Infinity}") == [1.5, "NaN", "-Infinity"]
    assert parse(1115, '{"2024-01-02 03:04:05.123456","1970-01-01 00:00:00"}') == [
        1704164645123.456,
        0,
    ]
    assert parse(1182, "{1970-01-02,infinity}") == [86400000, "infinity"]
    assert parse(1270, '{"12:00:00+01"}') == [11 * 3600_000]


def test_null_elements_are_null_for_every_element_type() -> None:
    assert parse(1016, "{1,NULL,9223372036854775807}") == [1, None, 9223372036854775807]
    assert parse(1009, '{a,NULL,"NULL",null,"null"}') == ["a", None, "NULL", None, "null"]
    assert parse(1185, "{NULL}") == [None]
    assert parse(3807, '{NULL,"null"}', json_as_string=True) == [None, None]


def test_quoted_elements_and_escapes() -> None:
    text = r'{"a,b","say \"hi\"","back\\slash","{braces}","",with space," padded "}'
    assert parse(1009, text) == [
        "a,b",
        'say "hi"',
        "back\\slash",
        "{braces}",
        "",
        "with space",
        " padded ",
    ]
    assert parse(1009, '{"é","日本"}') == ["é", "日本"]


def test_nested_and_empty_arrays() -> None:
    assert parse(1007, "{}") == []
    assert parse(1007, "{{1,2},{3,4}}") == [[1, 2], [3, 4]]
    assert parse(1009, '{{{a,"b c"}},{{NULL,d}}}') == [[["a", "b c"]], [[None, "d"]]]


def test_lower_bound_decoration_is_dropped() -> None:
    assert parse(1007, "[0:2]={1,2,3}") == [1, 2, 3]
    assert parse(1007, "[-1:0][3:4]={{1,2},{3,4}}") == [[1, 2], [3, 4]]


def test_json_array_elements_are_parsed_even_as_string() -> None:
    text = r'{"{\"a\": 1}","[1, 2]",3,"\"s\"","null",NULL}'
    expected = [{"a": 1}, [1, 2], 3, "s", None, None]
    assert parse(199, text, json_as_string=True) == expected
    assert parse(3807, text, json_as_string=True) == expected
    assert parse(3807, text, json_as_string=False) == expected


def test_box_arrays_split_on_semicolons() -> None:
    assert parse(1020, "{(1,1),(0,0);(2,2),(1,1)}") == ["(1,1),(0,0)", "(2,2),(1,1)"]
    assert parse(1017, '{"(1,2)","(3,4)"}') == ["(1,2)", "(3,4)"]


@pytest.mark.parametrize(
    "text",
    ["", "1,2", "{1,2", "{1,,2}", "{,1}", "{1,}", '{"a}', "{1}x", "[1:2]{1,2}", "{{1},2}x"],
)
def test_malformed_array_names_the_array_type(text: str) -> None:
    with pytest.raises(PgValueError, match=re.escape(f"invalid _int4 value {text!r}")):
        parse(1007, text)


def test_bad_element_names_the_element_type() -> None:
    with pytest.raises(PgValueError, match="invalid int8 value 'x'"):
        parse(1016, "{1,x}")


def test_parse_array_is_lenient_about_whitespace_and_case() -> None:
    assert parse_array(" { a , b c ,Null, {x} } ", str) == ["a", "b c", None, ["x"]]
    assert parse_array(r"{a\,b,\NULL}", str) == ["a,b", "NULL"]
    with pytest.raises(ArrayLiteralError, match="missing delimiter"):
        parse_array('{"a" "b"}', str)


def _array_out(value: list[Any], delimiter: str = ",") -> str:
    """Postgres' array_out, for the round trip below."""
    parts = []
    for item in value:
        if isinstance(item, list):
            parts.append(_array_out(item, delimiter))
        elif item is None:
            parts.append("NULL")
        elif (
            item == ""
            or item.upper() == "NULL"
            or any(c in item for c in '{}"\\' + delimiter)
            or any(c.isspace() for c in item)
        ):
            parts.append('"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"')
        else:
            parts.append(item)
    return "{" + delimiter.join(parts) + "}"


_elements = st.one_of(st.none(), st.text(max_size=8), st.sampled_from(["NULL", "null", "", " "]))


@settings(max_examples=300, deadline=None)
@given(
    value=st.one_of(
        st.lists(_elements, max_size=6),
        st.integers(min_value=1, max_value=3).flatmap(
            lambda width: st.lists(st.lists(_elements, min_size=width, max_size=width), min_size=1)
        ),
    ),
    delimiter=st.sampled_from([",", ";"]),
)
def test_array_round_trip(value: list[Any], delimiter: str) -> None:
    assert parse_array(_array_out(value, delimiter), str, delimiter) == value


# --- the registry ---------------------------------------------------------------------


def test_parsers_are_cached_per_oid_and_flag() -> None:
    registry = TypeRegistry()
    assert registry.parser(1184, json_as_string=True) is registry.parser(1184, json_as_string=False)
    assert registry.parser(3802, json_as_string=True) is not registry.parser(
        3802, json_as_string=False
    )
    assert registry.parser(1016, json_as_string=True) is registry.parser(1016, json_as_string=True)


def test_user_types_enums_domains_and_their_arrays() -> None:
    registry = TypeRegistry(
        {
            70000: TypeInfo(70000, "mood", array=70001),
            70001: TypeInfo(70001, "_mood", elem=70000),
            70002: TypeInfo(70002, "posint", base=23, array=70003),
            70003: TypeInfo(70003, "_posint", elem=70002),
            70004: TypeInfo(70004, "intlist", base=1007),
            70005: TypeInfo(70005, "intlist2", base=70004),
        }
    )
    assert registry.knows(70001)
    assert not registry.knows(70099)
    assert not TypeRegistry().knows(70000)
    assert registry.parser(70000, json_as_string=True)("happy") == "happy"
    assert registry.parser(70001, json_as_string=True)("{happy,NULL}") == ["happy", None]
    assert registry.parser(70002, json_as_string=True)("5") == 5
    assert registry.parser(70003, json_as_string=True)("{5,6}") == [5, 6]
    assert registry.parser(70004, json_as_string=True)("{1,2}") == [1, 2]
    assert registry.parser(70005, json_as_string=True)("{3}") == [3]


def test_domain_cycle_is_an_error_not_a_hang() -> None:
    registry = TypeRegistry(
        {80000: TypeInfo(80000, "a", base=80001), 80001: TypeInfo(80001, "b", base=80000)}
    )
    with pytest.raises(ValueError, match="nests deeper"):
        registry.parser(80000, json_as_string=True)
