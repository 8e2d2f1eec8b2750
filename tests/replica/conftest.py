"""Replica files under tmp_path, and small builders for the changes the tests apply."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.replica.schema import init_replica, open_replica
from app.replica.writer import ReplicaWriter

REPLICA_VERSION = "01"


def new_replica(path: Path, version: str = REPLICA_VERSION) -> Path:
    conn = open_replica(path, create=True)
    try:
        init_replica(conn, version, ["zero_data"], {"test": True})
    finally:
        conn.close()
    return path


@pytest.fixture
def replica(tmp_path: Path) -> Path:
    return new_replica(tmp_path / "replica.db")


@pytest.fixture
def writer(replica: Path) -> Iterator[ReplicaWriter]:
    w = ReplicaWriter(replica)
    yield w
    w.close()


def relation(name: str = "foo", columns: tuple[str, ...] = ("id",), **extra: Any) -> dict[str, Any]:
    return {
        "schema": "public",
        "name": name,
        "rowKey": {"columns": list(columns), "type": "default"},
        **extra,
    }


def column(pos: int, data_type: str, **extra: Any) -> dict[str, Any]:
    return {"pos": pos, "dataType": data_type, **extra}


def create_table(name: str = "foo", /, **columns: dict[str, Any]) -> dict[str, Any]:
    cols = columns or {
        "id": column(0, "int8", notNull=True),
        "name": column(1, "text"),
    }
    return {
        "tag": "create-table",
        "spec": {"schema": "public", "name": name, "columns": cols, "primaryKey": ["id"]},
        "metadata": {"rowKey": {"columns": ["id"]}},
    }


def create_index(
    table: str = "foo",
    name: str | None = None,
    columns: tuple[str, ...] = ("id",),
    unique: bool = True,
) -> dict[str, Any]:
    return {
        "tag": "create-index",
        "spec": {
            "schema": "public",
            "tableName": table,
            "name": name or f"{table}_pkey",
            "unique": unique,
            "columns": dict.fromkeys(columns, "ASC"),
        },
    }


def insert(new: dict[str, Any], table: str = "foo", **rel: Any) -> dict[str, Any]:
    return {"tag": "insert", "relation": relation(table, **rel), "new": new}


def update(
    new: dict[str, Any], key: dict[str, Any] | None = None, table: str = "foo"
) -> dict[str, Any]:
    return {"tag": "update", "relation": relation(table), "key": key, "new": new}


def delete(key: dict[str, Any], table: str = "foo") -> dict[str, Any]:
    return {"tag": "delete", "relation": relation(table), "key": key}


def apply_tx(w: ReplicaWriter, watermark: str, *changes: dict[str, Any], json: str = "p") -> None:
    w.begin(watermark, {"tag": "begin", "json": json})
    for change in changes:
        w.apply(change)
    w.commit(watermark, {"tag": "commit"})


def rows(path: Path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def snapshot(path: Path) -> dict[str, Any]:
    """Every table's schema and rows: compares a file before and after."""
    conn = sqlite3.connect(path)
    try:
        out: dict[str, Any] = {}
        for name, sql in conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY name"
        ):
            out[name] = sql
            if sql and sql.startswith("CREATE TABLE"):
                out[f"rows:{name}"] = conn.execute(f'SELECT * FROM "{name}" ORDER BY 1').fetchall()
        return out
    finally:
        conn.close()
