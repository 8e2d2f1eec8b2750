"""DDL capture: the upstream trigger functions, and DDL events → schema changes.

Upstream side (spec/source.md §5.5): per shard, functions in ``{app}_{shard}`` and two
event triggers ``{app}_ddl_start_{shard}`` / ``{app}_ddl_end_{shard}``. Each relevant DDL
statement recomputes the published schema (the query of :mod:`published`), compares
it with ``publishedSchema.current`` and emits an event with the previous and the new
schema as a transactional logical message ``{app}/{shard}/ddl``, so it arrives inside
the DDL's transaction, in statement order. The start trigger also takes an advisory
lock so concurrent DDL is serialized and every diff is against the right schema.

Stream side: :class:`DdlEventProcessor` turns the sequence of those events into the
schema changes of §1.6, field for field what the reference emits, because replicas
built for the reference apply them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Final, TypeVar

from psycopg import sql as pgsql

from app.replica.ddl import map_default
from app.replica.errors import UnsupportedColumnDefaultError
from app.sources.postgres.errors import DdlError
from app.sources.postgres.published import (
    IndexSpec,
    PublishedSchema,
    TableSpec,
    published_schema_query,
    quote_literal,
    validate_table,
    with_replica_identity_columns,
)

__all__ = [
    "DDL_PROTOCOL_VERSION",
    "DDL_SERIALIZATION_LOCK",
    "DDL_TAGS",
    "DdlError",
    "DdlEventProcessor",
    "ddl_message_prefix",
    "drop_event_triggers_sql",
    "event_functions_sql",
    "event_triggers_sql",
]

log = logging.getLogger(__name__)

_K = TypeVar("_K")

# The "version" of the events our trigger emits; 2 (context-only ddlStart) is accepted.
DDL_PROTOCOL_VERSION: Final = 1
# Tuples, not sets: an event's fields are any JSON, and a list is no member of a tuple
# where it is unhashable (TypeError) for a set.
_ACCEPTED_VERSIONS: Final = (1, 2)

# pg_advisory_xact_lock key that serializes DDL statements (the reference's value, so
# our triggers and a reference shard on the same database serialize together).
DDL_SERIALIZATION_LOCK: Final = 0x3C6B8468F1BAC0B0

DDL_TAGS: Final = (
    "CREATE TABLE",
    "ALTER TABLE",
    "CREATE INDEX",
    "DROP TABLE",
    "DROP INDEX",
    "ALTER PUBLICATION",
    "ALTER SCHEMA",
)

_EVENT_TYPES: Final = ("ddlStart", "ddlUpdate", "schemaSnapshot")  # a tuple: see above


def _ident(name: str) -> str:
    return pgsql.Identifier(name).as_string()


def ddl_message_prefix(app_id: str, shard_num: int) -> str:
    """The logical-message prefix of DDL events (the stream also accepts ``{app}/{shard}``)."""
    return f"{app_id}/{shard_num}/ddl"


# --- upstream SQL ----------------------------------------------------------------------


def event_functions_sql(app_id: str, shard_num: int, publications: Iterable[str]) -> str:
    """Functions (and the ``publishedSchema`` table) the event triggers call.

    Installed even when event triggers cannot be created, so an operator can still run
    ``SELECT {app}_{shard}.update_schemas()`` by hand after a schema change.
    """
    pubs = list(publications)
    schema = _ident(f"{app_id}_{shard_num}")
    shard = f"{app_id}_{shard_num}"
    prefix = ddl_message_prefix(app_id, shard_num)
    pub_array = ", ".join(quote_literal(p) for p in pubs)
    return f"""
CREATE SCHEMA IF NOT EXISTS {schema};

CREATE OR REPLACE FUNCTION {schema}.get_trigger_context()
RETURNS record AS $$
DECLARE
  result record;
BEGIN
  SELECT COALESCE(current_query(), 'current_query() returned NULL') AS "query" into result;
  RETURN result;
END
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION {schema}.notice_ignore(reason TEXT, tag TEXT, target record)
RETURNS void AS $$
BEGIN
  RAISE NOTICE '{shard} ignoring % % %', reason, tag,
    COALESCE(row_to_json(target)::text, '');
