"""SQLite's writer process: group commits in a process of their own.

Every test here kills or cancels only the writer process it started itself. The
ordinary behaviour of ``commit_rows`` (rows, head, ownership, duplicates) is in
test_changelog.py, which runs with the process and with the thread.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from app.protocol.pieces import PIECE_CHARS, text_pieces
from app.storage import (
    ChangeDb,
    ChangeLog,
    ChangeRow,
    Replication,
    StoredRow,
    SubscriptionState,
    sqlite_group,
    sqlite_writer,
)
from app.storage.sqlite_group import SqliteStatements
from app.storage.sqlite_writer import SqliteWriterError, SqliteWriterProcess
from tests import sqlite_memory
from tests.waiting import eventually

OWNER = "task-a"


def tx(watermark: str, changes: int) -> list[ChangeRow]:
    rows = [ChangeRow(watermark, 0, '{"tag":"begin"}')]
    rows += [ChangeRow(watermark, i, f'{{"tag":"insert","n":{i}}}') for i in range(1, changes + 1)]
    rows.append(ChangeRow(watermark, changes + 1, '{"tag":"commit"}', watermark))
    return rows


@pytest.fixture
async def log(sqlite_db: ChangeDb) -> ChangeLog:
    replication = Replication(sqlite_db)
    await replication.ensure_config(SubscriptionState("01", ("pub",), "01"), auto_reset=False)
    await replication.assume_ownership(OWNER, "127.0.0.1:4849")
    return ChangeLog(sqlite_db)


def writer(log: ChangeLog) -> SqliteWriterProcess:
    w = log.db.sqlite_writer
    assert w is not None
    return w


async def stored(log: ChangeLog) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    async for batch in log.read("00", "zz"):
        out.extend((r[0], r[1]) for r in batch)
    return out


async def wait_gone(pid: int) -> None:
    """Until the process no longer exists (asyncio's child watcher reaps it)."""

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    await eventually(gone, f"process {pid} to be gone", 4, poll_s=0.02)


async def test_commits_run_in_one_process_that_close_ends(log: ChangeLog) -> None:
    await log.commit_rows(OWNER, tx("02", 3), "02")
    await log.commit_rows(OWNER, tx("03", 1), "03")
    w = writer(log)
    pid = w.pid
    assert pid is not None
    assert pid != os.getpid()
    assert w.starts == 1
    assert [k for k in await stored(log) if k[0] != "01"] == [
        *(("02", p) for p in range(5)),
        *(("03", p) for p in range(3)),
    ]
    await log.db.sqlite_writer.close()  # type: ignore[union-attr]
    assert w.pid is None
    await wait_gone(pid)


async def committed_then_writer_killed(log: ChangeLog) -> int:
    """Transaction 02 stored, then the writer process SIGKILLed and gone: its pid."""
    await log.commit_rows(OWNER, tx("02", 2), "02")
    pid = writer(log).pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await wait_gone(pid)
    return pid


async def test_a_killed_writer_loses_nothing_and_the_next_commit_restarts_it(
    log: ChangeLog,
) -> None:
    pid = await committed_then_writer_killed(log)
    w = writer(log)
    # The first commit after the kill either finds the process gone (and starts a
    # new one) or meets its closed socket and fails, storing nothing; a retry,
    # as the service makes, succeeds. Either way 03 is stored once.
    try:
        await log.commit_rows(OWNER, tx("03", 2), "03")
    except SqliteWriterError:
        await log.commit_rows(OWNER, tx("03", 2), "03")
    assert w.starts == 2
    assert w.pid not in (None, pid)
    keys = [k for k in await stored(log) if k[0] != "01"]
    assert keys == [*(("02", p) for p in range(4)), *(("03", p) for p in range(4))]
    state = await Replication(log.db).state()
    assert state is not None
    assert state.last_watermark == "03"


async def test_a_commit_cancelled_in_flight_does_not_confuse_the_next_one(
    log: ChangeLog,
) -> None:
    big = [row for n in range(2, 40) for row in tx(f"02{n:04d}", 200)]
    await log.start_writer()
    task = asyncio.ensure_future(log.commit_rows(OWNER, big, "020039"))
    await asyncio.sleep(0)  # the request is written; the reply is pending
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The cancelled commit's process was stopped: whatever it did is whole or
    # absent, and its late reply is never read as the next commit's.
    await log.commit_rows(OWNER, tx("03", 1), "03")
    keys = [k for k in await stored(log) if k[0] != "01"]
    assert keys[-3:] == [("03", 0), ("03", 1), ("03", 2)]
    assert len(keys) in (3, len(big) + 3)
    assert writer(log).starts == 2


async def test_a_start_cancelled_midway_leaves_nothing_behind(log: ChangeLog) -> None:
    w = writer(log)
    for delay in (0, 0.001, 0.003):  # all shorter than a Python start-up
        task = asyncio.ensure_future(w.start())
        await asyncio.sleep(delay)  # the point: cancelled at different moments of the start
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert w.pid is None
    # Sockets are closed (the ResourceWarning check would fail the test) and
    # the next commit starts a working process.
    await log.commit_rows(OWNER, tx("02", 1), "02")
    assert ("02", 2) in await stored(log)


async def test_a_file_the_process_cannot_open_is_a_clear_error(tmp_path: Path) -> None:
    w = SqliteWriterProcess(
        str(tmp_path / "missing" / "cdc.db"),
        SqliteStatements.for_tables('"changeLog"', '"replicationState"'),
        synchronous="FULL",
        busy_timeout_ms=1000,
    )
    with pytest.raises(sqlite3.OperationalError, match="unable to open database file"):
        await w.start()
    assert w.pid is None
    await w.close()


async def test_a_missing_table_comes_back_as_the_sqlite_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    sqlite3.connect(path).close()
    w = SqliteWriterProcess(
        str(path),
        SqliteStatements.for_tables('"changeLog"', '"replicationState"'),
        synchronous="FULL",
        busy_timeout_ms=1000,
    )
    try:
        with pytest.raises(sqlite3.OperationalError, match="no such table: replicationState"):
            await w.commit_rows(OWNER, tx("02", 1), "02")
        # An error answered in-band keeps the process: it serves the next request.
        assert w.pid is not None
        assert w.starts == 1
    finally:
        await w.close()


async def test_a_commit_that_takes_too_long_stops_the_process(log: ChangeLog) -> None:
    w = SqliteWriterProcess(
        str(log.db.url.database),
        SqliteStatements.for_tables('"changeLog"', '"replicationState"'),
        synchronous="FULL",
        busy_timeout_ms=5000,
        commit_timeout_s=0.2,
    )
    blocker = sqlite3.connect(str(log.db.url.database), isolation_level=None)
    try:
        await w.start()
        pid = w.pid
        assert pid is not None
        blocker.execute("BEGIN IMMEDIATE")  # holds the write lock: the commit waits
        with pytest.raises(SqliteWriterError, match="did not commit within"):
            await w.commit_rows(OWNER, tx("02", 1), "02")
        assert w.pid is None
        blocker.execute("ROLLBACK")
        await wait_gone(pid)
    finally:
        blocker.close()
        await w.close()
    assert ("02", 0) not in await stored(log)


async def test_a_parent_gone_mid_commit_ends_the_process_quietly(log: ChangeLog) -> None:
    # As after a SIGKILL of serve: the parent's end closes while a commit is in hand,
    # so the answer cannot be written. The process stops, with no traceback.
    w = writer(log)
    args = [w._path, w._synchronous, str(w._busy_timeout_ms), w._statements.to_json()]
    returncode, stderr = await asyncio.to_thread(hang_up_mid_commit, args)
    assert returncode == 0, stderr
    assert "Traceback" not in stderr


def started_writer(args: list[str]) -> tuple[socket.socket, subprocess.Popen[str]]:
    """The writer program on a socket pair, once it said it is ready: our end, it."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-I", sqlite_writer._PROGRAM, str(theirs.fileno()), *args],
        pass_fds=(theirs.fileno(),),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    assert sqlite_group.read_frame(ours) == ("ready",)
    return ours, proc


def hang_up_mid_commit(args: list[str]) -> tuple[int, str]:
    """Starts the writer program, sends one commit and closes our end at once."""
    ours, proc = started_writer(args)
    rows = [tuple(r) for r in tx("02", 2000)]
    sqlite_group.write_frame(ours, ("commit_rows", OWNER, rows, "02"))
    ours.shutdown(socket.SHUT_RDWR)
    ours.close()
    _, stderr = proc.communicate(timeout=30)
    return proc.returncode, stderr


def test_insert_rows_lets_go_of_a_large_value(tmp_path: Path) -> None:
    # sqlite3 keeps a cached statement's last bindings (SQLite's copy of each
    # value) until the statement runs again: a large row goes through its own
    # statement, which is then run with NULLs.
    sqlite_memory.probe()
    statements = SqliteStatements.for_tables('"changeLog"', '"replicationState"')
    sq = sqlite3.connect(tmp_path / "c.db", isolation_level=None)
    sq.execute(
        'CREATE TABLE "changeLog" (watermark TEXT, pos INT, change TEXT, precommit TEXT,'
        " PRIMARY KEY (watermark, pos))"
    )
    large = "x" * (8 << 20)
    rows = [("01", 0, '{"tag":"begin"}', None), ("01", 1, large, None), ("01", 2, "{}", "01")]
    before = sqlite_memory.memory_used()
    sqlite_group.insert_rows(sq, statements, rows)
    assert sqlite_memory.memory_used() - before < 4 << 20  # the page cache, not the value
    got = sq.execute('SELECT pos, length(change) FROM "changeLog" ORDER BY pos').fetchall()
    assert got == [(0, 15), (1, 8 << 20), (2, 2)]
    # The control: the large row by the one-row statement of the small rows.
    sq.execute('DELETE FROM "changeLog"')
    before = sqlite_memory.memory_used()
    sq.execute(statements.inserts[1], rows[1])
    assert sqlite_memory.memory_used() - before >= 8 << 20
    sq.close()


def test_insert_rows_keeps_no_copy_of_a_text_in_pieces(tmp_path: Path) -> None:
    # A text in pieces is staged in a TEMP blob and copied inside SQLite: no
    # statement binds it (decision 42), and the staged blob is deleted, its pages
    # given back (temp.auto_vacuum).
    sqlite_memory.probe()
    statements = SqliteStatements.for_tables('"changeLog"', '"replicationState"')
    sq = sqlite_group.connect(str(tmp_path / "c.db"), "FULL", 1000)
    sq.execute(
        'CREATE TABLE "changeLog" (watermark TEXT, pos INT, change TEXT, precommit TEXT,'
        " PRIMARY KEY (watermark, pos)) WITHOUT ROWID"
    )
    text = "é€😀x" * (2 << 20)
    parts = [text[i : i + 100_003] for i in range(0, len(text), 100_003)]
    texts = [("01", 1, sqlite_group.ReceivedText(parts), None)]
    rows = [("01", 0, '{"tag":"begin"}', None), ("01", 2, "{}", "01")]
    before = sqlite_memory.memory_used()
    sqlite_group.insert_rows(sq, statements, rows, texts)
    assert sqlite_memory.memory_used() - before < 4 << 20  # the page caches, not the text
    assert sq.execute('SELECT count(*) FROM temp."changeText"').fetchone() == (0,)
    assert sq.execute("PRAGMA temp.page_count").fetchone()[0] < 16
    got = sq.execute('SELECT pos, change FROM "changeLog" ORDER BY pos').fetchall()
    assert got == [(0, '{"tag":"begin"}'), (1, text), (2, "{}")]
    sq.close()


async def test_a_parent_gone_while_sending_pieces_ends_the_process_quietly(
    log: ChangeLog,
) -> None:
    w = writer(log)
    args = [w._path, w._synchronous, str(w._busy_timeout_ms), w._statements.to_json()]
    returncode, stderr = await asyncio.to_thread(hang_up_mid_pieces, args)
    assert returncode == 0, stderr
    assert "Traceback" not in stderr
    assert ("02", 1) not in await stored(log)


def hang_up_mid_pieces(args: list[str]) -> tuple[int, str]:
    """Starts the writer program, sends a commit whose text is announced in three
    pieces, sends one and closes our end."""
    ours, proc = started_writer(args)
    rows = [("02", 0, '{"tag":"begin"}', None), ("02", 2, '{"tag":"commit"}', "02")]
    sqlite_group.write_frame(ours, ("commit_rows", OWNER, rows, "02", [("02", 1, None, 3)]))
    sqlite_group.write_frame(ours, '{"tag":"insert",')
    ours.shutdown(socket.SHUT_RDWR)
    ours.close()
    _, stderr = proc.communicate(timeout=30)
    return proc.returncode, stderr


async def test_a_killed_writer_is_a_storage_error_for_a_commit_in_pieces_too(
    log: ChangeLog,
) -> None:
    await committed_then_writer_killed(log)
    w = writer(log)
    text = '{"tag":"insert","new":{"v":"' + "x" * (4 * PIECE_CHARS) + '"}}'
    rows: list[StoredRow] = [
        ("03", 0, '{"tag":"begin"}', None),
        ("03", 1, text_pieces(text), None),
        ("03", 2, '{"tag":"commit"}', "03"),
    ]
    # As for plain rows: the process is found gone, or its socket closed (a
    # SqliteWriterError the service retries); the retry stores the text once.
    try:
        await log.commit_rows(OWNER, rows, "03")
    except SqliteWriterError:
        await log.commit_rows(OWNER, rows, "03")
    assert w.starts == 2
    got = [r async for batch in log.read("03", "03") for r in batch]
    assert [r[:2] for r in got] == [("03", 0), ("03", 1), ("03", 2)]
    assert got[1][2] == text
