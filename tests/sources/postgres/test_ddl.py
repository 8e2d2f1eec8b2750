"""DDL capture end to end (spec/source.md §5.5, §1.6): real DDL on a real Postgres fires
the shard's event triggers, the emitted logical messages are read back through a
``test_decoding`` slot, and :class:`DdlEventProcessor` turns them into schema changes.

Each test gets its own scratch database (conftest) (shard ``hpb_0``, default publication over
schema public) and slot, both dropped afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from app.protocol import canonical_json
from app.sources.postgres.ddl import DdlError, DdlEventProcessor
from app.sources.postgres.published import published_schema
from app.sources.postgres.shard import ShardConfig, setup_shard

CFG = ShardConfig("hpb", 0)
PUBS = ["_hpb_metadata_0", "_hpb_public_0"]
PREFIX = "hpb/0/ddl"


class Upstream:
    """The test database, its shard, and a test_decoding slot collecting DDL events."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], slot: str) -> None:
        self.conn = conn
        self.slot = slot

    async def events(self) -> list[dict[str, Any]]:
        cur = await self.conn.execute(
            "SELECT data FROM pg_logical_slot_get_changes(%s, NULL, NULL)", [self.slot]
        )
        found = []
        for (data,) in await cur.fetchall():
            # "message: transactional: 1 prefix: hpb/0/ddl, sz: 123 content:{...}"
            if data.startswith("message:") and f"prefix: {PREFIX}," in data:
                assert "transactional: 1" in data
                found.append(canonical_json.loads(data.split(" content:", 1)[1]))
        return found

    async def run(self, statements: str) -> list[dict[str, Any]]:
        """Run ``statements`` in one transaction; the schema changes they replicate as."""
        await self.events()  # drain anything earlier
        async with self.conn.transaction():
            await self.conn.execute(statements.encode())
        processor = DdlEventProcessor()
        changes: list[dict[str, Any]] = []
        for event in await self.events():
            changes.extend(processor.process(event))
        return changes


@pytest.fixture
async def upstream(db_url: str) -> AsyncIterator[Upstream]:
    slot = f"hpb_ddl_{uuid.uuid4().hex[:10]}"
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await setup_shard(conn, CFG)
        await conn.execute("SET lock_timeout = '20s'")  # bound the wait for running xacts
        await conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", [slot])
        yield Upstream(conn, slot)


def tags(changes: list[dict[str, Any]]) -> list[str]:
    return [c["tag"] for c in changes]


async def test_create_table_sends_the_published_spec_and_its_primary_key_index(
    upstream: Upstream,
) -> None:
    changes = await upstream.run("CREATE TABLE foo (id int PRIMARY KEY, v text NOT NULL)")

    assert tags(changes) == ["create-table", "create-index"]
    create, index = changes
    assert list(create) == ["tag", "spec", "metadata"]  # a CREATE needs no backfill
    schema = await published_schema(upstream.conn, PUBS)
    (spec,) = [t for t in schema["tables"] if t["name"] == "foo"]
    assert create["spec"] == spec
    assert list(create["spec"]) == list(spec)
    assert create["metadata"] == {
        "schemaOID": spec["schemaOID"],
        "relationOID": spec["oid"],
        "rowKey": {"id": {"attNum": 1}},
    }
    assert index == {
        "tag": "create-index",
        "spec": {
            "schema": "public",
            "tableName": "foo",
            "name": "foo_pkey",
            "unique": True,
            "isPrimaryKey": True,
            "isReplicaIdentity": False,
            "isImmediate": True,
            "columns": {"id": "ASC"},
        },
    }


async def test_statements_of_one_transaction_arrive_in_order(upstream: Upstream) -> None:
    changes = await upstream.run(
        "CREATE TABLE foo (id int PRIMARY KEY, v text); CREATE INDEX foo_v ON foo (v);"
        "ALTER TABLE foo RENAME TO bar"
    )

    assert tags(changes) == ["create-table", "create-index", "create-index", "rename-table"]
    assert [c["spec"]["name"] for c in changes[1:3]] == ["foo_pkey", "foo_v"]


