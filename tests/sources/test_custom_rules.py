"""The watermark rules of a custom change source's stream (spec/source.md §2.4), and
the schema changes the replica could never apply."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from app.protocol.messages import parse_change_source_message
from app.replica.errors import ReplicaError
from app.replica.writer import ReplicaWriter
from app.sources import custom_rules
from app.sources.custom_rules import MAX_SOURCE_COLUMNS, SQLITE_MAX_COLUMNS, StreamRules
from tests.replica.conftest import new_replica
from tests.serve_pg.conftest import (
    APP_ID,
    Serve,
    change_db_watermark,
    eventually,
    lite_rows,
    replica_versions,
)
from tests.sources.custom_upstream import custom_upstream, initial_sync, issue, transaction
from tests.sources.test_custom_serve import SERVE_ENV, WAIT_S


def begin(wm: str) -> list[Any]:
    return ["begin", {"tag": "begin"}, {"commitWatermark": wm}]


def commit(wm: str) -> list[Any]:
    return ["commit", {"tag": "commit"}, {"watermark": wm}]


def status(wm: str) -> list[Any]:
    return ["status", {"ack": True}, {"watermark": wm}]


ROLLBACK: list[Any] = ["rollback", {"tag": "rollback"}]
TABLE = {"schema": "public", "name": "t"}
CREATE = {
    "tag": "create-table",
    "spec": {**TABLE, "columns": {"id": {"pos": 1, "dataType": "int4"}}},
}
ADD = {
    "tag": "add-column",
    "table": TABLE,
    "column": {"name": "c", "spec": {"pos": 2, "dataType": "text"}},
}


def with_default(change: dict[str, Any], dflt: str | None) -> dict[str, Any]:
    """``change`` (CREATE or ADD) with ``dflt`` on its (last) column."""
    if change["tag"] == "create-table":
        spec = change["spec"]
        columns = {**spec["columns"], "c": {"pos": 2, "dataType": "text", "dflt": dflt}}
        return {**change, "spec": {**spec, "columns": columns}}
    column = change["column"]
    return {**change, "column": {**column, "spec": {**column["spec"], "dflt": dflt}}}


def problems(after: str | None, *messages: list[Any]) -> list[str | None]:
    rules = StreamRules(after)
    return [rules.check(parse_change_source_message(m)) for m in messages]


def create(name: str, columns: int | list[str] = 1, schema: str = "public") -> dict[str, Any]:
    """A create-table of ``columns`` columns ``id``, ``c1``, … (or of these names)."""
    names = columns if isinstance(columns, list) else ["id", *(f"c{i}" for i in range(1, columns))]
    specs = {col: {"pos": pos, "dataType": "int4"} for pos, col in enumerate(names, start=1)}
    return {"tag": "create-table", "spec": {"schema": schema, "name": name, "columns": specs}}


def add(table: str, column: str = "x", schema: str = "public") -> dict[str, Any]:
    return {
        "tag": "add-column",
        "table": {"schema": schema, "name": table},
        "column": {"name": column, "spec": {"pos": 5000, "dataType": "text"}},
    }


def drop_column(table: str, column: str) -> dict[str, Any]:
    return {"tag": "drop-column", "table": {"schema": "public", "name": table}, "column": column}


def rename(old: str, new: str, new_schema: str = "public") -> dict[str, Any]:
    return {
        "tag": "rename-table",
        "old": {"schema": "public", "name": old},
        "new": {"schema": new_schema, "name": new},
    }


def update_column(table: str, old: str, new: str) -> dict[str, Any]:
    spec = {"pos": 2, "dataType": "text"}
    return {
        "tag": "update-column",
        "table": {"schema": "public", "name": table},
        "old": {"name": old, "spec": spec},
        "new": {"name": new, "spec": spec},
    }


def index(name: str, table: str = "t") -> dict[str, Any]:
    return {
        "tag": "create-index",
        "spec": {
            "schema": "public",
            "tableName": table,
            "name": name,
            "unique": True,
            "columns": {"id": "ASC"},
        },
    }


def tx(wm: str, *changes: dict[str, Any]) -> list[list[Any]]:
    return [begin(wm), *(["data", change] for change in changes), commit(wm)]


def ddl_problems(*changes: dict[str, Any]) -> list[str | None]:
    """The rules' answer to each change, all in one transaction (begin/commit left out)."""
    return problems("01", *tx("02", *changes))[1:-1]


