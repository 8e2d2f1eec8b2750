"""Large changes in pieces: stored and read back without the service holding them whole.

A change text too large to hold whole travels as ``Pieces`` (decision 44). Every
write path (the SQLite writer process, aiosqlite's thread, a write transaction's
``append``, Postgres' COPY) takes it as it is, and ``read(pieces_over=N)`` gives
back every change longer than N characters as ``Pieces``: the same characters,
cut into pieces of at most ``PIECE_CHARS``. Without ``pieces_over`` reads are as
they always were: one ``str`` per change.
"""

from __future__ import annotations

import asyncio
import sqlite3
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.protocol.pieces import LARGE_TEXT_CHARS, PIECE_CHARS, Pieces, Text, text_pieces
from app.stop_signals import AbortError
from app.storage import (
    ChangeDb,
    ChangeLog,
    Replication,
    StoredRow,
    SubscriptionState,
    fastpath,
    sqlite_group,
)
from app.storage.errors import ChangeTooLargeError
from app.storage.fastpath import copy_escape
from app.storage.sqlite_group import SqliteStatements
from app.storage.sqlite_writer import _result

OWNER = "task-a"
MB = 1 << 20

Write = Callable[[ChangeLog, list[StoredRow], str], Awaitable[None]]


async def by_commit_rows(log: ChangeLog, rows: list[StoredRow], last: str) -> None:
    """The storer's common group commit: the writer process, or aiosqlite's thread."""
    await log.commit_rows(OWNER, rows, last)


async def by_append(log: ChangeLog, rows: list[StoredRow], last: str) -> None:
    """A write transaction of the service (a big transaction's, or one with bookkeeping)."""
    async with log.write(OWNER) as w:
        await w.append(rows)
        w.set_last_watermark(last)


WRITES = [pytest.param(by_commit_rows, id="commit_rows"), pytest.param(by_append, id="append")]


async def owned_log(db: ChangeDb) -> ChangeLog:
    replication = Replication(db)
    await replication.ensure_config(SubscriptionState("01", ("pub",), "01"), auto_reset=False)
    await replication.assume_ownership(OWNER, "127.0.0.1:4849")
    return ChangeLog(db)


@pytest.fixture
async def log(db: ChangeDb) -> ChangeLog:
    return await owned_log(db)