async def test_rename_table(upstream: Upstream) -> None:
    await upstream.run("CREATE TABLE foo (id int PRIMARY KEY)")

    changes = await upstream.run("ALTER TABLE foo RENAME TO bar")

    assert changes == [
        {
            "tag": "rename-table",
            "old": {"schema": "public", "name": "foo"},
            "new": {"schema": "public", "name": "bar"},
        }
    ]


async def test_add_column_with_a_constant_default_needs_no_backfill(upstream: Upstream) -> None:
    await upstream.run("CREATE TABLE foo (id int PRIMARY KEY)")

    (add,) = await upstream.run("ALTER TABLE foo ADD COLUMN v text DEFAULT 'x'")

    assert list(add) == ["tag", "table", "column", "tableMetadata"]
    assert add["table"] == {"schema": "public", "name": "foo"}
    assert add["column"]["name"] == "v"
    assert add["column"]["spec"]["dflt"] == "'x'::text"
    assert add["column"]["spec"]["pos"] == 2
    assert add["tableMetadata"]["rowKey"] == {"id": {"attNum": 1}}


async def test_add_column_with_a_computed_default_is_backfilled(upstream: Upstream) -> None:
    await upstream.run("CREATE TABLE foo (id int PRIMARY KEY)")

    (add,) = await upstream.run("ALTER TABLE foo ADD COLUMN at timestamptz DEFAULT now()")

    assert add["backfill"] == {"attNum": 2}
    assert add["column"]["spec"]["dflt"] is None
    assert list(add) == ["tag", "table", "column", "tableMetadata", "backfill"]


async def test_alter_column_type(upstream: Upstream) -> None:
    await upstream.run("CREATE TABLE foo (id int PRIMARY KEY, n int)")

    (update,) = await upstream.run("ALTER TABLE foo ALTER COLUMN n TYPE bigint")

    assert update["tag"] == "update-column"
    assert update["table"] == {"schema": "public", "name": "foo"}
    assert (update["old"]["name"], update["old"]["spec"]["dataType"]) == ("n", "int4")
    assert (update["new"]["name"], update["new"]["spec"]["dataType"]) == ("n", "int8")
    assert update["new"]["spec"]["typeOID"] == 20


async def test_rename_column_keeps_its_index(upstream: Upstream) -> None:
    await upstream.run("CREATE TABLE foo (id int PRIMARY KEY, v text)")

    changes = await upstream.run("ALTER TABLE foo RENAME COLUMN id TO key")

    # The primary key index was not rebuilt: its column only has a new name.
    assert tags(changes) == ["update-table-metadata", "update-column"]
    metadata, update = changes
    assert metadata["old"]["rowKey"] == {"id": {"attNum": 1}}
    assert metadata["new"]["rowKey"] == {"key": {"attNum": 1}}
    assert (update["old"]["name"], update["new"]["name"]) == ("id", "key")
    assert update["old"]["spec"] == update["new"]["spec"]


async def test_drop_column(upstream: Upstream) -> None:
    await upstream.run("CREATE TABLE foo (id int PRIMARY KEY, v text)")

    changes = await upstream.run("ALTER TABLE foo DROP COLUMN v")

    assert changes == [
        {"tag": "drop-column", "table": {"schema": "public", "name": "foo"}, "column": "v"}
    ]


async def test_drop_table_drops_its_indexes_first(upstream: Upstream) -> None:
    await upstream.run("CREATE TABLE foo (id int PRIMARY KEY)")

    changes = await upstream.run("DROP TABLE foo")

    assert changes == [
        {"tag": "drop-index", "id": {"schema": "public", "name": "foo_pkey"}},
        {"tag": "drop-table", "id": {"schema": "public", "name": "foo"}},
    ]


async def test_create_and_drop_index(upstream: Upstream) -> None:
    await upstream.run("CREATE TABLE foo (id int PRIMARY KEY, a int, b int)")

    created = await upstream.run("CREATE UNIQUE INDEX foo_ab ON foo (b DESC, a)")
    dropped = await upstream.run("DROP INDEX foo_ab")

    assert tags(created) == ["create-index"]
    assert created[0]["spec"]["columns"] == {"b": "DESC", "a": "ASC"}
    assert created[0]["spec"]["unique"] is True
    assert dropped == [{"tag": "drop-index", "id": {"schema": "public", "name": "foo_ab"}}]


