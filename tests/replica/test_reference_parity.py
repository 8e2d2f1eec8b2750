"""The replica we write is the replica zero-cache 1.9.0 writes, byte for byte.

The same transactions go through our :class:`ReplicaWriter` and through zero's own
``ChangeProcessor`` (``reference_apply.mjs``, run with node against the interop
install of ``@rocicorp/zero``); both files must then hold the same schema text
(``sqlite_master.sql``), the same rows and the same SQLite storage classes.
Only write times and event timestamps differ. Skipped without node or the
interop ``node_modules`` (``cd interop && npm ci``).
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest

from app.protocol.canonical_json import dumps
from app.replica.writer import ReplicaWriter

from .conftest import (
    column,
    create_index,
    create_table,
    delete,
    insert,
    new_replica,
    relation,
    update,
)

INTEROP = Path(__file__).resolve().parents[2] / "interop"
SCRIPT = Path(__file__).with_name("reference_apply.mjs")
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(
    NODE is None or not (INTEROP / "node_modules/@rocicorp/zero").is_dir(),
    reason="needs node and interop/node_modules (the reference zero-cache)",
)

FOO = {"schema": "public", "name": "foo"}
BAR = {"schema": "public", "name": "bar"}
# A table outside public that no later change rebuilds: its CREATE TABLE text survives.
QUX = {**relation("qux"), "schema": "app"}
QUX_TABLE = create_table("qux")
QUX_TABLE["spec"]["schema"] = "app"
QUX_INDEX = create_index("qux", unique=False)
QUX_INDEX["spec"]["schema"] = "app"


def tx(watermark: str, *changes: dict[str, Any], json: str = "s") -> list[list[Any]]:
    return [
        ["begin", {"tag": "begin", "json": json}, {"commitWatermark": watermark}],
        *(["data", c] for c in changes),
        ["commit", {"tag": "commit"}, {"watermark": watermark}],
    ]


MESSAGES = [
    *tx(
        "02",
        create_table(
            id=column(0, "int8", notNull=True),
            name=column(1, "text"),
            doc=column(2, "jsonb"),
            tags=column(3, "text[]", elemPgTypeClass="b"),
            ok=column(4, "bool"),
            f=column(5, "float8"),
            mood=column(6, "mood", pgTypeClass="e"),
        ),
        create_index(),
        create_index(name="foo_name", columns=("name",), unique=False),
    ),
    *tx(
        "03",
        insert({"id": 1, "name": "a", "doc": '{"x": 1}', "tags": ["a", None], "ok": True}),
        insert({"id": 2, "name": "b", "ok": False, "f": "NaN", "mood": "sad"}),
        insert({"id": 3, "f": 2.5}),
    ),
    *tx("04", insert({"id": 4, "doc": {"y": [1, 2]}, "tags": [], "f": 1.0}), json="p"),
    *tx(
        "05",
        update({"id": 5, "name": "a2"}, key={"id": 1}),
        update({"id": 9, "name": "upserted"}),
        update({"id": 3}),
        delete({"id": 2}),
    ),
    *tx(
        "06",
        {
            "tag": "add-column",
            "table": FOO,
            "column": {"name": "n", "spec": column(7, "int4", dflt="7")},
            "tableMetadata": {"rowKey": {"columns": ["id"]}},
        },
        insert({"id": 10, "n": 3}),
    ),
    *tx(
        "07",
        {
            "tag": "update-column",
            "table": FOO,
            "old": {"name": "name", "spec": column(1, "text")},
            "new": {"name": "title", "spec": column(1, "varchar", notNull=True)},
        },
    ),
    *tx(
        "08",
        {"tag": "rename-table", "old": FOO, "new": BAR},
        {"tag": "drop-column", "table": BAR, "column": "f"},
        {
            "tag": "update-table-metadata",
            "table": BAR,
            "old": {"rowKey": {}},
            "new": {"rowKey": {"a": 1}},
        },
    ),
    *tx(
        "09",
        create_table("baz"),
        create_index("baz"),
        insert({"id": 1}, table="baz"),
        {"tag": "truncate", "relations": [relation("baz")]},
        {"tag": "drop-index", "id": {"schema": "public", "name": "foo_name"}},
        QUX_TABLE,
        QUX_INDEX,
        {"tag": "insert", "relation": QUX, "new": {"id": 7, "name": "kept"}},
    ),
    *tx(
        "0a",
        {"tag": "drop-table", "id": {"schema": "public", "name": "baz"}},
        create_index("bar", name="bar_n", columns=("n", "id"), unique=False),
    ),
    *tx(
        "0b",
        {
            "tag": "add-column",
            "table": BAR,
            "column": {"name": "b", "spec": column(8, "text")},
            "backfill": {"attNum": 8},
        },
        update({"id": 9, "b": "live"}, table="bar"),
    ),
    *tx(
        "0b.01",
        {
            "tag": "backfill",
            "relation": relation("bar"),
            "columns": ["b"],
            "watermark": "0a",
            "rowValues": [[5, "o5"], [9, "o9"], [11, "o11"]],
        },
        {
            "tag": "backfill-completed",
            "relation": relation("bar"),
            "columns": ["b"],
            "watermark": "0a",
        },
    ),
]


def contents(path: Path) -> dict[str, Any]:
    conn = sqlite3.connect(path)
    try:
        out: dict[str, Any] = {}
        for name, kind, sql in conn.execute(
            "SELECT name, type, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"
        ):
            out[name] = sql
            if kind != "table":
                continue
            cursor = conn.execute(f'SELECT * FROM "{name}"')
            columns = [d[0] for d in cursor.description]
            data = cursor.fetchall()
            if name in ("_zero.replicationState", "_zero.runtimeEvents"):
                data = [row[:1] for row in data]  # drop the times
            types = conn.execute(
                f'SELECT {",".join(f"typeof({c!r})" for c in columns)} FROM "{name}"'
            ).fetchall()
            out[f"rows of {name}"] = sorted(map(repr, zip(data, types, strict=True)))
        return out
    finally:
        conn.close()


def test_our_replica_matches_the_reference(tmp_path: Path) -> None:
    messages = tmp_path / "messages.json"
    messages.write_text(dumps(MESSAGES))
    reference = tmp_path / "reference.db"
    assert NODE is not None
    subprocess.run(
        [NODE, str(SCRIPT), str(INTEROP), str(reference), str(messages)],
        check=True,
        timeout=60,
        capture_output=True,
    )

    ours = new_replica(tmp_path / "ours.db")
    writer = ReplicaWriter(ours)
    try:
        for kind, body, *trailer in MESSAGES:
            if kind == "begin":
                writer.begin(trailer[0]["commitWatermark"], body)
            elif kind == "data":
                writer.apply(body)
            else:
                writer.commit(trailer[0]["watermark"], body)
    finally:
        writer.close()

    expected, got = contents(reference), contents(ours)
    assert "rows of bar" in got
    assert got == expected