def last_problem(*changes: dict[str, Any]) -> str | None:
    """The rules' answer to the last change; the ones before it must pass."""
    *before, last = ddl_problems(*changes)
    assert before == [None] * len(before)
    return last


def test_a_well_behaved_stream_passes() -> None:
    stream = [
        status("05"),  # a status may precede everything, even at lastWatermark's level
        begin("06"),
        ["data", CREATE],
        ["data", ADD],
        ["data", with_default(CREATE, "'0'::integer")],
        ["data", with_default(ADD, None)],
        ["data", with_default(ADD, "'it''s'::text")],
        ["data", with_default(ADD, "-1.5")],
        ["data", with_default(ADD, "true")],
        ["data", with_default(ADD, "'{}'::text[]")],
        commit("06"),
        status("06"),  # non-decreasing: equal is fine
        begin("07"),
        ROLLBACK,
        begin("07"),  # a rolled-back watermark was never committed
        commit("07"),
        begin("07.01"),  # major.minor sorts after its major
        commit("07.01"),
        status("08"),
        begin("08"),
        commit("08"),
    ]
    assert problems("05", *stream) == [None] * len(stream)


def test_the_initial_sync_has_no_start_watermark() -> None:
    assert problems(None, begin("00"), commit("00")) == [None, None]


@pytest.mark.parametrize(
    ("after", "messages", "problem"),
    [
        (
            "0a",
            [begin("0a")],
            "a begin with commitWatermark 0a, not after lastWatermark 0a the stream was "
            "started with (it is stored already)",
        ),
        ("0a", [begin("09")], "a begin with commitWatermark 09, not after lastWatermark 0a"),
        (
            "01",
            [begin("0c"), commit("0c"), begin("0c")],
            "a begin with commitWatermark 0c, not after the previous commit 0c "
            "(commit watermarks must strictly increase)",
        ),
        (
            "01",
            [begin("0c"), commit("0c"), begin("0b")],
            "a begin with commitWatermark 0b, not after the previous commit 0c",
        ),
        (
            "01",
            [begin("0c"), commit("0d")],
            "a commit with watermark 0d, not its begin's commitWatermark 0c",
        ),
        (
            "01",
            [status("0e"), status("0d")],
            "a status with watermark 0d, behind the status watermark 0e sent before it "
            "(watermarks never go backwards)",
        ),
        (
            "01",
            [begin("0e"), commit("0e"), status("0d")],
            "a status with watermark 0d, behind the commit watermark 0e sent before it",
        ),
        (
            "01",
            [status("0e"), begin("0d")],
            "a begin with commitWatermark 0d, behind the status watermark 0e sent before it",
        ),
        (
            "01",
            [begin("02"), ["data", {**CREATE, "backfill": {"id": {"attNum": 1}}}]],
            "a create-table of public.t with a 'backfill' field (custom change sources cannot "
            "backfill: leave it out and send the rows)",
        ),
        (
            "01",
            [begin("02"), ["data", {**ADD, "backfill": {"attNum": 2}}]],
            "an add-column of public.t with a 'backfill' field",
        ),
        (
            "01",
            [begin("02"), ["data", with_default(ADD, "'x' CHECK (0) COLLATE 'binary'::text")]],
            "an add-column of public.t whose column c has the default "
            "'x' CHECK (0) COLLATE 'binary'::text, not a literal (a column default must be a "
            "number, true, false, a quoted string with a ::type cast such as 'x'::text, an "
            "empty array, or null)",
        ),
        (
            "01",
            [begin("02"), ["data", with_default(ADD, "1); DROP TABLE t; --")]],
            "an add-column of public.t whose column c has the default 1); DROP TABLE t; --, "
            "not a literal",
        ),
        (
            "01",
            [begin("02"), ["data", with_default(CREATE, "'x'::text;\nDROP TABLE t")]],
            "a create-table of public.t whose column c has the default "
            "\"'x'::text;\\nDROP TABLE t\", not a literal",
        ),
        (
            "01",
            [begin("02"), ["data", with_default(CREATE, "nextval('t_id_seq'::regclass)")]],
            "a create-table of public.t whose column c has the default "
            "nextval('t_id_seq'::regclass), not a literal",
        ),
    ],
)
def test_a_broken_rule_is_named(after: str, messages: list[list[Any]], problem: str) -> None:
    *before, last = problems(after, *messages)
    assert before == [None] * len(before)
    assert last is not None
    assert last.startswith(problem)