async def test_replica_identity_change_updates_the_table_metadata(upstream: Upstream) -> None:
    await upstream.run(
        "CREATE TABLE nopk (a int NOT NULL, b text); CREATE UNIQUE INDEX nopk_a ON nopk (a)"
    )

    changes = await upstream.run("ALTER TABLE nopk REPLICA IDENTITY USING INDEX nopk_a")

    # The index's isReplicaIdentity flag changed, so it is re-created around the update.
    assert tags(changes) == ["drop-index", "update-table-metadata", "create-index"]
    metadata = changes[1]
    assert list(metadata) == ["tag", "table", "old", "new"]
    assert metadata["table"] == {"schema": "public", "name": "nopk"}
    assert metadata["old"]["rowKey"] == {}
    assert metadata["new"]["rowKey"] == {"a": {"attNum": 1}}
    assert metadata["old"]["relationOID"] == metadata["new"]["relationOID"]
    assert changes[2]["spec"]["isReplicaIdentity"] is True


async def test_table_added_to_the_publication_is_backfilled(upstream: Upstream) -> None:
    # Not published yet: the statements replicate as nothing.
    assert (
        await upstream.run("CREATE SCHEMA other; CREATE TABLE other.t (id int PRIMARY KEY, v text)")
        == []
    )

    changes = await upstream.run("ALTER PUBLICATION _hpb_public_0 ADD TABLES IN SCHEMA other")

    assert tags(changes) == ["create-table", "create-index", "truncate"]
    create, _, truncate = changes
    assert create["spec"]["schema"] == "other"
    # It arrives with rows: every column is filled from upstream.
    assert create["backfill"] == {"id": {"attNum": 1}, "v": {"attNum": 2}}
    # A truncate of the still empty, hidden table: the table-wide entry zero-cache's
    # view-syncers need to learn of it before its rows stream (ddl.py).
    assert truncate == {
        "tag": "truncate",
        "relations": [
            {
                "tag": "relation",
                "relationOid": create["spec"]["oid"],
                "schema": "other",
                "name": "t",
                "rowKey": {"columns": ["id"], "type": "default"},
                "keyColumns": ["id"],
                "replicaIdentity": "default",
            }
        ],
        "cascade": False,
        "restartIdentity": False,
    }


async def test_manual_snapshot_replicates_what_the_triggers_missed(upstream: Upstream) -> None:
    await upstream.conn.execute(
        "ALTER EVENT TRIGGER hpb_ddl_start_0 DISABLE; ALTER EVENT TRIGGER hpb_ddl_end_0 DISABLE"
    )
    await upstream.conn.execute("CREATE TABLE foo (id int PRIMARY KEY)")
    assert await upstream.events() == []

    changes = await upstream.run("SELECT hpb_0.update_schemas()")

    assert tags(changes) == ["create-table", "create-index", "truncate"]
    assert changes[0]["backfill"] == {"id": {"attNum": 1}}  # tag UNKNOWN: backfill


async def test_reserved_column_cannot_be_replicated(upstream: Upstream) -> None:
    await upstream.run("CREATE TABLE foo (id int PRIMARY KEY)")

    with pytest.raises(DdlError, match=r"Resync the replica.*_0_version") as e:
        await upstream.run('ALTER TABLE foo ADD COLUMN "_0_version" text')
    assert e.value.event is not None
    assert e.value.event["type"] == "ddlUpdate"


# --- the processor on hand-made events ------------------------------------------------


def event(
    kind: str, tag: str, schema: dict[str, Any] | None, previous: Any = ..., version: int = 1
) -> dict[str, Any]:
    e: dict[str, Any] = {"type": kind, "version": version, "event": {"tag": tag}}
    e["context"] = {"query": "..."}
    if schema is not None:
        e["schema"] = schema
    if previous is not ...:
        e["previousSchema"] = previous
    return e


