"""A SQLite group commit on a plain ``sqlite3`` connection, and the writer process.

This module imports only the standard library: it is also the program of the
SQLite writer process (``app.storage.sqlite_writer`` starts it by path, with
``python -I``), which must start in milliseconds and never load the service.

``commit_rows`` is one write transaction of plain rows: ``BEGIN IMMEDIATE``,
the ownership check, the inserts, ``lastWatermark``, commit. It runs either in
aiosqlite's thread (``ChangeDbOptions.sqlite_writer = "thread"``) or in the
writer process (``"process"``, the default), where its Python work — flattening
and binding four parameters per row — no longer takes the GIL from the event
loop, and SQLite's own work runs on another core.

A change text too large to hold whole (``app.protocol.pieces.Pieces`` in the
service, ``ReceivedText`` here: a ``Utf8Text``) is never made one Python string:
its UTF-8 is written piece by piece into a zero-filled blob of a TEMP rowid
table (``sqlite3.Blob``; ``changeLog`` is WITHOUT ROWID, so no blob can be
opened on it) and copied into ``changeLog`` by ``INSERT … SELECT CAST(… AS
TEXT)``, inside ``sqlite3_step``, where the ``sqlite3`` module does not hold the
GIL. In aiosqlite's thread that keeps the event loop running; in the writer
process it spares a join and a second copy of the value.

The writer process speaks frames over a socketpair: an 8-byte little-endian
length, then a ``marshal`` (version 4) of plain tuples, strings, integers and
None — both ends are this module's code under the same interpreter, and
nothing else can reach the socket; marshal writes rows twice as fast as pickle.
The parent sends ``("commit_rows", owner, rows, last_watermark)``, or, when some
rows' change texts are in pieces, ``("commit_rows", owner, rows,
last_watermark, texts)`` with those rows left out of ``rows`` and ``texts``
holding ``(watermark, pos, precommit, number of pieces)`` for each, followed by
that many frames of one ``str`` piece each (at most ``PIECE_CHARS`` characters: the
parent writes them with the event loop running between them); the child
answers ``("ok", owner_found)`` or ``("error", sqlite3 class name, message)``.
Its first frame is ``("ready",)`` once the database is open, or an error. It
exits when the parent closes its end (end of file), after finishing the
transaction in hand: a parent killed mid-commit leaves a transaction that is
either whole or absent, as SQLite guarantees.
"""

from __future__ import annotations

import json
import marshal
import signal
import socket
import sqlite3
import struct
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Protocol, cast

__all__ = [
    "CREATE_STAGE",
    "FRAME_HEADER",
    "STAGE_TABLE",
    "TEMP_AUTO_VACUUM",
    "UNSTAGE",
    "PlainRow",
    "ReceivedText",
    "Row",
    "SqliteStatements",
    "TextRow",
    "Utf8Text",
    "commit_rows",
    "encode_frame",
    "insert_rows",
    "read_frame",
    "split_texts",
    "write_frame",
]


class Utf8Text(Protocol):
    """A change text held in pieces, never as one string: what ``Pieces`` offers."""

    def utf8(self) -> Iterable[bytes]:
        """The text's UTF-8, a piece at a time."""
        ...

    def utf8_length(self) -> int: ...


# (watermark, pos, change, precommit); the change is whole or in pieces.
Row = tuple[str, int, str | Utf8Text, str | None]
PlainRow = tuple[str, int, str, str | None]
TextRow = tuple[str, int, Utf8Text, str | None]

# The TEMP table a text in pieces is put together in (writes) or taken apart in
# (reads, app.storage.fastpath): one blob per text, deleted after use. Every
# connection sets ``temp.auto_vacuum`` before its TEMP database exists (it only
# takes effect then), so the temp file shrinks back after each text instead of
# keeping the size of the largest.
STAGE_TABLE = "changeText"
CREATE_STAGE = f'CREATE TEMP TABLE IF NOT EXISTS "{STAGE_TABLE}" ("utf8" BLOB)'
UNSTAGE = f'DELETE FROM temp."{STAGE_TABLE}" WHERE rowid = ?'
TEMP_AUTO_VACUUM = "PRAGMA temp.auto_vacuum=FULL"
_STAGE_ZEROS = f'INSERT INTO temp."{STAGE_TABLE}" ("utf8") VALUES (zeroblob(?))'