def test_framing_errors_are_left_to_the_service() -> None:
    # commit without begin: the service stops on it (a framing error, not a watermark one).
    assert problems("01", commit("05")) == [None]


# -- schema changes the replica could never apply -------------------------------------

RESERVED_ZERO = "are reserved for the replica's own tables"


def test_the_column_limit_is_sqlites_less_the_replicas_own_columns() -> None:
    assert (SQLITE_MAX_COLUMNS, MAX_SOURCE_COLUMNS) == (2000, 1999)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        (
            [create("foo", schema="_zero")],
            "a create-table of _zero.foo: the replica would name it _zero.foo, and names "
            f"starting with '_zero.' {RESERVED_ZERO}",
        ),
        (
            [create("_zero.changeLog2")],
            "a create-table of public._zero.changeLog2: the replica would name it "
            f"_zero.changeLog2, and names starting with '_zero.' {RESERVED_ZERO}",
        ),
        (
            # The replica's catalog leaves out names LIKE '_zero.%': '_' is any character.
            [create("xzero.t")],
            "a create-table of public.xzero.t: the replica would name it xzero.t, and names "
            "LIKE '_zero.%' (where '_' is any character and case is ignored) "
            f"{RESERVED_ZERO}",
        ),
        (
            [create("_ZERO.replicationState")],
            "a create-table of public._ZERO.replicationState: the replica would name it "
            "_ZERO.replicationState, and names LIKE '_zero.%' (where '_' is any character",
        ),
        (
            [create("sqlite_stat1")],
            "a create-table of public.sqlite_stat1: the replica would name it sqlite_stat1, "
            "and names starting with 'sqlite_' are reserved for SQLite's internal tables",
        ),
        (
            [create("SQLite3_t")],
            "a create-table of public.SQLite3_t: the replica would name it SQLite3_t, and "
            "names LIKE 'sqlite_%' (where '_' is any character and case is ignored) are "
            "reserved for SQLite's internal tables",
        ),
        (
            [create("_litestream_seq")],
            "a create-table of public._litestream_seq: the replica would name it "
            "_litestream_seq, and names starting with '_litestream_' are reserved for "
            "litestream's tables",
        ),
        (
            # A name that does not fit on one line is shown as its repr.
            [create("x\nzero.t", schema="_zero")],
            "a create-table of '_zero.x\\nzero.t': the replica would name it "
            "'_zero.x\\nzero.t', and names starting with '_zero.'",
        ),
        (
            [create("t"), rename("t", "t", new_schema="_zero")],
            "a rename-table of public.t to _zero.t: the replica would name it _zero.t, and "
            f"names starting with '_zero.' {RESERVED_ZERO}",
        ),
        (
            [create("t"), index("sqlite_autoindex_t_1")],
            "a create-index of public.sqlite_autoindex_t_1: the replica would name it "
            "sqlite_autoindex_t_1, and names starting with 'sqlite_' are reserved for "
            "SQLite's internal tables",
        ),
        (
            [create("t", ["id", "_0_version"])],
            "a create-table of public.t naming the column _0_version: that is the replica's "
            "own column _0_version (the row version, in every table; SQLite ignores case in "
            "column names), not the source's",
        ),
        (
            [create("t"), add("t", "_0_VERSION")],
            "an add-column of public.t naming the column _0_VERSION: that is the replica's "
            "own column _0_version",
        ),
        (
            [create("t", ["id", "c"]), update_column("t", "c", "_0_version")],
            "an update-column of public.t naming the column _0_version: that is the replica's",
        ),
        (
            [update_column("t", "_0_version", "v")],
            "an update-column of public.t naming the column _0_version: that is the replica's",
        ),
        (
            [drop_column("t", "_0_version")],
            "a drop-column of public.t naming the column _0_version: that is the replica's",
        ),
        (
            [create("t", ["id", "Name", "name"])],
            "a create-table of public.t with the columns Name and name: SQLite column names "
            "ignore case, so they would be one (duplicate column name)",
        ),
        (
            [create("wide", 2000)],
            "a create-table of public.wide with 2000 columns: with the replica's own "
            "_0_version the table would have 2001, and SQLite allows at most 2000 (so at "
            "most 1999 from the source)",
        ),
        (
            [create("wide", 1998), add("wide", "a"), add("wide", "b")],
            "an add-column of public.wide that would give it 2000 columns: with the "
            "replica's own _0_version the table would have 2001, and SQLite allows at most "
            "2000 (so at most 1999 from the source)",
        ),
        (
            # Known through a rename, and after a drop and re-create, the new table's.
            [
                create("w", 1999),
                {"tag": "drop-table", "id": {"schema": "public", "name": "w"}},
                create("w", 1999),
                rename("w", "w2"),
                add("w2"),
            ],
            "an add-column of public.w2 that would give it 2000 columns",
        ),
    ],
)
def test_ddl_the_replica_cannot_apply_is_named(changes: list[dict[str, Any]], problem: str) -> None:
    last = last_problem(*changes)
    assert last is not None
    assert last.startswith(problem)
    assert "\n" not in last