END
$$ LANGUAGE plpgsql;

-- DROP first: older versions of this function had another return type.
DROP FUNCTION IF EXISTS {schema}.schema_specs();
CREATE FUNCTION {schema}.schema_specs()
RETURNS JSON
STABLE
AS $$
  {published_schema_query(pubs)}
$$ LANGUAGE sql;

-- The most recently published schema, the "previous" side of the next diff.
CREATE TABLE IF NOT EXISTS {schema}."publishedSchema" (
  current JSON,
  exists BOOL PRIMARY KEY DEFAULT true CHECK (exists)
);

INSERT INTO {schema}."publishedSchema" (current) VALUES ({schema}.schema_specs())
  ON CONFLICT (exists) DO
  UPDATE SET current = excluded.current;

CREATE OR REPLACE FUNCTION {schema}.update_schemas(event_type text, tag text, target record)
RETURNS void AS $$
DECLARE
  prev_schema_specs JSON;
  schema_specs JSON;
  message TEXT;
BEGIN
  SELECT current FROM {schema}."publishedSchema" INTO prev_schema_specs;
  SELECT {schema}.schema_specs() INTO schema_specs;

  IF prev_schema_specs::text != schema_specs::text THEN
    UPDATE {schema}."publishedSchema" SET current = schema_specs;
  ELSIF event_type = 'ddlStart' THEN
    -- Always emitted: the stream needs the command tag of nested triggers.
    prev_schema_specs = NULL;
  ELSIF event_type = 'ddlUpdate' THEN
    PERFORM {schema}.notice_ignore('noop', tag, target);
    RETURN;
  END IF;

  SELECT json_build_object(
    'type', event_type,
    'version', {DDL_PROTOCOL_VERSION},
    'previousSchema', prev_schema_specs,
    'schema', schema_specs,
    'event', json_build_object('tag', tag),
    'context', {schema}.get_trigger_context()
  ) INTO message;

  PERFORM pg_logical_emit_message(true, {quote_literal(prefix)}, message);

  RAISE NOTICE 'Emitted {shard} % for % %', event_type, tag,
    COALESCE(row_to_json(target)::text, '');
END
$$ LANGUAGE plpgsql;

-- Manual hook for hosts without event trigger support.
CREATE OR REPLACE FUNCTION {schema}.update_schemas()
RETURNS void AS $$
BEGIN
  PERFORM {schema}.update_schemas('schemaSnapshot', 'MANUAL', NULL);
END
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION {schema}.emit_ddl_start()
RETURNS event_trigger AS $$
BEGIN
  PERFORM pg_advisory_xact_lock({DDL_SERIALIZATION_LOCK});
  PERFORM {schema}.update_schemas('ddlStart', TG_TAG, NULL);
END
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION {schema}.emit_ddl_end()
RETURNS event_trigger AS $$
DECLARE
  publications TEXT[];
  target RECORD;
  relevant RECORD;