# Rows per INSERT statement, at most. sqlite3 releases and re-takes the GIL
# around every statement step; with one row per step, a busy event loop thread
# makes each re-take wait for the GIL switch interval, and a 2,000-row append
# took seconds under load (the convoy effect). Many rows per step avoid that,
# which is also why the largest statement is big: the storer writes 10,000-row
# groups when it is behind, and 256-row statements made it fall further behind
# (docs/benchmarks.md). A group of n rows is written with statements of
# 2048, 1024, ..., 2, 1 rows (n's binary digits below 2048): a handful of steps
# and only twelve statement texts, all in sqlite3's statement cache. One
# statement of exactly n rows (as before) had to be prepared anew for almost
# every group, since group sizes vary, and preparing a many-row VALUES list cost
# about as much as inserting its rows (docs/benchmarks.md, `bench.storage`).
ROWS_PER_STATEMENT = 2048

# A row whose change text is at least this long is inserted on its own, by
# ``SqliteStatements.insert_large``, and the statement is then run once more with
# NULLs (inserting nothing) so that it lets go of the value: sqlite3 keeps a
# cached statement's last bindings (SQLite's own copy of every bound text) until
# it is bound again, and a many-row statement may not be used again for hours —
# one 100 MB value held 100 MiB that way (decision 42).
LARGE_ROW_CHARS = 1 << 20
_CHANGE = itemgetter(2)
_STR = frozenset({str})

# Every frame: this 8-byte little-endian length, then a marshal of that length.
MARSHAL_VERSION = 4
FRAME_HEADER = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class SqliteStatements:
    """The SQL of a group commit for one change DB's tables."""

    select_owner: str
    set_head: str
    insert_prefix: str  # 'INSERT INTO … VALUES '
    # INSERT statements by row count: ROWS_PER_STATEMENT and the powers of two below.
    inserts: dict[int, str] = field(init=False, repr=False, compare=False)
    # One row, inserted only when a fifth parameter is true (see LARGE_ROW_CHARS).
    insert_large: str = field(init=False, repr=False, compare=False)
    # One row whose change is the text staged in STAGE_TABLE's row ``rowid``.
    insert_staged: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        inserts: dict[int, str] = {}
        n = ROWS_PER_STATEMENT
        while n >= 1:
            inserts[n] = self.insert_prefix + ",".join(["(?,?,?,?)"] * n)
            n //= 2
        object.__setattr__(self, "inserts", inserts)
        columns = self.insert_prefix.removesuffix(" VALUES ")
        object.__setattr__(self, "insert_large", columns + " SELECT ?, ?, ?, ? WHERE ?")
        object.__setattr__(
            self,
            "insert_staged",
            f'{columns} SELECT ?, ?, CAST("utf8" AS TEXT), ? FROM temp."{STAGE_TABLE}"'
            " WHERE rowid = ?",
        )

    @classmethod
    def for_tables(cls, change_log: str, replication_state: str) -> SqliteStatements:
        """For quoted table names, as ``ChangeDb.table_name`` gives them."""
        return cls(
            select_owner=f'SELECT "owner" FROM {replication_state}',
            set_head=f'UPDATE {replication_state} SET "lastWatermark" = ?',
            insert_prefix=(
                f'INSERT INTO {change_log} ("watermark", "pos", "change", "precommit") VALUES '
            ),
        )

    def to_json(self) -> str:
        return json.dumps([self.select_owner, self.set_head, self.insert_prefix])

    @classmethod
    def from_json(cls, text: str) -> SqliteStatements:
        select_owner, set_head, insert_prefix = json.loads(text)
        return cls(select_owner, set_head, insert_prefix)


