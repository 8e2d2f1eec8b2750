"""Subscriber-side messages: status/error builders and the client parser."""

from __future__ import annotations

from typing import Any

import pytest

from app.protocol.canonical_json import dumps, loads
from app.protocol.errors import ErrorType, error_message_json
from app.protocol.messages import Begin, Commit, Data, MessageValidationError, Rollback
from app.protocol.subscription_messages import (
    SYNTHETIC_ROLLBACK_JSON,
    DownstreamError,
    DownstreamStatus,
    parse_downstream_message,
    status_json,
)

LAG = {
    "lastTimings": {"sendTimeMs": 150, "commitTimeMs": 151, "receiveTimeMs": 152},
    "nextSendTimeMs": 234,
}


def test_initial_status_is_the_bare_status_message() -> None:
    assert status_json() == '["status",{"tag":"status"}]'


def test_status_with_lag_report_matches_the_spec_bytes() -> None:
    assert status_json(LAG) == (
        '["status",{"tag":"status","lagReport":{"lastTimings":{"sendTimeMs":150,'
        '"commitTimeMs":151,"receiveTimeMs":152},"nextSendTimeMs":234}}]'
    )


def test_synthetic_rollback_is_the_canonical_rollback() -> None:
    assert dumps(["rollback", {"tag": "rollback"}]) == SYNTHETIC_ROLLBACK_JSON


def test_client_parses_status_with_and_without_lag_report() -> None:
    assert parse_downstream_message(loads(status_json())) == DownstreamStatus(
        {"tag": "status"}, None
    )
    parsed = parse_downstream_message(loads(status_json(LAG)))
    assert isinstance(parsed, DownstreamStatus)
    assert parsed.lag_report == LAG
    assert dumps(parsed.as_list()) == status_json(LAG)


def test_client_parses_an_error_and_describes_it_like_zero() -> None:
    text = error_message_json(ErrorType.WATERMARK_TOO_OLD, "earliest supported watermark is 04")
    parsed = parse_downstream_message(loads(text))
    assert isinstance(parsed, DownstreamError)
    assert (parsed.type, parsed.error_type) == (2, ErrorType.WATERMARK_TOO_OLD)
    assert parsed.describe() == "WatermarkTooOld: earliest supported watermark is 04"
    assert dumps(parsed.as_list()) == text


def test_unknown_error_codes_are_kept_as_ints() -> None:
    parsed = parse_downstream_message(["error", {"type": 9, "message": "new"}])
    assert isinstance(parsed, DownstreamError)
    assert parsed.error_type is None
    assert parsed.describe() == "Error9: new"


@pytest.mark.parametrize(
    ("text", "cls"),
    [
        ('["begin",{"tag":"begin","json":"s"},{"commitWatermark":"0c3f2b"}]', Begin),
        (
            '["data",{"tag":"insert","relation":{"schema":"public","name":"issue",'
            '"rowKey":{"columns":["id"]}},"new":{"id":"a","title":"x"}}]',
            Data,
        ),
        ('["commit",{"tag":"commit","commitTimeMs":1760000000000},{"watermark":"0c3f2b"}]', Commit),
        ('["rollback",{"tag":"rollback"}]', Rollback),
    ],
)
def test_client_parses_the_data_plane_catalog(text: str, cls: type) -> None:
    parsed = parse_downstream_message(loads(text))
    assert isinstance(parsed, cls)
    assert dumps(parsed.as_list()) == text


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (["status", {"tag": "snapshot"}], "status: field 'tag' must be one of 'status'"),
        (["status", {}], "status: missing required field 'tag'"),
        (["status", {"tag": "status"}, {}], "status: expected 2 elements, got 3"),
        (
            ["status", {"tag": "status", "lagReport": {"nextSendTimeMs": 1}}],
            "status: missing required field 'lagReport.lastTimings'",
        ),
        (["error", {"type": "2", "message": "m"}], "error: field 'type' must be an integer"),
        (["error", {"type": True, "message": "m"}], "error: field 'type' must be an integer"),
        (["error", {"type": 2}], "error: missing required field 'message'"),
        (["control", {"tag": "reset-required"}], "unexpected message type 'control'"),
        (["pong", {}], "subscription message: unknown message type 'pong'"),
        ({"id": 1}, "subscription message: must be a JSON array, got object"),
    ],
)
def test_client_rejects_malformed_subscription_messages(value: Any, error: str) -> None:
    with pytest.raises(MessageValidationError) as info:
        parse_downstream_message(value)
    assert error in str(info.value)
