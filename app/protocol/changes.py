"""Shapes of the change objects (second tuple element) and relation normalization.

One check per change tag (spec/source.md §1.3-§1.6): data changes (``insert``,
``update``, ``delete``, ``truncate``, ``backfill``), schema changes, and the
``begin``/``commit``/``rollback`` payloads.  Checks are passthrough (see
:mod:`app.protocol.validation`).

Relations of insert/update/delete/truncate come in two forms; the deprecated one
(``keyColumns`` + ``replicaIdentity``, protocol < v5) is normalized by adding
``rowKey = {"columns": keyColumns, "type": replicaIdentity}``.  zero builds the
normalized relation as "all other keys, then rowKey", so ``rowKey`` always ends up
last; we do the same so our stored/forwarded bytes equal zero's.
"""

from __future__ import annotations

from typing import Any, Final

from app.protocol.validation import (
    Check,
    FieldError,
    any_value,
    array,
    boolean,
    json_object,
    nullable,
    number,
    one_of,
    record,
    shape,
    string,
)

__all__ = [
    "BEGIN",
    "COMMIT",
    "DATA_CHANGE_TAGS",
    "DATA_SHAPES",
    "ROLLBACK",
    "SCHEMA_CHANGE_TAGS",
    "relation",
]

_REPLICA_IDENTITY: Final = one_of("default", "nothing", "full", "index")
_PG_TYPE_CLASS: Final = one_of("b", "c", "d", "e", "p", "r", "m")
_STRINGS: Final = array(string)

BEGIN: Final = shape({}, {"json": one_of("p", "s"), "skipAck": boolean})
COMMIT: Final = shape({}, {"commitTimeMs": number})
ROLLBACK: Final = shape({})

_ROW_KEY: Final = shape({"columns": _STRINGS}, {"type": _REPLICA_IDENTITY})

_RELATION_FIELDS: Final = shape(
    {"schema": string, "name": string},
    {"rowKey": _ROW_KEY, "keyColumns": _STRINGS, "replicaIdentity": _REPLICA_IDENTITY},
)


def relation(v: Any) -> Any:
    """Check a relation and return it with ``rowKey`` present and last."""
    rel = _RELATION_FIELDS(v)
    if "rowKey" in rel:
        if next(reversed(rel)) == "rowKey":
            return rel
        row_key = rel["rowKey"]
        moved = {k: item for k, item in rel.items() if k != "rowKey"}
        moved["rowKey"] = row_key
        return moved
    if "keyColumns" not in rel:
        raise FieldError("or the deprecated 'keyColumns'", missing_key="rowKey")
    row_key = {"columns": rel["keyColumns"]}
    if "replicaIdentity" in rel:
        row_key["type"] = rel["replicaIdentity"]
    return {**rel, "rowKey": row_key}


# backfill messages were introduced after rowKey: no deprecated form, no rewrite.
_NEW_RELATION: Final = shape({"schema": string, "name": string, "rowKey": _ROW_KEY})

_ROW: Final = json_object
_IDENTIFIER: Final = shape({"schema": string, "name": string})
_TABLE_METADATA: Final = shape({"rowKey": json_object})
_BACKFILL_ID: Final = json_object
_DOWNLOAD_STATUS: Final = shape({"rows": number, "totalRows": number}, {"totalBytes": number})

_COLUMN_SPEC: Final = shape(
    {"pos": number, "dataType": string},
    {
        "pgTypeClass": _PG_TYPE_CLASS,
        "elemPgTypeClass": nullable(_PG_TYPE_CLASS),
        "characterMaximumLength": nullable(number),
        "notNull": nullable(boolean),
        "dflt": nullable(string),
    },
)
_COLUMN: Final = shape({"name": string, "spec": _COLUMN_SPEC})
_TABLE_SPEC: Final = shape(
    {"schema": string, "name": string, "columns": record(_COLUMN_SPEC)},
    {"primaryKey": _STRINGS},
)
_INDEX_SPEC: Final = shape(
    {
        "schema": string,
        "tableName": string,
        "name": string,
        "unique": boolean,
        "columns": record(one_of("ASC", "DESC")),
    }
)

DATA_CHANGE_TAGS: Final = ("insert", "update", "delete", "truncate", "backfill")
SCHEMA_CHANGE_TAGS: Final = (
    "create-table",
    "rename-table",
    "update-table-metadata",
    "add-column",
    "update-column",
    "drop-column",
    "drop-table",
    "create-index",
    "drop-index",
    "backfill-completed",
)

# Check for the body of a ["data", body] message, by body tag.
DATA_SHAPES: Final[dict[str, Check]] = {
    "insert": shape({"relation": relation, "new": _ROW}),
    "update": shape({"relation": relation, "key": nullable(_ROW), "new": _ROW}),
    "delete": shape({"relation": relation, "key": _ROW}),
    "truncate": shape({"relations": array(relation)}),
    "backfill": shape(
        {
            "relation": _NEW_RELATION,
            "columns": _STRINGS,
            "watermark": string,
            "rowValues": array(array(any_value)),
        },
        {"status": _DOWNLOAD_STATUS},
    ),
    "create-table": shape(
        {"spec": _TABLE_SPEC},
        {"metadata": _TABLE_METADATA, "backfill": record(_BACKFILL_ID)},
    ),
    "rename-table": shape({"old": _IDENTIFIER, "new": _IDENTIFIER}),
    "update-table-metadata": shape(
        {"table": _IDENTIFIER, "old": _TABLE_METADATA, "new": _TABLE_METADATA}
    ),
    "add-column": shape(
        {"table": _IDENTIFIER, "column": _COLUMN},
        {"tableMetadata": _TABLE_METADATA, "backfill": _BACKFILL_ID},
    ),
    "update-column": shape({"table": _IDENTIFIER, "old": _COLUMN, "new": _COLUMN}),
    "drop-column": shape({"table": _IDENTIFIER, "column": string}),
    "drop-table": shape({"id": _IDENTIFIER}),
    "create-index": shape({"spec": _INDEX_SPEC}),
    "drop-index": shape({"id": _IDENTIFIER}),
    "backfill-completed": shape(
        {"relation": _NEW_RELATION, "columns": _STRINGS, "watermark": string},
        {"status": _DOWNLOAD_STATUS},
    ),
}