def split_texts(rows: Sequence[Row]) -> tuple[Sequence[PlainRow], list[TextRow]]:
    """``rows`` as the rows whose change is a ``str`` and those whose change is in
    pieces (one pass over the types when there are none)."""
    if set(map(type, map(_CHANGE, rows))) <= _STR:
        return cast(Sequence[PlainRow], rows), []
    plain: list[PlainRow] = []
    texts: list[TextRow] = []
    for row in rows:
        change = row[2]
        if isinstance(change, str):
            plain.append((row[0], row[1], change, row[3]))
        else:
            texts.append((row[0], row[1], change, row[3]))
    return plain, texts


def insert_rows(
    sq: sqlite3.Connection,
    statements: SqliteStatements,
    rows: Sequence[PlainRow],
    texts: Sequence[TextRow] = (),
) -> None:
    """Full statements, then the rest by halves; large rows and ``texts`` (rows
    whose change is in pieces) one by one."""
    for text in texts:
        _insert_text(sq, statements, text)
    if rows and max(map(len, map(_CHANGE, rows))) >= LARGE_ROW_CHARS:
        large = [row for row in rows if len(row[2]) >= LARGE_ROW_CHARS]
        rows = [row for row in rows if len(row[2]) < LARGE_ROW_CHARS]
        for row in large:
            sq.execute(statements.insert_large, (*row, True))
        sq.execute(statements.insert_large, (None, None, None, None, False))  # unbinds
    start, total, n = 0, len(rows), ROWS_PER_STATEMENT
    while start < total:
        while n > total - start:
            n //= 2
        end = start + (total - start) // n * n
        params = [list(chain.from_iterable(rows[i : i + n])) for i in range(start, end, n)]
        sq.executemany(statements.inserts[n], params)
        start = end


class ChangeTooLarge(sqlite3.DataError):
    """A change over SQLite's maximum length (``ChangeTooLargeError`` in the
    service; this module is the writer process's program and imports no app code)."""


def _insert_text(sq: sqlite3.Connection, statements: SqliteStatements, row: TextRow) -> None:
    """One row whose change is in pieces: each piece's UTF-8 into a staged blob,
    then one copy of the whole inside SQLite (no GIL held), then the blob goes.
    Only small values are bound, so no statement keeps the text (decision 42)."""
    watermark, pos, text, precommit = row
    size = text.utf8_length()
    limit = sq.getlimit(sqlite3.SQLITE_LIMIT_LENGTH)
    if size > limit:
        raise ChangeTooLarge(
            f"the change at watermark {watermark}, position {pos} is {size:,} bytes, "
            f"more than SQLite stores in one value ({limit:,})"
        )
    sq.execute(CREATE_STAGE)
    rowid = sq.execute(_STAGE_ZEROS, (size,)).lastrowid
    assert rowid is not None
    with sq.blobopen(STAGE_TABLE, "utf8", rowid, name="temp") as blob:
        for chunk in text.utf8():
            blob.write(chunk)
    sq.execute(statements.insert_staged, (watermark, pos, precommit, rowid))
    sq.execute(UNSTAGE, (rowid,))


class ReceivedText:
    """A change text as the pieces the parent sent: the writer process's ``Pieces``."""

    __slots__ = ("_parts",)

    def __init__(self, parts: list[str]) -> None:
        self._parts = parts

    def utf8(self) -> Iterator[bytes]:
        for part in self._parts:
            yield part.encode()

    def utf8_length(self) -> int:
        # An ASCII str knows its UTF-8 length; only the others are encoded twice.
        return sum(len(p) if p.isascii() else len(p.encode()) for p in self._parts)


def commit_rows(
    sq: sqlite3.Connection,
    statements: SqliteStatements,
    owner: str,
    rows: Sequence[PlainRow],
    last_watermark: str,
    texts: Sequence[TextRow] = (),
) -> str | None:
    """One write transaction; writes nothing unless ``owner`` still owns the log.
    Returns the owner found. ``sq`` must be in autocommit mode (isolation_level None).
    ``texts`` are rows whose change is in pieces (see ``split_texts``)."""
    sq.execute("BEGIN IMMEDIATE")
    try:
        row = sq.execute(statements.select_owner).fetchone()
        current: str | None = None if row is None else row[0]
        if current == owner:
            insert_rows(sq, statements, rows, texts)
            sq.execute(statements.set_head, (last_watermark,))
            sq.commit()
            return current
    except BaseException:
        sq.rollback()
        raise
    sq.rollback()
    return current


