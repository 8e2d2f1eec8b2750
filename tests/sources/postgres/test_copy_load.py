"""COPY rows into the replica (app/sources/postgres/copy_load.py): the C loader
(``_copyload.c``) and its pure-Python twin, on real Postgres output.

Both must store the same rows, split a row the same way (or refuse it with the same
words), stop at the same byte budget and leave nothing of a batch that failed.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg import sql as pgsql

from app.sources.postgres import copy_load
from app.sources.postgres.copy_load import Converter, Loader, PyLoader, copy_table
from app.sources.postgres.copy_out import CopyOutError
from app.sources.postgres.copy_text import CopyFormatError, parse_copy_line
from app.sources.postgres.initial_sync import _converter
from app.sources.postgres.values import load_type_registry
from tests.c_helpers import built
from tests.sources.postgres.test_copy_text import AWKWARD as COPY_TEXT_AWKWARD
from tests.waiting import eventually_blocking

_copyload = built("app.sources.postgres._copyload")
C_READY = _copyload is not None and copy_load.setup_helper(_copyload)

IMPLS = [
    pytest.param("python", id="python"),
    pytest.param(
        "c",
        id="c",
        marks=pytest.mark.skipif(not C_READY, reason="_copyload is not built or cannot be set up"),
    ),
]

AWKWARD = [*COPY_TEXT_AWKWARD, "ends with a backslash \\"]

TABLE = """CREATE TEMP TABLE items (
    id bigint, n int, s smallint, flag bool, title text, x float8, j jsonb, amount numeric,
    at timestamptz, tags text[], u uuid
)"""
COLUMNS = ["id", "n", "s", "flag", "title", "x", "j", "amount", "at", "tags", "u"]
LITE_TYPES = [
    "int8",
    "int4",
    "int2",
    "bool",
    "text",
    "float8",
    "jsonb",
    "numeric",
    "timestamptz",
    "text[]",
    "uuid",
]


def make_loader(impl: str, path: Path, columns: Sequence[str], converters: Sequence[Any]) -> Loader:
    insert = f"INSERT INTO items ({', '.join(columns)}) VALUES ({', '.join('?' for _ in columns)})"
    if impl == "python":
        return PyLoader(path, insert, converters, 2_000)
    assert _copyload is not None
    loader: Loader = _copyload.Loader(str(path), insert, tuple(converters), 2_000)
    return loader


def replica(tmp_path: Path, ddl: str) -> Path:
    path = tmp_path / "replica.db"
    with sqlite3.connect(path) as lite:
        lite.execute(ddl)
    return path


def id_title(
    pg: psycopg.Connection[Any],
    tmp_path: Path,
    impl: str,
    title: str,
    rows: int,
    *,
    lite_id: str = "INTEGER",
    converter: Converter | None = None,
) -> tuple[Path, Loader]:
    """A temporary ``items (id, title)`` of ``rows`` rows (``title`` an SQL expression of
    ``g``, the id), its table in a new replica, and a loader for that table."""
    pg.execute(
        f"CREATE TEMP TABLE items AS SELECT g AS id, {title} AS title "
        f"FROM generate_series(1, {rows}) g"
    )
    path = replica(tmp_path, f"CREATE TABLE items (id {lite_id}, title TEXT)")
    return path, make_loader(impl, path, ["id", "title"], [None, converter])


@pytest.fixture
def pg(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    conn = psycopg.connect(pg_url, autocommit=True)
    try:
        yield conn
    finally:
        conn.close()  # a failed COPY leaves it mid-COPY


def copy_query(
    conn: psycopg.Connection[Any], columns: Sequence[str], table: str = "items"
) -> bytes:
    return (
        pgsql.SQL("COPY (SELECT {} FROM {} ORDER BY 1) TO STDOUT")
        .format(pgsql.SQL(", ").join(map(pgsql.Identifier, columns)), pgsql.Identifier(table))
        .as_bytes(conn)
    )


def run_copy(
    conn: psycopg.Connection[Any], query: bytes, loader: Loader, max_bytes: int = 1 << 20
) -> list[tuple[int, int]]:
    batches: list[tuple[int, int]] = []
    try:
        copy_table(
            conn,
            query,
            loader,
            lambda rows, size: batches.append((rows, size)),
            max_bytes=max_bytes,
        )
    finally:
        loader.close()
    return batches


async def converters_for(pg_url: str) -> list[Converter | None]:
    async with await psycopg.AsyncConnection.connect(pg_url) as conn:
        registry = await load_type_registry(conn)
        oids = {}
        for name in ("int8", "int4", "int2", "bool", "text", "float8", "jsonb", "numeric",
                     "timestamptz", "_text", "uuid"):  # fmt: skip
            cur = await conn.execute("SELECT oid::int8 FROM pg_type WHERE typname = %s", (name,))
            row = await cur.fetchone()
            assert row is not None
            oids[name] = int(row[0])
    names = ["int8", "int4", "int2", "bool", "text", "float8", "jsonb", "numeric",
             "timestamptz", "_text", "uuid"]  # fmt: skip
    lite = ["INTEGER", "INTEGER", "INTEGER", "BOOL", "TEXT", "REAL", "JSON", "NUMERIC",
            "TIMESTAMPTZ", "TEXT[]", "UUID"]  # fmt: skip
    return [_converter(registry, oids[n], t) for n, t in zip(names, lite, strict=True)]


def stored(path: Path, order: str = "id") -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as lite:
        return [
            tuple(row) for row in lite.execute(f"SELECT *, typeof(x) FROM items ORDER BY {order}")
        ]


@pytest.mark.parametrize("impl", IMPLS)
async def test_every_kind_of_value_is_stored_as_the_twin_stores_it(
    impl: str, pg_url: str, pg: psycopg.Connection[Any], tmp_path: Path
) -> None:
    converters = await converters_for(pg_url)
    assert converters[0] is None
    assert converters[4] is None
    assert converters[5] is not None
    assert converters[8] is not None
    pg.execute(TABLE)
    for i, text in enumerate(AWKWARD):
        pg.execute(
            "INSERT INTO items VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                i,
                -(2**31),
                2**15 - 1,
                i % 2 == 0,
                text,
                i / 7,
                f'{{"k": {i}}}',
                "12345.678",
                "2024-05-06 07:08:09.123456+02",
                ["a", None, text or "b"],
                "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            ),
        )
    pg.execute(
        "INSERT INTO items (id, x, amount) VALUES (%s, 'NaN', 'NaN'), (%s, '-Infinity', '1e30')",
        (2**63 - 1, -(2**63)),
    )
    columns = ", ".join(f"{c} {t}" for c, t in zip(COLUMNS, LITE_TYPES, strict=True))
    ddl = f"CREATE TABLE items ({columns})"
    ours = replica(tmp_path, ddl)
    run_copy(pg, copy_query(pg, COLUMNS), make_loader(impl, ours, COLUMNS, converters))
    (tmp_path / "twin").mkdir()
    twin = replica(tmp_path / "twin", ddl)
    run_copy(pg, copy_query(pg, COLUMNS), make_loader("python", twin, COLUMNS, converters))
    rows = stored(ours)
    assert rows == stored(twin)
    assert [r[4] for r in rows[1 : len(AWKWARD) + 1]] == AWKWARD
    assert rows[0][0] == -(2**63)
    assert rows[-1][0] == 2**63 - 1


@pytest.mark.parametrize("impl", IMPLS)
def test_a_batch_ends_after_the_row_that_reaches_max_bytes(
    impl: str, pg: psycopg.Connection[Any], tmp_path: Path
) -> None:
    path, loader = id_title(pg, tmp_path, impl, "repeat('x', 95)", 1000)
    # Each COPY line is len("<id>\t" + 95 x + "\n") bytes: batches of >= 1000 bytes.
    batches = run_copy(pg, copy_query(pg, ["id", "title"]), loader, max_bytes=1000)
    assert sum(rows for rows, _ in batches) == 1000
    line = [len(f"{i}\t{'x' * 95}\n") for i in range(1, 1001)]
    assert sum(size for _, size in batches) == sum(line)
    # Every batch but the last stops at the first row that takes it to 1000 bytes.
    start = 0
    for rows, size in batches[:-1]:
        assert size == sum(line[start : start + rows])
        assert size >= 1000
        assert size - line[start + rows - 1] < 1000
        start += rows
    assert batches[-1] == (1000 - start, sum(line[start:]))
    with sqlite3.connect(path) as lite:
        assert lite.execute("SELECT count(*), sum(id) FROM items").fetchone() == (1000, 500500)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_failed_insert_leaves_nothing_of_its_batch(
    impl: str, pg: psycopg.Connection[Any], tmp_path: Path
) -> None:
    path, loader = id_title(pg, tmp_path, impl, "'row ' || g", 300, lite_id="INTEGER UNIQUE")
    pg.execute("INSERT INTO items VALUES (250, 'again')")
    with pytest.raises(sqlite3.IntegrityError, match=r"UNIQUE constraint failed: items\.id"):
        run_copy(pg, copy_query(pg, ["id", "title"]), loader, max_bytes=1000)
    with sqlite3.connect(path) as lite:
        (count,) = lite.execute("SELECT count(*) FROM items").fetchone()
        max_id = lite.execute("SELECT max(id) FROM items").fetchone()[0]
    assert 0 < count < 250
    assert count == max_id


@pytest.mark.parametrize("impl", IMPLS)
def test_a_converter_that_raises_stops_the_copy(
    impl: str, pg: psycopg.Connection[Any], tmp_path: Path
) -> None:
    def picky(text: str) -> str:
        if text == "40":
            raise ValueError("no 40")
        return text

    path, loader = id_title(pg, tmp_path, impl, "g::text", 50, converter=picky)
    with pytest.raises(ValueError, match="no 40"):
        run_copy(pg, copy_query(pg, ["id", "title"]), loader)
    with sqlite3.connect(path) as lite:
        assert lite.execute("SELECT count(*) FROM items").fetchone() == (0,)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_row_with_the_wrong_number_of_fields_is_a_clear_error(
    impl: str, pg: psycopg.Connection[Any], tmp_path: Path
) -> None:
    pg.execute("CREATE TEMP TABLE items AS SELECT 1 AS id, 'a' AS title")
    path = replica(tmp_path, "CREATE TABLE items (id INTEGER, title TEXT, n INTEGER)")
    loader = make_loader(impl, path, ["id", "title", "n"], [None, None, None])
    with pytest.raises(CopyFormatError, match=r"^COPY row has 2 fields, expected 3: '1\\ta'$"):
        run_copy(pg, copy_query(pg, ["id", "title"]), loader)


@pytest.fixture
def sql_ascii(pg_url: str) -> Iterator[str]:
    """A database whose text may hold any bytes (SQL_ASCII): COPY sends them as they are."""
    name = "changestreamer_copy_load_ascii"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name}")
        admin.execute(
            f"CREATE DATABASE {name} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' "
            "TEMPLATE template0"
        )
        try:
            yield pg_url.rsplit("/", 1)[0] + "/" + name
        finally:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.mark.parametrize("impl", IMPLS)
def test_a_row_that_is_not_utf8_is_a_clear_error(impl: str, sql_ascii: str, tmp_path: Path) -> None:
    path = replica(tmp_path, "CREATE TABLE items (id INTEGER, title TEXT)")
    with psycopg.connect(sql_ascii, autocommit=True) as conn:
        conn.execute("SET client_encoding = 'SQL_ASCII'")
        conn.execute("CREATE TEMP TABLE items (id int, title text)")
        conn.execute("INSERT INTO items VALUES (1, 'ok'), (2, E'caf\\xe9')")
        loader = make_loader(impl, path, ["id", "title"], [None, None])
        with pytest.raises(
            CopyFormatError, match=re.escape("COPY row is not UTF-8: '2\\tcaf\ufffd'")
        ):
            run_copy(conn, copy_query(conn, ["id", "title"]), loader)
        conn.close()  # mid-COPY


@pytest.mark.parametrize("impl", IMPLS)
def test_a_connection_lost_during_the_copy_is_a_copy_error(
    impl: str, pg: psycopg.Connection[Any], pg_url: str, tmp_path: Path
) -> None:
    path, loader = id_title(pg, tmp_path, impl, "repeat('y', 200)", 20000)
    pid = pg.info.backend_pid
    batches: list[int] = []

    def kill_after_first(rows: int, size: int) -> None:
        batches.append(rows)
        if len(batches) == 1:
            with psycopg.connect(pg_url, autocommit=True) as other:
                other.execute("SELECT pg_terminate_backend(%s)", (pid,))

    with pytest.raises(CopyOutError):
        try:
            copy_table(
                pg, copy_query(pg, ["id", "title"]), loader, kill_after_first, max_bytes=4096
            )
        finally:
            loader.close()
    with sqlite3.connect(path) as lite:
        (count,) = lite.execute("SELECT count(*) FROM items").fetchone()
    assert count == sum(batches) < 20000  # committed batches only, each whole


@pytest.mark.skipif(not C_READY, reason="_copyload is not built or cannot be set up")
def test_the_c_loader_uses_the_sqlite_of_the_sqlite3_module(
    pg: psycopg.Connection[Any], tmp_path: Path
) -> None:
    # Two copies of SQLite in one process do not see each other's locks (they are the
    # same process to the kernel), and would write the file at once. The helper's
    # SQLite is the sqlite3 module's: it waits for a lock that module holds.
    path, loader = id_title(pg, tmp_path, "c", "'a'", 1)
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError, match="BEGIN: database is locked"):
        run_copy(pg, copy_query(pg, ["id", "title"]), loader)
    holder.execute("ROLLBACK")
    holder.close()


@pytest.mark.skipif(not C_READY, reason="_copyload is not built or cannot be set up")
def test_the_c_loader_gives_the_gil_up_while_it_loads(
    pg: psycopg.Connection[Any], pg_url: str, tmp_path: Path
) -> None:
    # The COPY's 2000th row waits for an advisory lock that a Python thread holds
    # and lets go of only once it sees the wait. If the loader kept the GIL, that
    # thread could not run, and the COPY would end at its statement timeout instead.
    path = replica(tmp_path, "CREATE TABLE items (id INTEGER, title TEXT)")
    loader = make_loader("c", path, ["id", "title"], [None, None])
    pg.execute("SET statement_timeout = '20s'")
    # The rows before it fill the server's output buffer, so the COPY has begun on
    # the client's side (psycopg keeps the GIL while it waits for that) when the
    # server stops to wait.
    query = (
        b"COPY (SELECT g, CASE WHEN g = 2000 THEN (SELECT 'x' FROM pg_advisory_lock(7301)) "
        b"ELSE repeat('a', 100) END FROM generate_series(1, 2001) g) TO STDOUT"
    )
    released = threading.Event()
    with psycopg.connect(pg_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(7301)")

        def release_when_waited_on() -> None:
            with psycopg.connect(pg_url, autocommit=True) as watcher:
                eventually_blocking(
                    lambda: (
                        watcher.execute(
                            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                            "AND objid = 7301 AND NOT granted"
                        ).fetchone()
                        == (1,)
                    ),
                    timeout_s=15,
                    what="the COPY to wait for the advisory lock",
                )
            holder.execute("SELECT pg_advisory_unlock(7301)")
            released.set()

        releaser = threading.Thread(target=release_when_waited_on)
        releaser.start()
        try:
            batches = run_copy(pg, query, loader)
        finally:
            releaser.join()
    assert released.is_set()
    assert sum(rows for rows, _ in batches) == 2001


# -- one row, split as parse_copy_line splits it ---------------------------------

ESCAPES = [b"\\", b"\\N", b"\\\\", b"\\t", b"\\n", b"\\x4", b"\\x41", b"\\xg", b"\\101", b"\\7"]
ESCAPES += [b"\\303\\251", b"\\377", b"\\b\\f\\v\\r", b"\\\xc3\xa9"]
FIELD_BYTES = st.lists(
    st.one_of(
        st.sampled_from(ESCAPES),
        st.text(max_size=4).map(str.encode),
        st.binary(max_size=3),
    ),
    max_size=6,
).map(b"".join)  # fmt: skip


@pytest.mark.skipif(not C_READY, reason="_copyload is not built or cannot be set up")
@settings(max_examples=400, deadline=None)
@given(
    fields=st.lists(FIELD_BYTES, min_size=1, max_size=4), n=st.integers(1, 4), newline=st.booleans()
)
def test_a_row_splits_as_parse_copy_line_splits_it(
    fields: list[bytes], n: int, newline: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    line = b"\t".join(fields) + (b"\n" if newline else b"")
    loader = _loader_for_parsing(tmp_path_factory, n)
    try:
        expected: list[str | None] | str = parse_copy_line(line, n)
    except CopyFormatError as e:
        expected = str(e)
    try:
        got: list[str | None] | str = loader.parse_line(line)
    except CopyFormatError as e:
        got = str(e)
    assert got == expected


_PARSERS: dict[int, Loader] = {}


def _loader_for_parsing(factory: pytest.TempPathFactory, n: int) -> Loader:
    if n not in _PARSERS:
        columns = [f"c{i}" for i in range(n)]
        path = factory.mktemp("parse") / "replica.db"
        with sqlite3.connect(path) as lite:
            lite.execute(f"CREATE TABLE items ({', '.join(columns)})")
        _PARSERS[n] = make_loader("c", path, columns, [None] * n)
    return _PARSERS[n]


def test_the_addresses_are_those_of_the_libraries_in_use() -> None:
    names = ("sqlite3_open_v2", "PQgetCopyData")
    addresses = copy_load._library_addresses(names)
    if addresses is None:
        pytest.skip("psycopg has no compiled libpq module here")
    assert set(addresses) == set(names)
    assert all(addresses.values())