def test_names_and_widths_the_replica_takes_pass() -> None:
    changes = [
        create("wide", MAX_SOURCE_COLUMNS),  # 1999 + _0_version: SQLite's 2000
        create("w2", MAX_SOURCE_COLUMNS - 1),
        add("w2"),  # its 1999th
        drop_column("w2", "x"),
        add("w2", "y"),  # room again after a drop
        rename("w2", "w3"),
        drop_column("w3", "c1"),
        add("w3", "z"),
        create("zero", schema="zero"),  # "zero.zero": no reserved prefix
        create("_zero_t"),
        create("my_zero.t"),  # LIKE '_zero.%' wants exactly one character before "zero."
        create("sqlit_e"),
        create("litestream_x"),
        create("t", ["id", "É", "é", "_0_versions", "version"]),  # SQLite folds ASCII only
        add("t", "_0_versio"),
        update_column("t", "version", "_1_version"),
        index("zero_idx", "t"),
    ]
    assert ddl_problems(*changes) == [None] * len(changes)


def test_a_table_from_before_the_stream_has_an_unknown_width_and_is_not_refused() -> None:
    # The replica is not read: add-columns to a table this stream did not create are
    # accepted, however many come (the replica follower is the one to fail on them).
    assert ddl_problems(*(add("old", f"c{i}") for i in range(2100))) == [None] * 2100


def test_a_rolled_back_schema_change_forgets_the_widths() -> None:
    stream = [
        *tx("02", create("wide", MAX_SOURCE_COLUMNS - 1)),
        begin("03"),
        ["data", {"tag": "drop-table", "id": {"schema": "public", "name": "wide"}}],
        ["data", create("wide", 1)],
        ROLLBACK,  # upstream, "wide" still has 1998 columns: unknown from here on
        *tx("03", add("wide"), add("wide"), add("wide")),
    ]
    assert problems("01", *stream) == [None] * len(stream)


def test_a_rollback_without_schema_changes_keeps_the_widths() -> None:
    stream = [
        *tx("02", create("wide", MAX_SOURCE_COLUMNS)),
        begin("03"),
        ROLLBACK,
        *tx("03", add("wide")),
    ]
    *before, refused, _commit = problems("01", *stream)
    assert before == [None] * len(before)
    assert refused is not None
    assert refused.startswith("an add-column of public.wide that would give it 2000 columns")


def test_the_remembered_widths_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = tx("02", create("wide", MAX_SOURCE_COLUMNS), create("a"), create("b"), add("wide"))
    assert problems("01", *stream)[-2] is not None  # "wide" is known: refused
    monkeypatch.setattr(custom_rules, "MAX_KNOWN_TABLES", 2)
    # The oldest is forgotten, so unknown and accepted (never refused on a guess).
    assert problems("01", *stream) == [None] * len(stream)