def encode_frame(value: tuple[object, ...] | str) -> bytes:
    """Header and body of one frame; ValueError if ``value`` is not plain data
    (e.g. a NamedTuple or a ``Pieces``, which marshal refuses)."""
    data = marshal.dumps(value, MARSHAL_VERSION)  # type: ignore[arg-type]
    return FRAME_HEADER.pack(len(data)) + data


def write_frame(sock: socket.socket, value: tuple[object, ...] | str) -> None:
    sock.sendall(encode_frame(value))


def read_frame(sock: socket.socket) -> object | None:
    """The next frame's value, or None at end of file."""
    head = _read_exactly(sock, FRAME_HEADER.size)
    if head is None:
        return None
    (size,) = FRAME_HEADER.unpack(head)
    data = _read_exactly(sock, size)
    if data is None:
        return None
    value: object = marshal.loads(data)
    return value


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return bytes(buf)


def connect(path: str, synchronous: str, busy_timeout_ms: int) -> sqlite3.Connection:
    """A writer connection configured as the service's engines configure theirs."""
    sq = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    sq.execute("PRAGMA journal_mode=WAL")
    sq.execute(f"PRAGMA synchronous={synchronous}")
    sq.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    sq.execute(TEMP_AUTO_VACUUM)
    return sq


def serve(sock: socket.socket, path: str, synchronous: str, busy_timeout_ms: int, sql: str) -> int:
    """The writer process: commits what the parent sends until it hangs up."""
    try:
        sq = connect(path, synchronous, busy_timeout_ms)
        statements = SqliteStatements.from_json(sql)
    except sqlite3.Error as e:
        write_frame(sock, ("error", type(e).__name__, str(e)))
        return 1
    write_frame(sock, ("ready",))
    with sq:
        while True:
            request = read_frame(sock)
            if request is None:
                return 0
            if not (
                isinstance(request, tuple)
                and len(request) in (4, 5)
                and request[0] == "commit_rows"
            ):
                write_frame(sock, ("error", "ProgrammingError", f"unknown request {request!r}"))
                continue
            _, owner, rows, last_watermark, *heads = request
            texts = _receive_texts(sock, heads[0]) if heads else ()
            if texts is None:
                return 0
            try:
                reply: tuple[object, ...] = (
                    "ok",
                    commit_rows(sq, statements, owner, rows, last_watermark, texts),
                )
            except sqlite3.Error as e:
                reply = ("error", type(e).__name__, str(e))
            write_frame(sock, reply)


def _receive_texts(
    sock: socket.socket, heads: list[tuple[str, int, str | None, int]]
) -> list[TextRow] | None:
    """The pieces that follow a request, as its rows in pieces; None at end of file."""
    texts: list[TextRow] = []
    for watermark, pos, precommit, count in heads:
        parts: list[str] = []
        for _ in range(count):
            part = read_frame(sock)
            if part is None:
                return None
            assert isinstance(part, str), f"a piece of a change text, not {type(part)}"
            parts.append(part)
        texts.append((watermark, pos, ReceivedText(parts), precommit))
    return texts


def main(argv: list[str]) -> int:
    # Ctrl-C reaches the whole process group; the parent decides when we stop
    # (it hangs up), so a commit in hand is never cut short by the signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd, path, synchronous, busy_timeout_ms, sql = argv
    with socket.socket(fileno=int(fd)) as sock:
        try:
            return serve(sock, path, synchronous, int(busy_timeout_ms), sql)
        except (BrokenPipeError, ConnectionResetError):
            # The parent died (even by SIGKILL) while we were answering or reading:
            # the commit in hand is done or never began; nobody is left to tell.
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
