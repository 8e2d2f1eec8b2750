"""Websocket envelopes: how they are spelled, strict acks, client-side envelope parsing."""

from __future__ import annotations

import pytest

from app.protocol.canonical_json import loads
from app.protocol.envelope import (
    AckError,
    Envelope,
    EnvelopeError,
    ack_frame,
    ack_from_value,
    parse_ack,
    parse_envelope,
)
from app.protocol.wsframes import envelope_texts

STATUS = '["status",{"tag":"status"}]'
ROLLBACK = '["rollback",{"tag":"rollback"}]'


def test_single_message_frames_match_the_wire_format() -> None:
    assert envelope_texts(1, [STATUS]) == ['{"id":1,"msg":["status",{"tag":"status"}]}']
    assert envelope_texts(7, [ROLLBACK, STATUS]) == [
        '{"id":7,"msg":["rollback",{"tag":"rollback"}]}',
        '{"id":8,"msg":["status",{"tag":"status"}]}',
    ]


def test_batch_frames_match_the_wire_format() -> None:
    assert envelope_texts(3, [STATUS, ROLLBACK, STATUS], per_frame=2) == [
        '{"id":3,"batch":[["status",{"tag":"status"}],["rollback",{"tag":"rollback"}]]}',
        '{"id":4,"msg":["status",{"tag":"status"}]}',  # a lone message is a msg frame
    ]


def test_frames_parse_back_on_the_client() -> None:
    [single] = envelope_texts(9, [STATUS])
    assert parse_envelope(single) == Envelope(
        9, [loads(STATUS)], False, {"id": 9, "msg": loads(STATUS)}
    )
    [batch_text] = envelope_texts(10, [STATUS, ROLLBACK], per_frame=64)
    batch = parse_envelope(batch_text)
    assert (batch.id, batch.batch, batch.messages) == (10, True, [loads(STATUS), loads(ROLLBACK)])
    empty = parse_envelope('{"id":11,"batch":[]}')
    assert (empty.batch, empty.messages) == (True, [])


def test_client_tolerates_extra_envelope_keys() -> None:
    env = parse_envelope('{"id":2,"msg":["rollback",{"tag":"rollback"}],"trace":"x"}')
    assert env.id == 2
    assert env.body["trace"] == "x"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b'{"id":1,"msg":[]}', "binary frames are not accepted"),
        ("{", "frame is not valid JSON"),
        ("[1]", "envelope must be a JSON object, got array"),
        ('{"msg":[]}', "envelope has no 'id'"),
        ('{"id":"1","msg":[]}', "'id' must be a non-negative integer"),
        ('{"id":true,"msg":[]}', "'id' must be a non-negative integer"),
        ('{"id":1.5,"msg":[]}', "'id' must be a non-negative integer"),
        ('{"id":-1,"msg":[]}', "'id' must be a non-negative integer"),
        ('{"id":1}', "exactly one of 'msg' and 'batch', has neither"),
        ('{"id":1,"msg":[],"batch":[]}', "exactly one of 'msg' and 'batch', has both"),
        ('{"id":1,"batch":{}}', "'batch' must be an array, got object"),
    ],
)
def test_malformed_envelopes_are_rejected_with_the_reason(data: str | bytes, reason: str) -> None:
    with pytest.raises(EnvelopeError) as info:
        parse_envelope(data)
    assert reason in str(info.value)


@pytest.mark.parametrize(
    ("data", "ack"),
    [
        ('{"ack":1}', 1),
        ('{"ack":0}', 0),
        (' {"ack" : 42}\n', 42),
        ('{"ack":9007199254740993}', 2**53 + 1),
    ],
)
def test_valid_ack_frames_yield_the_id(data: str, ack: int) -> None:
    assert parse_ack(data) == ack


def test_ack_frame_builder_round_trips() -> None:
    assert ack_frame(17) == '{"ack":17}'
    assert parse_ack(ack_frame(17)) == 17


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b'{"ack":1}', "binary frames are not accepted"),
        (bytearray(b'{"ack":1}'), "binary frames are not accepted"),
        ("", "not valid JSON"),
        ("ack 1", "not valid JSON"),
        ('{"ack":1', "not valid JSON"),
        ("[1]", "must be a JSON object, got array"),
        ('["data",{"tag":"insert"}]', "must be a JSON object, got array"),
        ("1", "must be a JSON object, got number"),
        ("null", "must be a JSON object, got null"),
        ("{}", "has no 'ack' key (keys: none)"),
        ('{"id":1,"msg":[]}', "has no 'ack' key (keys: 'id', 'msg')"),
        ('{"ack":1,"id":2}', "unexpected keys: 'id'"),
        ('{"id":2,"ack":1}', "unexpected keys: 'id'"),
        ('{"ack":true}', "got boolean true"),
        ('{"ack":false}', "got boolean false"),
        ('{"ack":1.0}', "got float 1.0"),
        ('{"ack":1.5}', "got float 1.5"),
        ('{"ack":1e3}', "got float 1000.0"),
        ('{"ack":"1"}', "got string"),
        ('{"ack":null}', "got null"),
        ('{"ack":[1]}', "got array"),
        ('{"ack":-1}', "must be a non-negative integer, got -1"),
        # Near misses of the fast path for the exact form {"ack":N}:
        ('{"ack":01}', "not valid JSON"),
        ('{"ack":\u0661}', "not valid JSON"),
        ('{"ack":1}}', "not valid JSON"),
        ('{"ack":}', "not valid JSON"),
        ('{"ack":+1}', "not valid JSON"),
    ],
)
def test_every_non_ack_frame_is_an_ack_error_with_a_precise_reason(
    data: str | bytes, reason: str
) -> None:
    with pytest.raises(AckError) as info:
        parse_ack(data)
    assert reason in str(info.value)
    assert isinstance(info.value, ValueError)


def test_decoded_values_can_be_checked_as_acks_without_reparsing() -> None:
    assert ack_from_value({"ack": 5}) == 5
    with pytest.raises(AckError, match="unexpected keys"):
        ack_from_value({"ack": 5, "msg": []})