# Each case's changes, then an insert of a row into the table named: what the rules
# accept the replica writer applies; what they refuse, the writer fails on (on the
# change itself or on the row after it), so nothing refused here could have been kept.
AGAINST_THE_WRITER = {
    "create at the limit": ([create("w", MAX_SOURCE_COLUMNS)], "w"),
    "create past the limit": ([create("w", MAX_SOURCE_COLUMNS + 1)], "w"),
    "add up to the limit": ([create("w", MAX_SOURCE_COLUMNS - 1), add("w")], "w"),
    "add past the limit": ([create("w", MAX_SOURCE_COLUMNS), add("w")], "w"),
    "reserved table": ([create("foo", schema="_zero")], "_zero.foo"),
    "replica's own table": ([create("_zero.changeLog2")], "_zero.changeLog2"),
    "LIKE-reserved table": ([create("sqliteXt")], "sqliteXt"),
    "rename to a reserved name": ([create("t"), rename("t", "_litestream_t")], "_litestream_t"),
    "reserved index name": ([create("t"), index("sqlite_i")], "t"),
    "add _0_version": ([create("t"), add("t", "_0_Version")], "t"),
    "rename a column to _0_version": (
        [create("t", ["id", "c"]), update_column("t", "c", "_0_version")],
        "t",
    ),
    "drop _0_version": ([create("t"), drop_column("t", "_0_version")], "t"),
    "one column twice": ([create("t", ["id", "A", "a"])], "t"),
    "columns SQLite tells apart": ([create("t", ["id", "É", "é"])], "t"),
}


@pytest.mark.parametrize("case", list(AGAINST_THE_WRITER))
def test_the_rules_agree_with_the_replica_writer(tmp_path: Path, case: str) -> None:
    changes, table = AGAINST_THE_WRITER[case]
    refused = any(ddl_problems(*changes))
    writer = ReplicaWriter(new_replica(tmp_path / "replica.db"))
    relation = {"schema": "public", "name": table, "rowKey": {"columns": ["id"]}}
    try:
        writer.begin("02", {"tag": "begin", "json": "p"})
        for change in [*changes, {"tag": "insert", "relation": relation, "new": {"id": 1}}]:
            writer.apply(change)
        writer.commit("02", {"tag": "commit"})
        applied = True
    except ReplicaError:
        applied = False
    finally:
        writer.close()
    assert applied is not refused


async def test_refused_ddl_is_neither_stored_nor_acked_and_the_stream_goes_on(
    tmp_path: Path,
) -> None:
    """``serve`` against a source that sends, once, a table the replica already has."""
    async with custom_upstream([initial_sync(APP_ID, "0a")]) as up:
        up.publish(transaction("0b", issue(4, "four")))
        serve = Serve(tmp_path, up.url, SERVE_ENV)
        try:
            serve.start()
            await serve.wait_ready()
            await eventually(lambda: change_db_watermark(serve.change_db_file) == "0b", "0b")
            # The next connection sends a good row, then the bad table; the one after
            # that no longer does.
            bad = create("changeLog2", schema="_zero")
            up.next_stream(transaction("0c", issue(6, "six"), bad))
            up.drop()
            error = (
                "sent a create-table of _zero.changeLog2: the replica would name it "
                "_zero.changeLog2, and names starting with '_zero.' are reserved for the "
                "replica's own tables"
            )
            await serve.wait_output(re.escape(error), WAIT_S)
            await eventually(lambda: len(up.streams) == 3, "a third connection", WAIT_S)
            assert up.streams[2]["lastWatermark"] == ["0b"]
            up.publish(transaction("0d", issue(9, "nine")))
            await eventually(lambda: change_db_watermark(serve.change_db_file) == "0d", "0d")

            stored = lite_rows(serve.change_db_file, 'SELECT DISTINCT watermark FROM "changeLog"')
            assert sorted(w for (w,) in stored) == ["0a", "0b", "0d"]
            assert "0c" not in up.acked()
            # The replica follower applied on past it (it would crash on the table).
            await eventually(
                lambda: replica_versions(serve.replica_file)[1] == "0d", "replica at 0d", WAIT_S
            )
            ids = lite_rows(serve.replica_file, "SELECT id FROM issues ORDER BY id")
            assert [i for (i,) in ids] == [1, 2, 3, 4, 9]
            assert serve.alive()
            assert sum(error in line for line in serve.output().splitlines()) == 1
            await serve.terminate()
        finally:
            serve.close()
