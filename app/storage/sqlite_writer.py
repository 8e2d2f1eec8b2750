"""The SQLite writer process: group commits off the event loop's GIL.

A group commit on SQLite is mostly work that holds the GIL — flattening and
binding four parameters per row — and SQLite's own CPU. In aiosqlite's thread
both compete with the event loop for the GIL and a core; in a process of their
own they run on the other core beside it (docs/benchmarks.md). Only the common
group commit (``ChangeLog.commit_rows``: plain rows and ``lastWatermark`` under
the ownership check) goes there; everything else —
migrations, config, purge, schema-change bookkeeping, a big transaction's own
database transaction — stays on the in-process engines, and SQLite's locks
(``BEGIN IMMEDIATE``, ``busy_timeout``) order the two writers; the storer never
has both open at once.

A change text in pieces (``Pieces``) is sent after its request one piece per
frame, with the event loop running between pieces, and the process stages it
in SQLite without joining it (``sqlite_group``): no call here touches a large
value whole (decision 44).

The process is started when the storer starts (or on first use) and restarted
on the next use after it failed. A commit that times out, a process that exits,
a request cancelled mid-way (its reply would otherwise be read as the next
one's) all end the process, killed at once (SQLite keeps a transaction whole or
not at all), and the request raises ``SqliteWriterError`` (or the cancellation):
a ``StorageError`` the service retries with backoff like any other storage
failure. Waits are bounded: the start-up by ``start_timeout_s``, each commit by
``commit_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import socket
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from app.child_env import child_env
from app.private_files import create_private
from app.protocol.pieces import Pieces, Text
from app.storage import sqlite_group
from app.storage.errors import ChangeTooLargeError, DuplicateChangeError, StorageError
from app.storage.sqlite_group import FRAME_HEADER, SqliteStatements, encode_frame
from app.timeouts import within

__all__ = ["SqliteWriterError", "SqliteWriterProcess"]

log = logging.getLogger(__name__)

_PROGRAM: Final = str(Path(sqlite_group.__file__).resolve())
STOP_TIMEOUT_S: Final = 5.0


class SqliteWriterError(StorageError):
    """The writer process failed, exited or did not answer in time."""


class SqliteWriterProcess:
    """One change DB file's writer process, as seen from the event loop."""

    def __init__(
        self,
        path: str,
        statements: SqliteStatements,
        *,
        synchronous: str,
        busy_timeout_ms: int,
        start_timeout_s: float = 30.0,
        commit_timeout_s: float = 120.0,
    ) -> None:
        self._path = path
        self._statements = statements
        self._synchronous = synchronous
        self._busy_timeout_ms = busy_timeout_ms
        self._start_timeout_s = start_timeout_s
        self._commit_timeout_s = commit_timeout_s
        self._lock = asyncio.Lock()
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.starts = 0  # processes started, for /statz and the tests

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def commit_rows(
        self, owner: str, rows: Sequence[tuple[str, int, Text, str | None]], last_watermark: str
    ) -> str | None:
        """``sqlite_group.commit_rows`` in the writer process; returns the owner found.

        A change text in pieces follows the request one piece per frame, the
        event loop running between them: nothing here touches the whole text."""
        texts: Sequence[Pieces] = ()
        try:
            request = encode_frame(("commit_rows", owner, rows, last_watermark))
        except ValueError:
            # Rows that are NamedTuples (ChangeRow), or whose change is in pieces:
            # marshal takes plain tuples of plain values.
            request, texts = _request_apart(owner, rows, last_watermark)
        self._follow_loop()
        async with self._lock:
            reader, writer = await self._started()
            try:
                writer.write(request)
                reply = await within(_send_and_read(reader, writer, texts), self._commit_timeout_s)
            except TimeoutError:
                await self._discard(kill=True)
                raise SqliteWriterError(
                    f"the SQLite writer did not commit within {self._commit_timeout_s:.0f} s; "
                    "it was stopped"
                ) from None
            except BaseException:
                # Cancelled, or the process went away: its reply (if any) must not
                # be taken for the next request's. Killing it mid-commit is safe:
                # SQLite keeps a transaction whole or not at all.
                await self._discard(kill=True)
                raise
        return _result(reply)

    async def start(self) -> None:
        """Starts the process now rather than at the first commit (a no-op if running)."""
        self._follow_loop()
        async with self._lock:
            await self._started()

    async def close(self) -> None:
        """Hangs up (the process exits after the commit in hand) and waits for it."""
        self._follow_loop()
        async with self._lock:
            await self._discard()

    def _follow_loop(self) -> None:
        """Streams and locks belong to one event loop. Used from another (the
        CLI's set-up loop, then the server's), the old process is hung up on
        without waiting (asyncio's child watcher reaps it) and a new one starts."""
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop is loop:
            return
        if self._sock is not None:
            self._sock.close()
        self._proc = self._reader = self._writer = self._sock = None
        self._loop = None
        self._lock = asyncio.Lock()

    async def _started(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._proc is not None and self._proc.returncode is None:
            assert self._reader is not None
            assert self._writer is not None
            return self._reader, self._writer
        await self._discard()
        create_private(self._path)  # if the engines have not yet: it holds every change
        ours, theirs = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",  # stdlib only: no site-packages, no environment, no script dir
                _PROGRAM,
                str(theirs.fileno()),
                self._path,
                self._synchronous,
                str(self._busy_timeout_ms),
                self._statements.to_json(),
                pass_fds=(theirs.fileno(),),
                env=child_env(),  # it reads no variable: none of our secrets either
                stdin=asyncio.subprocess.DEVNULL,
            )
        except BaseException as e:
            # Also a cancellation: a child already forked reads end of file and exits.
            ours.close()
            if isinstance(e, OSError):
                raise SqliteWriterError(f"cannot start the SQLite writer process: {e}") from e
            raise
        finally:
            theirs.close()
        self._proc, self._sock, self._loop = proc, ours, asyncio.get_running_loop()
        self.starts += 1
        try:
            self._reader, self._writer = await asyncio.open_connection(sock=ours)
            hello = await within(_read_frame(self._reader), self._start_timeout_s)
        except BaseException as e:
            await self._discard()
            if isinstance(e, (TimeoutError, asyncio.IncompleteReadError)):
                raise SqliteWriterError("the SQLite writer process did not start") from e
            raise
        if hello != ("ready",):
            await self._discard()
            _result(hello)  # raises the child's error opening the file
            raise SqliteWriterError(f"the SQLite writer process said {hello!r}")
        log.debug("SQLite writer process %s for %s", proc.pid, self._path)
        return self._reader, self._writer

    async def _discard(self, *, kill: bool = False) -> None:
        """Hangs up on the process and waits for it to exit (at once with ``kill``)."""
        proc, writer, sock = self._proc, self._writer, self._sock
        self._proc = self._reader = self._writer = self._sock = None
        self._loop = None
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        elif sock is not None:
            sock.close()
        if proc is None:
            return
        if not kill:
            with contextlib.suppress(TimeoutError):
                await within(proc.wait(), STOP_TIMEOUT_S)
            if proc.returncode is None:
                log.warning("SQLite writer process %s did not exit; killing it", proc.pid)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            try:
                await within(proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                log.error("SQLite writer process %s survived SIGKILL; leaving it", proc.pid)


def _request_apart(
    owner: str, rows: Sequence[tuple[str, int, Text, str | None]], last_watermark: str
) -> tuple[bytes, list[Pieces]]:
    """The request with the rows in pieces apart (``sqlite_group``'s module doc),
    and their texts, to send after it."""
    plain: list[tuple[str, int, str, str | None]] = []
    heads: list[tuple[str, int, str | None, int]] = []
    texts: list[Pieces] = []
    for watermark, pos, change, precommit in rows:
        if isinstance(change, str):
            plain.append((watermark, pos, change, precommit))
        else:
            heads.append((watermark, pos, precommit, len(change.parts)))
            texts.append(change)
    if not heads:
        return encode_frame(("commit_rows", owner, plain, last_watermark)), texts
    return encode_frame(("commit_rows", owner, plain, last_watermark, heads)), texts


async def _send_and_read(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, texts: Sequence[Pieces]
) -> object:
    """Sends the pieces of ``texts`` (the request went first), then reads the reply."""
    try:
        for text in texts:
            for part in text.parts:
                writer.write(encode_frame(part))
                await writer.drain()  # waits only while the socket is full...
                await asyncio.sleep(0)  # ...so let the loop run between pieces anyway
    except ConnectionError as e:
        raise SqliteWriterError("the SQLite writer process exited") from e
    return await _read_frame(reader)


async def _read_frame(reader: asyncio.StreamReader) -> object:
    try:
        head = await reader.readexactly(FRAME_HEADER.size)
        (size,) = FRAME_HEADER.unpack(head)
        value: object = marshal.loads(await reader.readexactly(size))
        return value
    except asyncio.IncompleteReadError as e:
        raise SqliteWriterError("the SQLite writer process exited") from e


def _result(reply: object) -> str | None:
    match reply:
        case ("ok", owner) if owner is None or isinstance(owner, str):
            return owner
        case ("error", "IntegrityError", str(message)):
            raise DuplicateChangeError.from_driver(message)
        case ("error", "ChangeTooLarge", str(message)):
            raise ChangeTooLargeError(message)
        case ("error", str(name), str(message)):
            error = getattr(sqlite3, name, None)
            if isinstance(error, type) and issubclass(error, sqlite3.Error):
                raise error(message)
            raise SqliteWriterError(f"{name}: {message}")
    raise SqliteWriterError(f"unexpected reply from the SQLite writer: {reply!r}")
