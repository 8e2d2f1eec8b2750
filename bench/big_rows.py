"""A large change through the change log: how long the event loop stalls.

    python -m bench.big_rows                       # 100 MB; every backend
    python -m bench.big_rows --size-mb 20 --backends sqlite-process

For each backend it writes one transaction whose middle change is a JSON text of
``--size-mb`` MB (with what COPY must escape, and two- to four-byte characters
in part of it), then reads the transaction back, while a task on the same
event loop sleeps 1 ms at a time and records how late it wakes: the worst is
the longest stall every subscriber would have seen. Each row of the table is
one write or read:

* ``Pieces``: the change as ``Pieces`` (how the streamer hands a large one to
  the storer), read back with ``pieces_over`` (how catch-ups read);
* ``str``: the same change as one string, read back whole: what every path did
  before (``--no-str`` leaves these out).

Backends: ``sqlite-process`` (group commits in the writer process, the
default), ``sqlite-thread`` (in aiosqlite's thread, as a big transaction's own
database transaction and ``CHANGESTREAMER_SQLITE_WRITER=thread`` write), and
``postgres`` (COPY; a fresh ``bench_big_<n>/cdc`` schema in ``--pg-url``).
The switch interval and glibc's mmap threshold are serve's (0.5 ms, 1 MiB).
Times are wall-clock seconds; on a shared machine a stall of a few ms is the
scheduler's, not ours (the idle loop's worst wake-up is printed first).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import text

from app.protocol.pieces import LARGE_TEXT_CHARS, Pieces, Text, text_pieces
from app.runtime.memory import return_large_frees
from app.storage import (
    ChangeDb,
    ChangeDbOptions,
    Shard,
    StoredRow,
    create_change_db,
    parse_change_db_url,
)
from app.storage.engine import SqliteWriter
from bench.storage import DEFAULT_PG_URL, owned_log

OWNER = "bench"
BACKENDS = ("sqlite-process", "sqlite-thread", "postgres")
SWITCH_INTERVAL_S = 0.0005  # serve's (app/streamer/service.py)


@dataclass
class Result:
    backend: str
    form: str
    op: str
    seconds: float
    worst_stall_ms: float
    stalls_over_10ms: int


def big_json(size_mb: int) -> str:
    """About ``size_mb`` MB of JSON: ASCII with escapes and whitespace COPY must
    escape, then a tenth of multi-byte characters."""
    cell = '{"s":"say \\"hi\\" \\\\ back\\\\slash \\n",\t"n":123456789,\r\n"t":"xyzzy"}'
    size = size_mb * 1_000_000
    ascii_part = ",".join([cell] * (size * 9 // 10 // len(cell)))
    wide = "aé€😀" * (size // 10 // 10)  # 10 bytes of UTF-8 each
    return '{"tag":"insert","new":{"rows":[' + ascii_part + '],"wide":"' + wide + '"}}'


class StallMeter:
    """How late a 1 ms sleep on this loop wakes, while ``measure`` runs."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.over_10ms = 0

    @asynccontextmanager
    async def measure(self) -> AsyncIterator[None]:
        self.worst, self.over_10ms = 0.0, 0
        done = asyncio.Event()
        task = asyncio.create_task(self._run(done))
        await asyncio.sleep(0.01)  # the meter is running
        try:
            yield
        finally:
            done.set()
            await task

    async def _run(self, done: asyncio.Event) -> None:
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            late = time.perf_counter() - start - 0.001
            self.worst = max(self.worst, late)
            self.over_10ms += late > 0.010


def make_db(backend: str, tmp: Path, pg_url: str, n: int) -> ChangeDb:
    shard = Shard("bench_big", n)
    if backend == "postgres":
        return create_change_db(parse_change_db_url(pg_url), shard)
    writer: SqliteWriter = "thread" if backend == "sqlite-thread" else "process"
    url = str(tmp / f"big-{n}.db")
    return create_change_db(parse_change_db_url(url), shard, ChangeDbOptions(sqlite_writer=writer))


def rows_of(watermark: str, change: Text) -> list[StoredRow]:
    return [
        (watermark, 0, '{"tag":"begin"}', None),
        (watermark, 1, change, None),
        (watermark, 2, '{"tag":"commit"}', watermark),
    ]


async def timed(
    meter: StallMeter, backend: str, form: str, op: str, run: Callable[[], Awaitable[Any]]
) -> Result:
    gc.collect()
    async with meter.measure():
        start = time.perf_counter()
        await run()
        seconds = time.perf_counter() - start
    return Result(backend, form, op, seconds, meter.worst * 1000, meter.over_10ms)


async def run_backend(
    backend: str, n: int, tmp: Path, args: argparse.Namespace, value: str, pieces: Pieces
) -> list[Result]:
    db = make_db(backend, tmp, args.pg_url, n)
    results: list[Result] = []
    meter = StallMeter()
    try:
        log = await owned_log(db)
        await log.start_writer()
        forms: list[tuple[str, str, Text, int | None]] = [
            ("Pieces", "02", pieces, LARGE_TEXT_CHARS)
        ]
        if args.str:
            forms.append(("str", "03", value, None))
        for form, watermark, change, pieces_over in forms:

            async def write(wm: str = watermark, change: Text = change) -> None:
                await log.commit_rows(OWNER, rows_of(wm, change), wm)

            async def read(wm: str = watermark, over: int | None = pieces_over) -> None:
                async for batch in log.read(wm, wm, pieces_over=over):
                    got = batch[1][2]
                    assert len(got) == len(value), (len(got), len(value))
                    assert isinstance(got, Pieces) == (over is not None)

            results.append(await timed(meter, backend, form, "write", write))
            results.append(await timed(meter, backend, form, "read", read))
    finally:
        if db.dialect == "postgresql":
            async with db.writer.begin() as conn:
                await conn.execute(text(f'DROP SCHEMA IF EXISTS "{db.shard.cdc_schema}" CASCADE'))
        await db.dispose()
    return results


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=100)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL)
    parser.add_argument("--no-str", dest="str", action="store_false", help="skip the str rows")
    args = parser.parse_args()
    backends = args.backends.split(",")
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise SystemExit(f"unknown backends: {', '.join(sorted(unknown))}")
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return_large_frees()  # as serve does (decision 42), for the writer process too

    value = big_json(args.size_mb)
    pieces = text_pieces(value)
    assert isinstance(pieces, Pieces)
    meter = StallMeter()
    idle = await timed(meter, "-", "-", "idle", lambda: asyncio.sleep(1))
    print(
        f"{args.size_mb} MB change: {len(value):,} characters, {len(pieces.parts)} pieces; "
        f"idle loop's worst wake-up {idle.worst_stall_ms:.2f} ms",
        flush=True,
    )
    print(
        f"{'backend':<15} {'change':<7} {'op':<6} {'seconds':>8} {'worst stall ms':>15} "
        f"{'stalls > 10 ms':>15}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for n, backend in enumerate(backends):
            for r in await run_backend(backend, n, Path(tmp), args, value, pieces):
                print(
                    f"{r.backend:<15} {r.form:<7} {r.op:<6} {r.seconds:>8.2f} "
                    f"{r.worst_stall_ms:>15.1f} {r.stalls_over_10ms:>15}",
                    flush=True,
                )


if __name__ == "__main__":
    asyncio.run(main())