BEGIN
  publications := ARRAY[{pub_array}];

  SELECT objid, object_type, object_identity
    FROM pg_event_trigger_ddl_commands()
    LIMIT 1 INTO target;

  SELECT true INTO relevant;

  -- Any ALTER TABLE may take a table *out* of the published set, which cannot be
  -- told afterwards, so every ALTER TABLE is relevant (like every DROP).
  IF (target.object_type = 'table' AND TG_TAG != 'ALTER TABLE')
     OR target.object_type = 'table column' THEN
    SELECT ns.nspname AS "schema", c.relname AS "name" FROM pg_class AS c
      JOIN pg_namespace AS ns ON c.relnamespace = ns.oid
      JOIN pg_publication_tables AS pb ON pb.schemaname = ns.nspname AND pb.tablename = c.relname
      WHERE c.oid = target.objid AND pb.pubname = ANY (publications)
      INTO relevant;

  ELSIF target.object_type = 'index' THEN
    SELECT ns.nspname AS "schema", c.relname AS "name" FROM pg_class AS c
      JOIN pg_namespace AS ns ON c.relnamespace = ns.oid
      JOIN pg_indexes as ind ON ind.schemaname = ns.nspname AND ind.indexname = c.relname
      JOIN pg_publication_tables AS pb ON pb.schemaname = ns.nspname
        AND pb.tablename = ind.tablename
      WHERE c.oid = target.objid AND pb.pubname = ANY (publications)
      INTO relevant;

  ELSIF target.object_type = 'publication relation' THEN
    SELECT pb.pubname FROM pg_publication_rel AS rel
      JOIN pg_publication AS pb ON pb.oid = rel.prpubid
      WHERE rel.oid = target.objid AND pb.pubname = ANY (publications)
      INTO relevant;

  ELSIF target.object_type = 'publication namespace' THEN
    SELECT pb.pubname FROM pg_publication_namespace AS ns
      JOIN pg_publication AS pb ON pb.oid = ns.pnpubid
      WHERE ns.oid = target.objid AND pb.pubname = ANY (publications)
      INTO relevant;

  ELSIF target.object_type = 'schema' THEN
    SELECT ns.nspname AS "schema", c.relname AS "name" FROM pg_class AS c
      JOIN pg_namespace AS ns ON c.relnamespace = ns.oid
      JOIN pg_publication_tables AS pb ON pb.schemaname = ns.nspname AND pb.tablename = c.relname
      WHERE ns.oid = target.objid AND pb.pubname = ANY (publications)
      INTO relevant;

  ELSIF target.object_type = 'publication' THEN
    SELECT 1 WHERE target.object_identity = ANY (publications)
      INTO relevant;

  -- a CREATE ... IF NOT EXISTS that did nothing
  ELSIF TG_TAG LIKE 'CREATE %' AND target.object_type IS NULL THEN
    relevant := NULL;
  END IF;

  IF relevant IS NULL THEN
    PERFORM {schema}.notice_ignore('irrelevant', TG_TAG, target);
    RETURN;
  END IF;

  IF TG_TAG = 'COMMENT' THEN
    -- Only COMMENT ON PUBLICATION is a hook (for hosts that do not fire event
    -- triggers on ALTER PUBLICATION).
    IF target.object_type != 'publication' THEN
      PERFORM {schema}.notice_ignore('irrelevant', TG_TAG, target);
      RETURN;
    END IF;
    PERFORM {schema}.update_schemas('schemaSnapshot', TG_TAG, target);
  ELSE
    PERFORM {schema}.update_schemas('ddlUpdate', TG_TAG, target);
  END IF;
END
$$ LANGUAGE plpgsql;
"""


def drop_event_triggers_sql(app_id: str, shard_num: int) -> str:
    return (
        f"DROP EVENT TRIGGER IF EXISTS {_ident(f'{app_id}_ddl_start_{shard_num}')};\n"
        f"DROP EVENT TRIGGER IF EXISTS {_ident(f'{app_id}_ddl_end_{shard_num}')};\n"
    )


def event_triggers_sql(app_id: str, shard_num: int) -> str:
    """(Re)create the two event triggers. Needs superuser-like rights (else 42501)."""
    schema = _ident(f"{app_id}_{shard_num}")
    start_tags = ", ".join(quote_literal(t) for t in DDL_TAGS)
    end_tags = ", ".join(quote_literal(t) for t in (*DDL_TAGS, "COMMENT"))
    # Event trigger names are database-wide, hence app and shard in the name.
    return (
        drop_event_triggers_sql(app_id, shard_num)
        + f"""
CREATE EVENT TRIGGER {_ident(f"{app_id}_ddl_start_{shard_num}")}
  ON ddl_command_start
  WHEN TAG IN ({start_tags})
  EXECUTE PROCEDURE {schema}.emit_ddl_start();

CREATE EVENT TRIGGER {_ident(f"{app_id}_ddl_end_{shard_num}")}
  ON ddl_command_end
  WHEN TAG IN ({end_tags})
  EXECUTE PROCEDURE {schema}.emit_ddl_end();
