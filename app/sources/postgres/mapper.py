"""pgoutput messages → change-source messages, shaped exactly as the reference emits them.

The JSON a subscriber receives from us must be byte-identical to what zero-cache's
Postgres source produces from the same database (spec/source.md §1.3–§1.6, §5.4),
so the objects here are built with the reference's keys *in the reference's order*:

* begin  ``{tag, commitLsn, commitTime, xid, json: "s"}``
* commit ``{tag, flags, commitLsn, commitEndLsn, commitTime, commitTimeMs}``
* insert ``{tag, relation, new}``; update ``{tag, relation, key, old, new}``;
  delete ``{tag, relation, key, old}``; truncate ``{tag, cascade, restartIdentity,
  relations}``
* relation ``{tag, relationOid, schema, name, rowKey: {columns, type}, keyColumns,
  replicaIdentity}`` (both the v5 and the deprecated forms; ``relationOid`` signed)

Rows: unchanged-TOAST columns are left out (filled from the old row with REPLICA
IDENTITY FULL); key tuples keep only key columns and drop NULLs; ``key`` of an update
or delete is the old row when Postgres sent one, else the key tuple.

Logical messages with the shard's DDL prefix go through the
:class:`~app.sources.postgres.ddl.DdlEventProcessor`. Anything that cannot be mapped
raises :class:`MappingError`; the stream turns that into reset-required.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app import speedups
from app.protocol import canonical_json
from app.protocol.canonical_json import JsonPieces
from app.protocol.lexi import to_lexi
from app.protocol.messages import Begin, ChangeSourceMessage, Commit, Data
from app.sources.postgres.ddl import DdlEventProcessor, relation_object
from app.sources.postgres.errors import DdlError
from app.sources.postgres.lag_reporter import MESSAGE_SUFFIX, LagReporter
from app.sources.postgres.large_values import json_string_pieces
from app.sources.postgres.pgoutput import (
    UNCHANGED_TOAST,
    Delete,
    Insert,
    LargeValue,
    LogicalMessage,
    Origin,
    PgOutputError,
    PgOutputMessage,
    Relation,
    Truncate,
    TupleData,
    TupleValue,
    TypeMessage,
    Update,
    format_lsn,
)
from app.sources.postgres.pgoutput import (
    Begin as PgBegin,
)
from app.sources.postgres.pgoutput import (
    Commit as PgCommit,
)
from app.sources.postgres.values import TypeRegistry, parser_kind

__all__ = ["ChangeMapper", "MappingError", "ShardId"]


# The common messages (row changes, Begin, Commit), decoded and mapped in one C
# call (app/sources/postgres/_pgrows.c, an optional extension; app/speedups.py
# picks). Without it every message takes decode_message() + map(), which gives the
# same messages: the C call is that path's fast twin, and hands anything unusual
# back to it.
_pgrows = speedups.module("pgrows")
if _pgrows is not None:
    _pgrows.setup(Data, UNCHANGED_TOAST, Begin, Commit)


class MappingError(Exception):
    """A message this source cannot turn into changes; replication must be reset."""

    def __init__(self, reason: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.details = details


@dataclass(frozen=True, slots=True)
class ShardId:
    app_id: str
    shard_num: int

    @property
    def message_prefix(self) -> str:
        return f"{self.app_id}/{self.shard_num}"


@dataclass(frozen=True, slots=True)
class _Rel:
    """A cached Relation with what every row of it needs, computed once."""

    source: Relation
    json: dict[str, Any]  # the relation object of the output, shared by its rows
    names: tuple[str, ...]
    parsers: tuple[Callable[[str], Any], ...]
    key_indexes: tuple[int, ...]


class ChangeMapper:
    # Set by the source when it runs lag reports: their messages become its statuses.
    lag_reports: LagReporter | None = None

    def __init__(
        self,
        shard: ShardId,
        registry: TypeRegistry,
        *,
        ddl_detection: bool = True,
        initial_schema: dict[str, Any] | None = None,
    ) -> None:
        self.registry = registry
        self._prefix = shard.message_prefix
        self._ddl = DdlEventProcessor()
        self._ddl_detection = ddl_detection
        self._initial_tables = {
            t["oid"]: t for t in (initial_schema or {}).get("tables", []) if "oid" in t
        }
        self._relations: dict[int, _Rel] = {}
        self._specs: dict[int, tuple[Any, ...]] = {}

    def needs_types(self, rel: Relation) -> bool:
        """True when a column has a type the registry has not loaded (a new user type)."""
        return any(not self.registry.knows(c.type_oid) for c in rel.columns)

    def map_common(self, buffer: bytes | memoryview, offset: int) -> Data | Begin | Commit | None:
        """The message of the common pgoutput message (Insert, Update, Delete, Begin,
        Commit) at ``buffer[offset:]`` in one C call, or None: then :meth:`map` of
        :func:`decode_message` gives it (or says what is wrong), as it does for
        every message when the C helper is not built."""
        if _pgrows is None:
            return None
        message: Data | Begin | Commit | None = _pgrows.decode(buffer, offset, self._specs)
        return message

    async def materialize(self, message: PgOutputMessage) -> PgOutputMessage:
        """``message`` with each ``LargeValue`` of its rows (``decode_chunks`` with
        ``large_over``) made ``JsonPieces``, a chunk per turn of the loop, for a text
        column, or a joined ``str`` for any other (parsed whole, see
        ``large_values``). Other messages are returned as they are."""
        if isinstance(message, Insert):
            rel = self._rel(message.relation_oid)
            return Insert(message.relation_oid, await _texts(rel, message.new))
        if isinstance(message, Update):
            rel = self._rel(message.relation_oid)
            old = None if message.old is None else await _texts(rel, message.old)
            new = await _texts(rel, message.new)
            return Update(message.relation_oid, message.old_kind, old, new)
        if isinstance(message, Delete):
            rel = self._rel(message.relation_oid)
            return Delete(message.relation_oid, message.old_kind, await _texts(rel, message.old))
        return message

    def map(self, message: PgOutputMessage) -> list[ChangeSourceMessage]:
        try:
            return self._map(message)
        except MappingError:
            raise
        except (PgOutputError, DdlError, ValueError, KeyError) as e:
            raise MappingError(f"{type(e).__name__}: {e}") from e

    def _map(self, m: PgOutputMessage) -> list[ChangeSourceMessage]:
        # Ordered by frequency: row changes dominate.
        if isinstance(m, Insert):
            rel = self._rel(m.relation_oid)
            body: dict[str, Any] = {"tag": "insert", "relation": rel.json, "new": _row(rel, m.new)}
            return [Data(body, "insert")]
        if isinstance(m, Update):
            rel = self._rel(m.relation_oid)
            old = _row(rel, m.old) if m.old_kind == "O" and m.old is not None else None
            key: dict[str, Any] | None
            if old is not None:
                key = old
            elif m.old_kind == "K" and m.old is not None:
                key = _key(rel, m.old)
            else:
                key = None
            new = _row(rel, m.new, old)
            update: dict[str, Any] = {
                "tag": "update",
                "relation": rel.json,
                "key": key,
                "old": old,
                "new": new,
            }
            return [Data(update, "update")]
        if isinstance(m, Delete):
            rel = self._rel(m.relation_oid)
            delete: dict[str, Any]
            if m.old_kind == "O":
                old = _row(rel, m.old)
                delete = {"tag": "delete", "relation": rel.json, "key": old, "old": old}
            else:
                key = _key(rel, m.old)
                delete = {"tag": "delete", "relation": rel.json, "key": key, "old": None}
            return [Data(delete, "delete")]
        if isinstance(m, PgBegin):
            lsn = format_lsn(m.final_lsn)
            begin = {
                "tag": "begin",
                "commitLsn": lsn,
                "commitTime": m.commit_time_us,
                "xid": m.xid,
                "json": "s",
            }
            return [Begin(begin, to_lexi(m.final_lsn), False)]
        if isinstance(m, PgCommit):
            commit = {
                "tag": "commit",
                "flags": m.flags,
                "commitLsn": format_lsn(m.commit_lsn),
                "commitEndLsn": format_lsn(m.end_lsn),
                "commitTime": m.commit_time_us,
                "commitTimeMs": _truncating_ms(m.commit_time_us),
            }
            return [Commit(commit, to_lexi(m.commit_lsn))]
        if isinstance(m, Relation):
            self._on_relation(m)
            return []
        if isinstance(m, Truncate):
            truncate: dict[str, Any] = {
                "tag": "truncate",
                "cascade": m.cascade,
                "restartIdentity": m.restart_identity,
                "relations": [self._rel(oid).json for oid in m.relation_oids],
            }
            return [Data(truncate, "truncate")]
        if isinstance(m, LogicalMessage):
            return self._on_message(m)
        if isinstance(m, (TypeMessage, Origin)):
            return []
        raise MappingError(f"unexpected pgoutput message {m!r}")

    # -- relations ------------------------------------------------------

    def _rel(self, oid: int) -> _Rel:
        rel = self._relations.get(oid)
        if rel is None:
            raise MappingError(f"change for relation {oid} before its Relation message")
        return rel

    def _on_relation(self, r: Relation) -> None:
        if not self._ddl_detection:
            self._check_unchanged(r)
        key_columns = [c.name for c in r.columns if c.is_key]
        try:
            relation_json = relation_object(
                r.oid, r.namespace, r.name, key_columns, r.replica_identity
            )
        except DdlError as e:
            problem = f"unknown replica identity {r.replica_identity!r} of {r.name}"
            raise MappingError(problem) from e
        names = tuple(c.name for c in r.columns)
        parsers = tuple(self.registry.parser(c.type_oid, json_as_string=True) for c in r.columns)
        key_indexes = tuple(i for i, c in enumerate(r.columns) if c.is_key)
        kinds = bytes(parser_kind(p) for p in parsers)
        self._relations[r.oid] = _Rel(
            source=r,
            json=relation_json,
            names=names,
            parsers=parsers,
            key_indexes=key_indexes,
        )
        # What _pgrows.decode reads of it (one parser_kind byte per column).
        self._specs[r.oid] = (relation_json, names, parsers, kinds, key_indexes)

    def _check_unchanged(self, r: Relation) -> None:
        """Degraded mode: without event triggers any schema change means reset."""
        table = self._initial_tables.get(r.oid)
        problem: str | None = None
        if table is None:
            problem = f"relation {r.namespace}.{r.name} is not in the initial schema"
        elif (table.get("schema"), table.get("name")) != (r.namespace, r.name):
            problem = f"table {table.get('name')} was renamed to {r.name}"
        else:
            columns = sorted(table.get("columns", {}).items(), key=lambda kv: kv[1].get("pos", 0))
            expected = [(name, spec.get("typeOID")) for name, spec in columns]
            actual = [(c.name, c.type_oid) for c in r.columns]
            if expected != actual:
                problem = f"columns of table {r.name} have changed"
        if problem is not None:
            raise MappingError(
                "Schema changes cannot be reliably replicated without event trigger support",
                {"reason": problem},
            )

    # -- logical messages -------------------------------------------------

    def _on_message(self, m: LogicalMessage) -> list[ChangeSourceMessage]:
        if not m.prefix.startswith(self._prefix):
            return []
        suffix = m.prefix[len(self._prefix) :]
        if suffix == MESSAGE_SUFFIX:
            # Without a reporter (disabled) another node's reports are ignored, as in zero.
            reporter = self.lag_reports
            status = None if reporter is None else reporter.on_message(m.content, m.lsn)
            return [] if status is None else [status]
        if suffix not in ("", "/ddl"):
            return []  # future kinds
        try:
            event = canonical_json.loads(m.content.decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise MappingError(f"unreadable DDL message at {format_lsn(m.lsn)}: {e}") from e
        if not isinstance(event, dict):
            raise MappingError(f"DDL message at {format_lsn(m.lsn)} is not an object")
        try:
            changes = self._ddl.process(event)
        except DdlError as e:
            context = event.get("context")
            details: dict[str, Any] = {"reason": str(e)}
            if context is not None:
                details["context"] = context
            raise MappingError(str(e), details) from e
        # Changes with a ``backfill`` field are filled in by backfill streams (backfills.py).
        return [Data(change, change["tag"]) for change in changes]


def _row(rel: _Rel, values: TupleData, fallback: dict[str, Any] | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, parse, v in zip(rel.names, rel.parsers, values, strict=False):
        if v is None:
            row[name] = None
        elif type(v) is str:
            row[name] = parse(v)
        elif type(v) is JsonPieces:  # a large text value (materialize)
            row[name] = v
        elif v is UNCHANGED_TOAST:
            # JSON has no undefined: the column is left out unless the old row has it.
            if fallback is not None and name in fallback:
                row[name] = fallback[name]
        else:
            raise MappingError(f"binary tuple value for {rel.source.name}.{name} (proto 1 is text)")
    return row


def _key(rel: _Rel, values: TupleData) -> dict[str, Any]:
    key: dict[str, Any] = {}
    for i in rel.key_indexes:
        v = values[i] if i < len(values) else None
        # NULL in a key tuple marks a non-key column: leave it out.
        if type(v) is str:
            key[rel.names[i]] = rel.parsers[i](v)
        elif type(v) is JsonPieces:
            key[rel.names[i]] = v
    return key


async def _texts(rel: _Rel, values: TupleData) -> TupleData:
    """``values`` with each ``LargeValue`` made a ``JsonPieces`` (a text column) or
    a joined ``str`` (any other: parsed whole, see ``large_values``)."""
    out: list[TupleValue] = []
    for i, v in enumerate(values):
        if isinstance(v, LargeValue):
            if i < len(rel.parsers) and rel.parsers[i] is str:
                out.append(await json_string_pieces(v))
            else:
                out.append(v.join())
        else:
            out.append(v)
    return tuple(out)


def _truncating_ms(us: int) -> int:
    """Microseconds → milliseconds rounded toward zero, as BigInt division in the reference."""
    return us // 1000 if us >= 0 else -(-us // 1000)
