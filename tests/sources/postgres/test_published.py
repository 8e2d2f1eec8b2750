"""The published-schema query against a real Postgres (spec/source.md §1.6): the JSON
shape and key order of tables, columns and indexes, and ``replicaIdentityColumns``.

Each test gets its own scratch database (conftest) with a publication ``hpb_p`` over schema
public (no shard needed: the query only reads catalogs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from app.sources.postgres.errors import PublicationError
from app.sources.postgres.published import (
    PublishedSchema,
    TableSpec,
    publication_info,
    published_schema,
    with_replica_identity_columns,
)

PUBS = ["hpb_p"]


@pytest.fixture
async def conn(db_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        await c.execute("CREATE PUBLICATION hpb_p FOR TABLES IN SCHEMA public")
        yield c


def table(schema: PublishedSchema, name: str) -> TableSpec:
    (found,) = [t for t in schema["tables"] if t["name"] == name]
    return found


async def test_every_column_kind(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(
        """
        CREATE TYPE mood AS ENUM ('ok', 'sad');
        CREATE TABLE kinds (
          id int8 PRIMARY KEY,
          t text NOT NULL DEFAULT 'x',
          vc varchar(20),
          ch char(5),
          num numeric(10, 2) DEFAULT 1.5,
          ints int4[] NOT NULL DEFAULT '{}',
          grid text[][],
          m mood,
          ms mood[],
          j jsonb,
          ts timestamptz DEFAULT now(),
          gen int8 GENERATED ALWAYS AS (id * 2) STORED
        )
        """
    )

    schema = await published_schema(conn, PUBS)

    kinds = table(schema, "kinds")
    assert list(kinds) == [
        "oid",
        "schema",
        "schemaOID",
        "name",
        "replicaIdentity",
        "columns",
        "primaryKey",
        "publications",
        "replicaIdentityColumns",
    ]
    assert kinds["schema"] == "public"
    assert kinds["replicaIdentity"] == "d"
    assert kinds["primaryKey"] == ["id"]
    assert kinds["replicaIdentityColumns"] == ["id"]
    assert kinds["publications"] == {"hpb_p": {"rowFilter": None}}
    cur = await conn.execute(
        "SELECT 'kinds'::regclass::oid::int8, 'public'::regnamespace::oid::int8, "
        "'mood'::regtype::oid::int8"
    )
    row = await cur.fetchone()
    assert row is not None
    oid, schema_oid, mood_oid = row
    assert (kinds["oid"], kinds["schemaOID"]) == (oid, schema_oid)

    cols = kinds["columns"]
    # Generated columns are not replicated (PG15 lists them anyway; the query drops them).
    assert list(cols) == ["ch", "grid", "id", "ints", "j", "m", "ms", "num", "t", "ts", "vc"]
    # Postgres orders jsonb keys by length, then bytes; the parse keeps that order.
    assert list(cols["id"]) == [
        "pos",
        "dflt",
        "notNull",
        "typeOID",
        "dataType",
        "pgTypeClass",
        "elemPgTypeClass",
        "characterMaximumLength",
    ]
    expected = {
        "id": (1, "int8", 20, "b", None, None, True, None),
        "t": (2, "text", 25, "b", None, None, True, "'x'::text"),
        "vc": (3, "varchar", 1043, "b", None, 20, False, None),
        "ch": (4, "bpchar", 1042, "b", None, 5, False, None),
        "num": (5, "numeric", 1700, "b", None, 655366, False, "1.5"),
        "ints": (6, "int4[]", 1007, "b", "b", None, True, "'{}'::integer[]"),
        "grid": (7, "text[][]", 1009, "b", "b", None, False, None),
        "m": (8, "mood", mood_oid, "e", None, None, False, None),
        "ms": (9, "mood[]", None, "b", "e", None, False, None),
        "j": (10, "jsonb", 3802, "b", None, None, False, None),
        "ts": (11, "timestamptz", 1184, "b", None, None, False, "now()"),
    }
    for name, (pos, data_type, type_oid, cls, elem, max_len, not_null, dflt) in expected.items():
        spec = cols[name]
        got = (
            spec["pos"],
            spec["dataType"],
            spec["typeOID"] if type_oid is not None else None,
            spec.get("pgTypeClass"),
            spec.get("elemPgTypeClass"),
            spec.get("characterMaximumLength"),
            spec.get("notNull"),
            spec.get("dflt"),
        )
        assert got == (pos, data_type, type_oid, cls, elem, max_len, not_null, dflt), name


async def test_indexes_keep_column_order_and_direction(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(
        """
        CREATE TABLE t (a int NOT NULL, b text NOT NULL, c int, PRIMARY KEY (b, a));
        CREATE UNIQUE INDEX t_c_desc ON t (c DESC, a);
        CREATE INDEX t_partial ON t (c) WHERE c > 0;
        CREATE INDEX t_expr ON t (lower(b));
        ALTER TABLE t ADD CONSTRAINT t_c_deferred UNIQUE (c) DEFERRABLE INITIALLY DEFERRED;
        """
    )

    schema = await published_schema(conn, PUBS)

    by_name = {i["name"]: i for i in schema["indexes"]}
    assert sorted(by_name) == ["t_c_deferred", "t_c_desc", "t_pkey"]  # no partial/expression
    assert by_name["t_pkey"] == {
        "schema": "public",
        "tableName": "t",
        "name": "t_pkey",
        "unique": True,
        "isPrimaryKey": True,
        "isReplicaIdentity": False,
        "isImmediate": True,
        "columns": {"b": "ASC", "a": "ASC"},
    }
    assert list(by_name["t_pkey"]["columns"]) == ["b", "a"]
    assert list(by_name["t_c_desc"]["columns"].items()) == [("c", "DESC"), ("a", "ASC")]
    assert by_name["t_c_deferred"]["isImmediate"] is False
    assert table(schema, "t")["primaryKey"] == ["b", "a"]


async def test_renamed_column_shows_in_the_index(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute("CREATE TABLE r (id int PRIMARY KEY); ALTER TABLE r RENAME id TO key")

    schema = await published_schema(conn, PUBS)

    assert [i["columns"] for i in schema["indexes"]] == [{"key": "ASC"}]


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("CREATE TABLE x (a int NOT NULL, b int NOT NULL, PRIMARY KEY (b, a))", ["b", "a"]),
        (
            "CREATE TABLE x (a int NOT NULL, b int); CREATE UNIQUE INDEX x_a ON x (a);"
            "ALTER TABLE x REPLICA IDENTITY USING INDEX x_a",
            ["a"],
        ),
        # FULL: the row key the replicator will choose: the shortest unique index over
        # NOT NULL columns of types it syncs (bytea is not one), ties by column names.
        (
            "CREATE TABLE x (a int NOT NULL, b text NOT NULL, c bytea NOT NULL, d int);"
            "CREATE UNIQUE INDEX x_ba ON x (b, a); CREATE UNIQUE INDEX x_c ON x (c);"
            "CREATE UNIQUE INDEX x_d ON x (d); CREATE UNIQUE INDEX x_ab ON x (a, b);"
            "ALTER TABLE x REPLICA IDENTITY FULL",
            ["a", "b"],
        ),
        ("CREATE TABLE x (a int); ALTER TABLE x REPLICA IDENTITY FULL", []),
        ("CREATE TABLE x (a int)", []),
        ("CREATE TABLE x (a int); ALTER TABLE x REPLICA IDENTITY NOTHING", []),
    ],
)
async def test_replica_identity_columns(
    conn: psycopg.AsyncConnection[Any], setup: str, expected: list[str]
) -> None:
    await conn.execute(setup.encode())

    schema = await published_schema(conn, PUBS)

    assert table(schema, "x")["replicaIdentityColumns"] == expected


async def test_column_lists_limit_the_published_columns(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(
        "CREATE TABLE cl (id int PRIMARY KEY, shown text, hidden text);"
        "CREATE PUBLICATION hpb_cl FOR TABLE cl (id, shown)"
    )

    schema = await published_schema(conn, ["hpb_cl"])

    assert list(table(schema, "cl")["columns"]) == ["id", "shown"]


async def test_table_published_with_two_column_lists_is_refused(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(
        "CREATE TABLE cl (id int PRIMARY KEY, a text);"
        "CREATE PUBLICATION hpb_one FOR TABLE cl (id);"
        "CREATE PUBLICATION hpb_two FOR TABLE cl (id, a)"
    )

    with pytest.raises(PublicationError, match="exported with different columns"):
        await publication_info(conn, ["hpb_one", "hpb_two"])
    info = await publication_info(conn, ["hpb_one"])
    assert [p.pubname for p in info.publications] == ["hpb_one"]


async def test_empty_publication_gives_empty_lists(conn: psycopg.AsyncConnection[Any]) -> None:
    assert await published_schema(conn, PUBS) == {"tables": [], "indexes": []}


def test_replica_identity_columns_keep_an_existing_key_in_place() -> None:
    raw: dict[str, Any] = {
        "tables": [
            {
                "oid": 1,
                "schema": "public",
                "name": "t",
                "replicaIdentity": "d",
                "replicaIdentityColumns": ["stale"],
                "columns": {"id": {"pos": 1, "dataType": "int4", "typeOID": 23}},
                "primaryKey": ["id"],
                "publications": {},
            }
        ],
        "indexes": [],
    }

    (t,) = with_replica_identity_columns(raw)["tables"]

    assert t["replicaIdentityColumns"] == ["id"]
    assert list(t).index("replicaIdentityColumns") == 4