"""
    )


# --- events → schema changes ------------------------------------------------------------


class DdlEventProcessor:
    """Turns one stream's DDL events, in order, into schema-change dicts (spec §5.5).

    Stateful: an event is read in the context of the previous one (its schema, when an
    old trigger sent no ``previousSchema``, and its command tag, for nested triggers).
    Use one instance per replication stream.
    """

    def __init__(self) -> None:
        self._last: dict[str, Any] | None = None

    def process(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """The schema changes for ``event`` (often none); :class:`DdlError` if unreplicable."""
        event_type = event.get("type") if isinstance(event, dict) else None
        if event_type not in _EVENT_TYPES:
            # Forward compatible: newer triggers may send types we do not know.
            log.info("ignoring unknown ddl message type: %r", event_type)
            return []
        parsed = _parse_event(event)
        previous = self._last
        self._last = parsed

        schema = parsed.get("schema")
        if schema is None:  # context-only (protocol v2) ddlStart
            return []
        if "previousSchema" in parsed:
            prev_schema = parsed["previousSchema"]
        else:  # older triggers: diff against the previous event's schema
            prev_schema = previous.get("schema") if previous is not None else None
        if not prev_schema:
            return []

        # The tag decides backfills. Triggers nest (start, start, end, start, end, end):
        # after a ddlStart its tag is the command's; a ddlUpdate carries its own;
        # anything else is UNKNOWN, which backfills conservatively.
        if previous is not None and previous["type"] == "ddlStart":
            tag = previous["event"]["tag"]
        elif parsed["type"] == "ddlUpdate":
            tag = parsed["event"]["tag"]
        else:
            tag = "UNKNOWN"
        try:
            return _schema_changes(prev_schema, schema, tag)
        except DdlError:
            raise
        except Exception as e:
            raise DdlError(str(e), event) from e


def _parse_event(event: dict[str, Any]) -> dict[str, Any]:
    """Check the fields the diff relies on; normalize the schemas (replica identity columns)."""
    version = event.get("version")
    if version not in _ACCEPTED_VERSIONS:
        raise DdlError(f"unsupported ddl event version {version!r}", event)
    context = event.get("context")
    if not isinstance(context, dict) or not isinstance(context.get("query"), str):
        raise DdlError("ddl event without context.query", event)
    parsed = dict(event)
    tag_holder = event.get("event")
    if tag_holder is None and event["type"] == "ddlStart":
        parsed["event"] = {"tag": "UNKNOWN"}  # triggers before 1.4.0 sent no tag
    elif not isinstance(tag_holder, dict) or not isinstance(tag_holder.get("tag"), str):
        raise DdlError("ddl event without event.tag", event)
    try:
        if "schema" in event:
            if event["schema"] is None:
                raise ValueError("schema is null")
            parsed["schema"] = with_replica_identity_columns(event["schema"])
        elif event["type"] != "ddlStart":
            raise ValueError(f"{event['type']} event without schema")
        if "previousSchema" in event and event["previousSchema"] is not None:
            parsed["previousSchema"] = with_replica_identity_columns(event["previousSchema"])
        elif "previousSchema" in event and event["type"] != "ddlStart":
            raise ValueError(f"{event['type']} event with a null previousSchema")
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # e.g. a table not an object
        raise DdlError(f"invalid ddl event: {e}", event) from e
    return parsed


# The diff. Order (spec §5.5): drop indexes, drop tables, alter kept tables (rename,
# metadata, drop/alter/add columns), create tables, create indexes. SQLite refuses
# to drop a column an index uses, so indexes go first and come back last.
#
# Iteration orders follow the reference so the same DDL yields the same list:
# dropped = in the old schema's order, created = in the new one's, and kept items in
# the order of whichever side has fewer (the reference intersects by walking the
# smaller set).


def _schema_changes(prev: PublishedSchema, nxt: PublishedSchema, tag: str) -> list[dict[str, Any]]:
    prev_tables = {t["oid"]: t for t in prev["tables"]}
    next_tables = {t["oid"]: t for t in nxt["tables"]}
    prev_indexes = {_index_id(i): i for i in prev["indexes"]}
    next_indexes = {_index_id(i): i for i in nxt["indexes"]}

    for table in next_tables.values():
        validate_table(table)

    dropped_idx = [k for k in prev_indexes if k not in next_indexes]
    created_idx = [k for k in next_indexes if k not in prev_indexes]
    for k in _intersection(prev_indexes, next_indexes):
        # Same name, different definition (e.g. a constraint dropped and re-added in
        # one ALTER TABLE). Renames alone do not count: columns compare by attnum.
        if _index_changed(prev_indexes[k], next_indexes[k], prev_tables, next_tables):
            dropped_idx.append(k)
            created_idx.append(k)

    changes: list[dict[str, Any]] = []
    hidden: list[TableSpec] = []  # tables that arrive with every column backfilling
    for k in dropped_idx:
        index = prev_indexes[k]
        changes.append(
            {"tag": "drop-index", "id": {"schema": index["schema"], "name": index["name"]}}
        )
    for oid in prev_tables:
        if oid not in next_tables:
            table = prev_tables[oid]
            changes.append(
                {"tag": "drop-table", "id": {"schema": table["schema"], "name": table["name"]}}
            )
    for oid in _intersection(prev_tables, next_tables):
        changes.extend(_table_changes(prev_tables[oid], next_tables[oid], tag))
    for oid in next_tables:
        if oid in prev_tables:
            continue
        spec = next_tables[oid]
        create: dict[str, Any] = {"tag": "create-table", "spec": spec, "metadata": _metadata(spec)}
        # Only a CREATE brings a table in empty; one that appears through ALTER
        # PUBLICATION, a COMMENT hook or a manual snapshot already has rows.
        if not tag.startswith("CREATE"):
            create["backfill"] = {
                name: {"attNum": col["pos"]} for name, col in spec["columns"].items()
            }
            hidden.append(spec)
        changes.append(create)
    for k in created_idx:
        changes.append({"tag": "create-index", "spec": next_indexes[k]})
    # A table that arrives hidden (every column backfilling) gets a truncate of its
    # (empty) replica table right away. It changes no data, but it gives zero-cache
    # 1.9.0's replica change log a table-wide entry, so its view-syncers reset their
    # pipelines and learn the table before any row of it streams; without one, a
    # row written upstream during the backfill stops them with "change for unknown
    # table" (zero-cache's bug, which its own Postgres source triggers too).
    for spec in hidden:
        changes.append(
            {
                "tag": "truncate",
                "relations": [
                    relation_object(
                        spec["oid"],
                        spec["schema"],
                        spec["name"],
                        spec["replicaIdentityColumns"],
                        spec.get("replicaIdentity", "d"),
                    )
                ],
                "cascade": False,
                "restartIdentity": False,
            }
        )
    return changes


IDENTITY_NAMES: Final = {"d": "default", "n": "nothing", "f": "full", "i": "index"}


def relation_object(
    oid: int, schema: str, name: str, key_columns: list[str], identity: str
) -> dict[str, Any]:
    """A row change's ``relation``, as the reference's Postgres source sends it: both the
    v5 form (``rowKey``) and the deprecated one; ``identity`` is pg_class's letter;
    OIDs ≥ 2^31 read as signed."""
    kind = IDENTITY_NAMES.get(identity)
    if kind is None:
        raise DdlError(f"unknown replica identity {identity!r} of {name}")
    return {
        "tag": "relation",
        "relationOid": oid - (1 << 32) if oid >= (1 << 31) else oid,
        "schema": schema,
        "name": name,
        "rowKey": {"columns": list(key_columns), "type": kind},
        "keyColumns": list(key_columns),
        "replicaIdentity": kind,
    }


def _table_changes(old: TableSpec, new: TableSpec, tag: str) -> list[dict[str, Any]]:
    changes: list[dict[str, Any]] = []
    if old["schema"] != new["schema"] or old["name"] != new["name"]:
        changes.append(
            {
                "tag": "rename-table",
                "old": {"schema": old["schema"], "name": old["name"]},
                "new": {"schema": new["schema"], "name": new["name"]},
            }
        )
    old_md, new_md = _metadata(old), _metadata(new)
    if old_md != new_md:
        changes.append(
            {
                "tag": "update-table-metadata",
                "table": {"schema": new["schema"], "name": new["name"]},
                "old": old_md,
                "new": new_md,
            }
        )
    table = {"schema": new["schema"], "name": new["name"]}
    # attnum is a column's stable identity: never reused, unchanged by renames.
    old_cols = {spec["pos"]: (name, spec) for name, spec in old["columns"].items()}
    new_cols = {spec["pos"]: (name, spec) for name, spec in new["columns"].items()}

    for pos, (name, _spec) in old_cols.items():
        if pos not in new_cols:
            changes.append({"tag": "drop-column", "table": table, "column": name})
    for pos in _intersection(old_cols, new_cols):
        old_name, old_spec = old_cols[pos]
        new_name, new_spec = new_cols[pos]
        # Only name, type and nullability matter to the replica.
        if (
            old_name != new_name
            or old_spec.get("dataType") != new_spec.get("dataType")
            or old_spec.get("notNull") != new_spec.get("notNull")
        ):
            changes.append(
                {
                    "tag": "update-column",
                    "table": table,
                    "old": {"name": old_name, "spec": dict(old_spec)},
                    "new": {"name": new_name, "spec": dict(new_spec)},
                }
            )
    # A column added by ALTER TABLE holds its default in every existing row, so it
    # needs no backfill if the replica can apply that default; columns that appear
    # any other way (ALTER PUBLICATION, hooks, UNKNOWN) must be backfilled.
    always_backfill = tag != "ALTER TABLE"
    for pos, (name, spec) in new_cols.items():
        if pos in old_cols:
            continue
        column_spec: dict[str, Any] = dict(spec)
        add: dict[str, Any] = {
            "tag": "add-column",
            "table": table,
            "column": {"name": name, "spec": column_spec},
            "tableMetadata": _metadata(new),
        }
        if always_backfill or not _replicable_default(column_spec.get("dflt")):
            column_spec["dflt"] = None
            add["backfill"] = {"attNum": spec["pos"]}
        changes.append(add)
    return changes


def _metadata(table: TableSpec) -> dict[str, Any]:
    if table.get("schemaOID") is None:
        raise ValueError(f"table {table['schema']}.{table['name']} has no schemaOID")
    return {
        "schemaOID": table["schemaOID"],
        "relationOID": table["oid"],
        "rowKey": {
            col: {"attNum": table["columns"][col]["pos"]} for col in table["replicaIdentityColumns"]
        },
    }


def _index_id(index: IndexSpec) -> str:
    return f"{index['schema']}.{index['name']}"


def _intersection(a: dict[_K, Any], b: dict[_K, Any]) -> list[_K]:
    small, large = (b, a) if len(a) > len(b) else (a, b)
    return [k for k in small if k in large]


def _index_changed(
    prev: IndexSpec,
    nxt: IndexSpec,
    prev_tables: dict[int, TableSpec],
    next_tables: dict[int, TableSpec],
) -> bool:
    for flag in ("unique", "isPrimaryKey", "isReplicaIdentity", "isImmediate"):
        if prev.get(flag) != nxt.get(flag):
            return True
    prev_table = _find_table(prev_tables, prev["schema"], prev["tableName"])
    next_table = _find_table(next_tables, nxt["schema"], nxt["tableName"])
    if prev_table is None or next_table is None:
        return True  # cannot resolve: treat as changed
    if len(prev["columns"]) != len(nxt["columns"]):
        return True
    prev_dirs = _dirs_by_attnum(prev, prev_table)
    next_dirs = _dirs_by_attnum(nxt, next_table)
    if prev_dirs is None or next_dirs is None:
        return True
    return prev_dirs != next_dirs


def _dirs_by_attnum(index: IndexSpec, table: TableSpec) -> dict[int, str] | None:
    dirs: dict[int, str] = {}
    for name, direction in index["columns"].items():
        column = table["columns"].get(name)
        if column is None:
            return None
        dirs[column["pos"]] = direction
    return dirs


def _find_table(tables: dict[int, TableSpec], schema: str, name: str) -> TableSpec | None:
    for table in tables.values():
        if table["schema"] == schema and table["name"] == name:
            return table
    return None


def _replicable_default(dflt: str | None) -> bool:
    """Whether the replica can apply this default to existing rows of a new column.

    The replica's own rule (:func:`app.replica.ddl.map_default`, a literal only);
    every other default is backfilled from upstream.
    """
    try:
        map_default("", "", dflt)
    except UnsupportedColumnDefaultError:
        return False
    return True