def one_table(columns: dict[str, Any]) -> dict[str, Any]:
    return {
        "tables": [
            {
                "oid": 10,
                "schema": "public",
                "schemaOID": 2200,
                "name": "t",
                "replicaIdentity": "d",
                "columns": columns,
                "primaryKey": ["id"],
                "publications": {"p": {"rowFilter": None}},
            }
        ],
        "indexes": [],
    }


ID = {"pos": 1, "dflt": None, "notNull": True, "typeOID": 23, "dataType": "int4"}
V = {"pos": 2, "dflt": "now()", "notNull": False, "typeOID": 1184, "dataType": "timestamptz"}


def test_unknown_event_types_are_ignored() -> None:
    processor = DdlEventProcessor()
    assert processor.process({"type": "ddlFuture", "version": 9}) == []


def test_unsupported_protocol_version_is_an_error() -> None:
    with pytest.raises(DdlError, match="version"):
        DdlEventProcessor().process(event("ddlUpdate", "ALTER TABLE", one_table({}), None, 3))


def test_nested_start_gives_the_command_tag() -> None:
    processor = DdlEventProcessor()
    before, after = one_table({"id": ID}), one_table({"id": ID, "v": V})
    # Context-only start (protocol v2), then a start whose own statement changed the schema.
    assert processor.process(event("ddlStart", "ALTER TABLE", None, version=2)) == []
    (add,) = processor.process(event("ddlStart", "CREATE INDEX", after, before))

    # The tag is the outer ALTER TABLE's, and now() cannot be applied by the replica.
    assert add["backfill"] == {"attNum": 2}
    assert add["column"]["spec"]["dflt"] is None
    assert V["dflt"] == "now()"  # the event itself was not modified


def test_event_without_previous_schema_diffs_against_the_previous_event() -> None:
    processor = DdlEventProcessor()
    before, after = one_table({"id": ID}), one_table({"id": ID, "v": {**V, "dflt": "1"}})
    assert processor.process(event("ddlStart", "ALTER TABLE", before, None)) == []

    (add,) = processor.process(event("ddlUpdate", "ALTER TABLE", after))

    assert "backfill" not in add
    assert add["column"]["spec"]["dflt"] == "1"


@pytest.mark.parametrize(
    ("dflt", "in_place"),
    [
        ("'it''s'::text", True),
        # Several literals that zero's "('.*')::(\w+)" took for one (issue 25): the
        # replica's rule (app.replica.ddl.map_default) refuses it, so it is backfilled.
        ("'x' CHECK (0) COLLATE 'binary'::text", False),
    ],
)
def test_an_added_column_keeps_its_default_only_if_the_replica_accepts_it(
    dflt: str, in_place: bool
) -> None:
    processor = DdlEventProcessor()
    text = {**V, "dflt": dflt, "typeOID": 25, "dataType": "text"}
    before, after = one_table({"id": ID}), one_table({"id": ID, "v": text})
    assert processor.process(event("ddlStart", "ALTER TABLE", before, None)) == []

    (add,) = processor.process(event("ddlUpdate", "ALTER TABLE", after))

    assert ("backfill" not in add) is in_place
    assert add["column"]["spec"]["dflt"] == (dflt if in_place else None)


def test_first_event_without_anything_to_diff_against_is_nothing() -> None:
    assert (
        DdlEventProcessor().process(event("ddlUpdate", "ALTER TABLE", one_table({"id": ID}))) == []
    )


@pytest.mark.parametrize(
    "broken",
    [
        {"type": "ddlUpdate", "version": 1, "event": {"tag": "X"}, "schema": {"tables": []}},
        {"type": "ddlUpdate", "version": 1, "context": {"query": "q"}, "schema": {}},
        {"type": "ddlUpdate", "version": 1, "context": {"query": "q"}, "event": {"tag": "X"}},
    ],
)
def test_malformed_events_are_errors(broken: dict[str, Any]) -> None:
    with pytest.raises(DdlError):
        DdlEventProcessor().process(broken)


def test_identical_schemas_give_no_changes() -> None:
    schema = one_table({"id": ID, "v": V})
    assert DdlEventProcessor().process(event("schemaSnapshot", "COMMENT", schema, schema)) == []
