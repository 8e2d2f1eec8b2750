"""Subscription error codes and the in-band error message."""

from __future__ import annotations

from app.protocol.canonical_json import loads
from app.protocol.errors import (
    ErrorType,
    error_message_json,
    watermark_too_old_json,
    wrong_replica_version_json,
)


def test_error_codes_match_the_protocol() -> None:
    assert [(e.name, int(e)) for e in ErrorType] == [
        ("UNKNOWN", 0),
        ("WRONG_REPLICA_VERSION", 1),
        ("WATERMARK_TOO_OLD", 2),
        ("STREAM_TOO_FAR_BEHIND", 3),
    ]
    assert [e.readable_name for e in ErrorType] == [
        "Unknown",
        "WrongReplicaVersion",
        "WatermarkTooOld",
        "StreamTooFarBehind",
    ]


def test_watermark_too_old_error_matches_the_spec_bytes() -> None:
    assert watermark_too_old_json("04", "02") == (
        '["error",{"type":2,"message":"earliest supported watermark is 04 (requested 02)"}]'
    )


def test_wrong_replica_version_error_names_both_versions() -> None:
    assert wrong_replica_version_json("0c1a00", "0b0000") == (
        '["error",{"type":1,"message":"current replica version is 0c1a00 (requested 0b0000)"}]'
    )


def test_error_message_text_is_json_escaped() -> None:
    text = error_message_json(ErrorType.STREAM_TOO_FAR_BEHIND, 'a "quoted"\nline\\é')
    assert text == '["error",{"type":3,"message":"a \\"quoted\\"\\nline\\\\é"}]'
    assert loads(text)[1]["message"] == 'a "quoted"\nline\\é'