def big_json(megabytes: int) -> str:
    """A JSON text of about that many MB, with what COPY must escape (backslashes
    from JSON's own escapes; tabs, newlines and CRs as whitespace between tokens)."""
    cell = '{"s":"say \\"hi\\" \\\\ back\\\\slash \\n",\t"n":123456789,\r\n"t":"xyzzy"}'
    return '{"tag":"insert","new":[' + ",".join([cell] * (megabytes * MB // len(cell))) + "]}"


def multibyte_json(chars: int) -> str:
    """JSON of two-, three- and four-byte characters: their UTF-8 crosses every cut."""
    return '{"tag":"insert","new":{"v":"' + "aé€😀" * (chars // 4) + '"}}'


def pieces(text: str, size: int = PIECE_CHARS) -> Pieces:
    cut = text_pieces(text, size)
    assert isinstance(cut, Pieces)
    return cut


def whole(text: Text) -> str:
    return text if isinstance(text, str) else "".join(text.parts)


def tx(watermark: str, *changes: Text) -> list[StoredRow]:
    """An upstream transaction's rows, as the storer builds them."""
    rows: list[StoredRow] = [(watermark, 0, '{"tag":"begin"}', None)]
    rows += [(watermark, i, c, None) for i, c in enumerate(changes, start=1)]
    rows.append((watermark, len(changes) + 1, '{"tag":"commit"}', watermark))
    return rows


async def read_all(log: ChangeLog, **kw: Any) -> list[StoredRow]:
    out: list[StoredRow] = []
    async for batch in log.read("02", "zz", **kw):
        out.extend(batch)
    return out


def assert_pieces(text: Text, expected: str) -> None:
    assert isinstance(text, Pieces)
    assert max(map(len, text.parts)) <= PIECE_CHARS
    assert len(text) == len(expected)
    assert whole(text) == expected


@pytest.mark.parametrize("write", WRITES)
async def test_a_large_change_in_pieces_is_stored_and_read_back_in_pieces(
    log: ChangeLog, write: Write
) -> None:
    big, wide = big_json(20), multibyte_json(3 * LARGE_TEXT_CHARS + 5)
    # Pieces cut a character short of PIECE_CHARS: where the reads cut differs.
    rows = tx("02", '{"tag":"w"}', pieces(big), '{"tag":"x"}', pieces(wide, PIECE_CHARS - 1))
    rows += tx("03", '{"tag":"y"}')
    await write(log, rows, "03")

    expected = [(r[0], r[1], whole(r[2]), r[3]) for r in rows]
    for batch_size in (2, 3, 2000):  # the large ones first, last and amid a batch
        got = await read_all(log, batch_size=batch_size, pieces_over=LARGE_TEXT_CHARS)
        assert [(r[0], r[1], r[3]) for r in got] == [(r[0], r[1], r[3]) for r in expected]
        assert_pieces(got[2][2], big)
        assert_pieces(got[4][2], wide)
        assert [r[2] for r in got[:2] + got[3:4] + got[5:]] == [
            r[2] for r in expected[:2] + expected[3:4] + expected[5:]
        ]
    # Without pieces_over every change is one str, as the replica follower reads them.
    assert await read_all(log) == expected
    state = await Replication(log.db).state()
    assert state is not None
    assert state.last_watermark == "03"


async def test_pieces_over_counts_characters_not_bytes(log: ChangeLog) -> None:
    short = '"' + "é" * 20 + '"'  # 22 characters, 42 bytes of UTF-8
    long = '"' + "é" * 30 + '"'  # 32 characters
    await log.commit_rows(OWNER, tx("02", short, long), "02")
    got = [r[2] for r in await read_all(log, pieces_over=30)]
    assert got[:2] == ['{"tag":"begin"}', short]  # more bytes than 30, not more characters
    assert isinstance(got[2], Pieces)
    assert whole(got[2]) == long
    assert got[3] == '{"tag":"commit"}'
    assert [r[2] for r in await read_all(log, pieces_over=32)][1:3] == [short, long]


async def test_small_changes_in_pieces_are_stored_too(log: ChangeLog) -> None:
    # A Pieces may be short (a large message's change, trimmed of its envelope).
    text = '{"tag":"insert",\t"new":{"s":"a\\tb\\\\c"}\r\n}'
    rows = tx("02", Pieces([text[:7], text[7:20], text[20:]]), text)
    await log.commit_rows(OWNER, rows, "02")
    async with log.write(OWNER) as w:
        await w.append(tx("03", Pieces([text[:1], text[1:]])))
    assert [r[2] for r in await read_all(log)] == [whole(r[2]) for r in rows] + [
        r[2] for r in tx("03", text)
    ]


@contextmanager
def no_whole_text(limit: int) -> Iterator[None]:
    """Fails if the code inside joins a ``Pieces`` or allocates ``limit`` bytes of
    Python objects at once (a whole text, however it was put together)."""
    joins: list[int] = []

    def join(self: Pieces) -> str:
        joins.append(len(self))
        raise AssertionError("Pieces.join in the service process")

    original = Pieces.join
    Pieces.join = join  # type: ignore[method-assign]
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        Pieces.join = original  # type: ignore[method-assign]
    assert joins == []
    assert peak < limit, f"{peak} bytes allocated at once"


@pytest.mark.parametrize("write", WRITES)
async def test_writes_never_make_the_text_whole_in_the_service(
    log: ChangeLog, write: Write
) -> None:
    text = big_json(20)
    rows = tx("02", pieces(text))
    with no_whole_text(len(text) // 4):
        await write(log, rows, "02")
    got = await read_all(log)
    assert got[1][2] == text


async def test_reads_in_pieces_never_make_the_text_whole(log: ChangeLog) -> None:
    text = big_json(20)
    await log.commit_rows(OWNER, tx("02", pieces(text)), "02")
    # The pieces themselves are the text's size; a whole copy on top would double it.
    with no_whole_text(len(text) * 3 // 2):
        got = await read_all(log, pieces_over=LARGE_TEXT_CHARS)
    assert_pieces(got[1][2], text)


async def test_a_commit_cancelled_while_sending_pieces_stores_nothing_of_it(
    sqlite_db: ChangeDb,
) -> None:
    # Cancelled while the writer process is still being sent its pieces (each one
    # lets the loop run): the process is stopped, nothing of the transaction is
    # stored, and the next commit (a new process) is whole.
    log = await owned_log(sqlite_db)
    await log.start_writer()
    text = big_json(20)
    task = asyncio.ensure_future(log.commit_rows(OWNER, tx("02", pieces(text)), "02"))
    for _ in range(8):
        await asyncio.sleep(0)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await log.commit_rows(OWNER, tx("03", pieces(text)), "03")
    got = await read_all(log)
    assert [r[:2] for r in got] == [("03", 0), ("03", 1), ("03", 2)]
    assert got[1][2] == text


async def test_sqlite_readers_keep_no_staged_text_and_no_transaction(
    sqlite_db: ChangeDb,
) -> None:
    log = await owned_log(sqlite_db)
    text = big_json(4)
    await log.commit_rows(OWNER, tx("02", pieces(text), pieces(text)), "02")
    reads = [read_all(log, pieces_over=LARGE_TEXT_CHARS) for _ in range(3)]
    for got in await asyncio.gather(*reads):
        assert_pieces(got[1][2], text)
    size = sqlite_db.reader.pool.size()  # type: ignore[attr-defined]
    conns = [await sqlite_db.reader.connect() for _ in range(size)]
    try:
        for r in conns:
            driver: Any = (await r.get_raw_connection()).driver_connection
            assert not driver._conn.in_transaction
            staged = await driver.execute_fetchall(
                "SELECT count(*) FROM temp.sqlite_schema WHERE name = 'changeText'", ()
            )
            if staged == [(1,)]:  # a reader that read a large change: its blobs are gone
                assert await driver.execute_fetchall(
                    'SELECT count(*) FROM temp."changeText"', ()
                ) == [(0,)]
                # temp.auto_vacuum gave the staged pages back.
                pages = await driver.execute_fetchall("PRAGMA temp.page_count", ())
                assert pages[0][0] < 16
    finally:
        for r in conns:
            await r.close()


# COPY's text format, escaped a piece at a time, is the whole text escaped.
COPY_TEXT = st.text(alphabet=st.sampled_from(list('ab"\\\n\t\r\x08é€😀')), min_size=1)


@given(COPY_TEXT, st.lists(st.integers(1, 9), max_size=6))
def test_copy_escaping_piece_by_piece_is_escaping_the_whole(text: str, sizes: list[int]) -> None:
    parts: list[str] = []
    at = 0
    for n in sizes:
        parts.append(text[at : at + n])
        at += n
    parts.append(text[at:])
    assert "".join(map(copy_escape, parts)) == copy_escape(text)
    assert not {"\t", "\n", "\r"} & set(copy_escape(text))


def test_sqlite_refuses_a_change_over_its_length_limit_by_name() -> None:
    """What the writer process and aiosqlite's thread run: a change SQLite cannot
    hold is refused before anything of it is staged (SQLite's compiled-in maximum
    is 10^9 bytes; lowered here so the test stays small)."""
    sq = sqlite_group.connect(":memory:", "OFF", 1000)
    statements = SqliteStatements.for_tables('"changeLog"', '"replicationState"')
    sq.execute(
        'CREATE TABLE "changeLog" (watermark TEXT, pos INT, change TEXT, precommit TEXT,'
        " PRIMARY KEY (watermark, pos)) WITHOUT ROWID"
    )
    sq.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 4096)
    plain, texts = sqlite_group.split_texts([("02", 1, cut("é" * 3000), None)])
    with pytest.raises(sqlite_group.ChangeTooLarge, match=r"02, position 1 is 6,000 bytes.*4,096"):
        sqlite_group.insert_rows(sq, statements, plain, texts)
    assert sq.execute('SELECT count(*) FROM "changeLog"').fetchone() == (0,)


def test_the_writer_process_reply_for_it_stops_the_service() -> None:
    with pytest.raises(ChangeTooLargeError, match="more than SQLite") as e:
        _result(("error", "ChangeTooLarge", "the change ... more than SQLite stores"))
    assert isinstance(e.value, AbortError)  # the service stops instead of retrying


async def test_postgres_refuses_a_change_over_a_copy_line_by_name(
    db: ChangeDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    if db.dialect != "postgresql":
        pytest.skip("the COPY line limit is Postgres'")
    log = await owned_log(db)
    monkeypatch.setattr(fastpath, "_PG_MAX_LINE", 5000)
    for text in ("x" * 6000, "\n" * 3000):  # too long as it is; too long once escaped
        with pytest.raises(ChangeTooLargeError, match="more than Postgres takes"):
            await by_append(log, tx("02", cut(text)), "02")
    assert await read_all(log) == []


def cut(text: str, size: int = 1000) -> Pieces:
    """A small text as Pieces (``pieces`` cuts only large ones)."""
    return Pieces(text[i : i + size] for i in range(0, len(text), size))
