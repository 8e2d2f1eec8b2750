"""Change-source messages: validation, passthrough and relation normalization."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from app.protocol.canonical_json import dumps, loads
from app.protocol.changes import DATA_CHANGE_TAGS, DATA_SHAPES, SCHEMA_CHANGE_TAGS
from app.protocol.messages import (
    Begin,
    Commit,
    Control,
    Data,
    MessageValidationError,
    Rollback,
    Status,
    parse_change_source_message,
    parse_data_plane,
)

REL = '{"schema":"public","name":"foo","rowKey":{"columns":["id"],"type":"default"}}'
IDENT = '{"schema":"public","name":"foo"}'
META = '{"rowKey":{"id":{"attNum":1}}}'
COL = '{"name":"bar","spec":{"pos":1,"dataType":"text"}}'

# One canonical example per data tag; the unknown keys ("x*") must survive untouched.
DATA_EXAMPLES = {
    "insert": f'{{"tag":"insert","relation":{REL},"new":{{"id":1,"v":null}},"x":1}}',
    "update": f'{{"tag":"update","relation":{REL},"key":null,"new":{{"id":2}},"old":null}}',
    "delete": f'{{"tag":"delete","relation":{REL},"key":{{"id":1}},"old":{{"id":1,"v":"a"}}}}',
    "truncate": f'{{"tag":"truncate","relations":[{REL},{REL}],"cascade":false}}',
    "backfill": (
        f'{{"tag":"backfill","relation":{REL},"columns":["v"],"watermark":"4d7lu8",'
        '"rowValues":[[1,"a"],[2,null]],"status":{"rows":2,"totalRows":10,"totalBytes":99}}'
    ),
    "create-table": (
        '{"tag":"create-table","spec":{"schema":"public","name":"foo","primaryKey":["id"],'
        '"columns":{"id":{"pos":0,"dataType":"text","notNull":true,"typeOID":25},'
        '"bar":{"pos":1,"dataType":"int4[]","pgTypeClass":"b","elemPgTypeClass":"b",'
        '"characterMaximumLength":null,"dflt":null}},"oid":16384},'
        f'"metadata":{META},"backfill":{{"bar":{{"attNum":2}}}}}}'
    ),
    "rename-table": '{"tag":"rename-table","old":{"schema":"public","name":"before"},'
    '"new":{"schema":"archive","name":"after"}}',
    "update-table-metadata": (
        f'{{"tag":"update-table-metadata","table":{IDENT},"old":{META},"new":{META}}}'
    ),
    "add-column": (
        f'{{"tag":"add-column","table":{IDENT},"column":{COL},"tableMetadata":{META},'
        '"backfill":{"attNum":2}}'
    ),
    "update-column": f'{{"tag":"update-column","table":{IDENT},"old":{COL},"new":{COL}}}',
    "drop-column": f'{{"tag":"drop-column","table":{IDENT},"column":"bar"}}',
    "drop-table": f'{{"tag":"drop-table","id":{IDENT}}}',
    "create-index": (
        '{"tag":"create-index","spec":{"schema":"public","tableName":"foo",'
        '"name":"public_foo_index","unique":true,"columns":{"id":"ASC","v":"DESC"},'
        '"isPrimaryKey":false}}'
    ),
    "drop-index": f'{{"tag":"drop-index","id":{IDENT}}}',
    "backfill-completed": (
        f'{{"tag":"backfill-completed","relation":{REL},"columns":["v"],"watermark":"4d7lu8"}}'
    ),
}

OTHER_EXAMPLES = [
    '["begin",{"tag":"begin","commitLsn":"00000000/01529750","commitTime":1764426733675649,'
    '"xid":726,"json":"s"},{"commitWatermark":"4d7lu8"}]',
    '["begin",{"tag":"begin","json":"s","skipAck":true},{"commitWatermark":"4d7lu8.01"}]',
    '["commit",{"tag":"commit","flags":0,"commitLsn":"00000000/01529750",'
    '"commitEndLsn":"00000000/01529780","commitTime":1764426733675649,'
    '"commitTimeMs":1764426733675},{"watermark":"4d7lu8"}]',
    '["rollback",{"tag":"rollback"}]',
    '["status",{"ack":true},{"watermark":"4d7lv0"}]',
    '["status",{"ack":false,"lagReport":{"lastTimings":{"sendTimeMs":1764426733000,'
    '"commitTimeMs":1764426733001,"receiveTimeMs":1764426733020},"nextSendTimeMs":1764426763000}},'
    '{"watermark":"4d7m00"}]',
    '["control",{"tag":"reset-required","message":"slot lost","errorDetails":{"code":"X"}}]',
]


def parse_text(text: str) -> Any:
    return parse_change_source_message(loads(text))


def test_every_change_tag_has_an_example() -> None:
    assert set(DATA_EXAMPLES) == set(DATA_CHANGE_TAGS) | set(SCHEMA_CHANGE_TAGS)
    assert set(DATA_SHAPES) == set(DATA_EXAMPLES)


@pytest.mark.parametrize("tag", list(DATA_EXAMPLES))
def test_data_message_of_every_tag_passes_through_byte_for_byte(tag: str) -> None:
    text = f'["data",{DATA_EXAMPLES[tag]}]'
    msg = parse_text(text)
    assert isinstance(msg, Data)
    assert msg.tag == tag
    assert msg.kind == "data"
    assert dumps(msg.as_list()) == text


@pytest.mark.parametrize("text", OTHER_EXAMPLES)
def test_begin_commit_rollback_status_control_pass_through_byte_for_byte(text: str) -> None:
    assert dumps(parse_text(text).as_list()) == text


def test_begin_exposes_commit_watermark_and_skip_ack() -> None:
    msg = parse_text(OTHER_EXAMPLES[1])
    assert msg == Begin(loads(OTHER_EXAMPLES[1])[1], "4d7lu8.01", True)
    assert msg.tag == "begin"
    plain = parse_text(OTHER_EXAMPLES[0])
    assert isinstance(plain, Begin)
    assert plain.skip_ack is False


def test_commit_and_rollback_expose_their_fields() -> None:
    commit = parse_text(OTHER_EXAMPLES[2])
    assert isinstance(commit, Commit)
    assert (commit.tag, commit.watermark) == ("commit", "4d7lu8")
    rollback = parse_text(OTHER_EXAMPLES[3])
    assert isinstance(rollback, Rollback)
    assert rollback.tag == "rollback"


def test_status_ack_defaults_to_true_when_absent() -> None:
    msg = parse_text('["status",{},{"watermark":"4d7lv0"}]')
    assert msg == Status({}, "4d7lv0", True, None)


def test_status_carries_ack_false_and_the_lag_report() -> None:
    msg = parse_text(OTHER_EXAMPLES[5])
    assert isinstance(msg, Status)
    assert msg.ack is False
    assert msg.lag_report == {
        "lastTimings": {
            "sendTimeMs": 1764426733000,
            "commitTimeMs": 1764426733001,
            "receiveTimeMs": 1764426733020,
        },
        "nextSendTimeMs": 1764426763000,
    }


def test_control_exposes_message_and_error_details() -> None:
    msg = parse_text(OTHER_EXAMPLES[6])
    assert isinstance(msg, Control)
    assert (msg.tag, msg.message, msg.error_details) == (
        "reset-required",
        "slot lost",
        {"code": "X"},
    )
    bare = parse_text('["control",{"tag":"reset-required"}]')
    assert isinstance(bare, Control)
    assert (bare.message, bare.error_details) == (None, None)


def test_unknown_fields_big_ints_and_odd_strings_survive_byte_for_byte() -> None:
    text = (
        '["data",{"tag":"insert","zz":{"nested":[1,{"a":[]}],"e":{}},'
        '"relation":{"schema":"public","name":"t","relationOid":-2147483000,'
        '"rowKey":{"columns":["id"],"extra":true}},'
        '"new":{"id":123456789012345678901234567890,"s":"\\u0000\\"\\\\,]}\u2028😀",'
        '"f":1704164645123.456,"j":"{\\"x\\": 1}"},"trailing":null}]'
    )
    assert dumps(parse_text(text).as_list()) == text


def test_deprecated_relation_form_is_normalized_with_row_key_last() -> None:
    rel = '{"schema":"public","name":"foo","keyColumns":["id"],"replicaIdentity":"full","x":1}'
    msg = parse_text(f'["data",{{"tag":"delete","relation":{rel},"key":{{"id":1}}}}]')
    assert dumps(msg.as_list()) == (
        '["data",{"tag":"delete","relation":{"schema":"public","name":"foo","keyColumns":["id"],'
        '"replicaIdentity":"full","x":1,"rowKey":{"columns":["id"],"type":"full"}},'
        '"key":{"id":1}}]'
    )


def test_deprecated_relation_without_replica_identity_gets_columns_only() -> None:
    rel = '{"schema":"public","name":"foo","keyColumns":["a","b"]}'
    msg = parse_text(f'["data",{{"tag":"insert","relation":{rel},"new":{{}}}}]')
    assert msg.body["relation"]["rowKey"] == {"columns": ["a", "b"]}


def test_row_key_is_moved_last_as_zero_does() -> None:
    rel = '{"rowKey":{"columns":["id"]},"schema":"public","name":"foo"}'
    msg = parse_text(f'["data",{{"tag":"insert","relation":{rel},"new":{{"id":1}}}}]')
    assert (
        dumps(msg.body["relation"])
        == '{"schema":"public","name":"foo","rowKey":{"columns":["id"]}}'
    )
    assert list(msg.body) == ["tag", "relation", "new"]


def test_truncate_normalizes_every_relation() -> None:
    old_form = '{"schema":"public","name":"a","keyColumns":["id"]}'
    msg = parse_text(f'["data",{{"tag":"truncate","relations":[{REL},{old_form}]}}]')
    relations = msg.body["relations"]
    assert relations[0] == loads(REL)
    assert relations[1]["rowKey"] == {"columns": ["id"]}


def test_normalization_does_not_mutate_the_input() -> None:
    value = loads(
        '["data",{"tag":"insert","relation":{"schema":"s","name":"n","keyColumns":["id"]},'
        '"new":{"id":1}}]'
    )
    before = copy.deepcopy(value)
    parse_change_source_message(value)
    assert value == before


def test_trailer_extra_keys_are_dropped_so_the_codec_stays_exact() -> None:
    msg = parse_text('["commit",{"tag":"commit"},{"watermark":"06","extra":"a,b"}]')
    assert dumps(msg.as_list()) == '["commit",{"tag":"commit"},{"watermark":"06"}]'


def test_parse_data_plane_accepts_only_data_plane_messages() -> None:
    assert isinstance(parse_data_plane(loads('["rollback",{"tag":"rollback"}]')), Rollback)
    with pytest.raises(MessageValidationError, match="unexpected message type 'status'"):
        parse_data_plane(loads('["status",{},{"watermark":"01"}]'))


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            '["data",{"tag":"insert","relation":{"schema":"public"},"new":{}}]',
            "data/insert: missing required field 'relation.name'",
        ),
        (
            '["data",{"tag":"insert","relation":{"schema":"public","name":"foo"},"new":{}}]',
            "data/insert: missing required field 'relation.rowKey' "
            "(or the deprecated 'keyColumns')",
        ),
        (
            f'["data",{{"tag":"insert","relation":{REL}}}]',
            "data/insert: missing required field 'new'",
        ),
        (
            f'["data",{{"tag":"update","relation":{REL},"new":{{}}}}]',
            "data/update: missing required field 'key'",
        ),
        (
            '["data",{"tag":"backfill","relation":{"schema":"s","name":"n","keyColumns":["id"]},'
            '"columns":[],"watermark":"01","rowValues":[]}]',
            "data/backfill: missing required field 'relation.rowKey'",
        ),
        (
            '["data",{"tag":"create-table","spec":{"schema":"s","name":"n",'
            '"columns":{"id":{"dataType":"text"}}}}]',
            "data/create-table: missing required field 'spec.columns.id.pos'",
        ),
        ('["data",{"relation":{}}]', "data: missing required field 'tag'"),
        (
            '["begin",{"tag":"begin"},{}]',
            "begin: missing required field 'commitWatermark'",
        ),
        (
            '["commit",{"tag":"commit"},{"commitWatermark":"01"}]',
            "commit: missing required field 'watermark'",
        ),
        ('["status",{},{}]', "status: missing required field 'watermark'"),
        (
            '["status",{"lagReport":{"lastTimings":{"sendTimeMs":1,"commitTimeMs":2},'
            '"nextSendTimeMs":3}},{"watermark":"01"}]',
            "status: missing required field 'lagReport.lastTimings.receiveTimeMs'",
        ),
        ('["control",{}]', "control: missing required field 'tag'"),
    ],
)
def test_missing_required_field_is_named_with_its_path(text: str, error: str) -> None:
    with pytest.raises(MessageValidationError) as info:
        parse_text(text)
    assert str(info.value) == error


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            '["data",{"tag":"insert","relation":{"schema":"public","name":7,'
            '"rowKey":{"columns":[]}},"new":{}}]',
            "data/insert: field 'relation.name' must be a string, got number",
        ),
        (
            '["data",{"tag":"truncate","relations":[{"schema":"s","name":"n",'
            '"rowKey":{"columns":["a",null]}}]}]',
            "data/truncate: field 'relations[0].rowKey.columns[1]' must be a string, got null",
        ),
        (
            f'["data",{{"tag":"insert","relation":{REL},"new":[1]}}]',
            "data/insert: field 'new' must be an object, got array",
        ),
        (
            '["data",{"tag":"insert","relation":{"schema":"s","name":"n",'
            '"rowKey":{"columns":[],"type":"primary"}},"new":{}}]',
            "data/insert: field 'relation.rowKey.type' must be one of 'default', 'nothing', "
            "'full', 'index', got 'primary'",
        ),
        (
            '["data",{"tag":"create-index","spec":{"schema":"s","tableName":"t","name":"i",'
            '"unique":"yes","columns":{}}}]',
            "data/create-index: field 'spec.unique' must be a boolean, got string",
        ),
        (
            '["data",{"tag":"create-index","spec":{"schema":"s","tableName":"t","name":"i",'
            '"unique":true,"columns":{"a":"UP"}}}]',
            "data/create-index: field 'spec.columns.a' must be one of 'ASC', 'DESC', got 'UP'",
        ),
        (
            '["data",{"tag":"add-column","table":{"schema":"s","name":"t"},'
            '"column":{"name":"c","spec":{"pos":true,"dataType":"text"}}}]',
            "data/add-column: field 'column.spec.pos' must be a number, got boolean",
        ),
        (
            '["data",{"tag":"add-column","table":{"schema":"s","name":"t"},'
            '"column":{"name":"c","spec":{"pos":1,"dataType":"text","notNull":"no"}}}]',
            "data/add-column: field 'column.spec.notNull' must be a boolean, got string",
        ),
        (
            '["data",{"tag":"update-table-metadata","table":{"schema":"s","name":"t"},'
            '"old":{"rowKey":[]},"new":{"rowKey":{}}}]',
            "data/update-table-metadata: field 'old.rowKey' must be an object, got array",
        ),
        (
            f'["data",{{"tag":"backfill","relation":{REL},"columns":[],"watermark":"01",'
            '"rowValues":[[1],2]}]',
            "data/backfill: field 'rowValues[1]' must be an array, got number",
        ),
        (
            '["begin",{"tag":"begin","skipAck":"true"},{"commitWatermark":"01"}]',
            "begin: field 'skipAck' must be a boolean, got string",
        ),
        (
            '["begin",{"tag":"begin","json":null},{"commitWatermark":"01"}]',
            "begin: field 'json' must be one of 'p', 's', got null",
        ),
        (
            '["commit",{"tag":"commit","commitTimeMs":"1"},{"watermark":"01"}]',
            "commit: field 'commitTimeMs' must be a number, got string",
        ),
        (
            '["status",{"ack":1},{"watermark":"01"}]',
            "status: field 'ack' must be a boolean, got number",
        ),
        (
            '["control",{"tag":"reset-required","errorDetails":"x"}]',
            "control: field 'errorDetails' must be an object, got string",
        ),
        (
            '["control",{"tag":"status-requested"}]',
            "control: field 'tag' must be one of 'reset-required', got 'status-requested'",
        ),
        (
            '["begin",{"tag":"commit"},{"commitWatermark":"01"}]',
            "begin: field 'tag' must be 'begin', got 'commit'",
        ),
        ('["data",{"tag":5}]', "data: field 'tag' must be a string, got number"),
        ('["data",{"tag":"upsert"}]', "data: field 'tag' is not a known change tag: 'upsert'"),
    ],
)
def test_wrong_field_type_is_reported_with_path_and_reason(text: str, error: str) -> None:
    with pytest.raises(MessageValidationError) as info:
        parse_text(text)
    assert str(info.value) == error


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('["begin",{"tag":"begin"},{"commitWatermark":"1"}]', "shorter than 2 characters"),
        ('["commit",{"tag":"commit"},{"watermark":"0A"}]', "only lower-case base-36 digits"),
        ('["status",{},{"watermark":"4d7m0"}]', "announces 5 digit(s) but the body has 4"),
        ('["begin",{"tag":"begin"},{"commitWatermark":"4d7lu8.1"}]', "minor part"),
        ('["commit",{"tag":"commit"},{"watermark":6}]', "must be a string, got number"),
    ],
)
def test_watermarks_must_be_lexi_versions(text: str, error: str) -> None:
    with pytest.raises(MessageValidationError) as info:
        parse_text(text)
    assert error in str(info.value)
    assert "watermark" in info.value.field.lower()


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ({"tag": "insert"}, "change-source message: must be a JSON array, got object"),
        ("begin", "change-source message: must be a JSON array, got string"),
        ([], "change-source message: is an empty array"),
        ([1, {}], "change-source message: first element must be the message type, got number"),
        (["upsert", {}], "change-source message: unknown message type 'upsert'"),
        (["begin", {"tag": "begin"}], "begin: expected 3 elements, got 2"),
        (["data", {"tag": "insert"}, {}], "data: expected 2 elements, got 3"),
        (["rollback"], "rollback: expected 2 elements, got 1"),
        (["status", {}], "status: expected 3 elements, got 2"),
        (["control", {"tag": "reset-required"}, {}], "control: expected 2 elements, got 3"),
        (["data", []], "data: body must be an object, got array"),
        (
            ["commit", {"tag": "commit"}, "06"],
            "commit: third element must be an object, got string",
        ),
        (["status", [], {"watermark": "01"}], "status: must be an object, got array"),
    ],
)
def test_malformed_envelope_of_a_message_is_rejected(value: Any, error: str) -> None:
    with pytest.raises(MessageValidationError) as info:
        parse_change_source_message(value)
    assert str(info.value) == error


def test_validation_error_is_a_value_error_with_structured_fields() -> None:
    with pytest.raises(ValueError, match=r"relation\.name") as info:
        parse_text('["data",{"tag":"insert","relation":{"schema":"public"},"new":{}}]')
    err = info.value
    assert isinstance(err, MessageValidationError)
    assert (err.context, err.field) == ("data/insert", "relation.name")
