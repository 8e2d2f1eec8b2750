"""Crash safety: SIGKILL the service during sustained ingest, then restart it.

Checks on the SQLite log after the kill: every transaction acked upstream is
stored whole; no transaction is stored partially; ``lastWatermark`` is the newest
stored commit; and the restarted service asks the source for exactly the
transactions after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from app.protocol.codec import change_tag
from app.protocol.lexi import from_lexi
from app.storage import ChangeLog, Replication, Shard, create_change_db, parse_change_db_url
from tests.waiting import eventually_blocking

REPO = Path(__file__).resolve().parents[2]


def start_child(db: Path, events: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.streamer.crash_child", str(db), str(events)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_for(
    events: Path, predicate: Callable[[list[str]], bool], timeout_s: float = 30
) -> list[str]:
    lines: list[str] = []

    def holding() -> list[str] | None:
        nonlocal lines
        lines = events.read_text().splitlines() if events.exists() else []
        return lines if predicate(lines) else None

    found: list[str] = eventually_blocking(
        holding, lambda: f"the child's events; so far: {lines[-5:]}", timeout_s, poll_s=0.05
    )
    return found


async def stored_transactions(db_path: Path) -> tuple[dict[str, list[tuple[int, str]]], str]:
    db = create_change_db(parse_change_db_url(str(db_path)), Shard())
    try:
        txs: dict[str, list[tuple[int, str]]] = {}
        async for batch in ChangeLog(db).read("02", "zzzzzzzzzzzz"):
            for w, pos, change, _ in batch:
                txs.setdefault(w, []).append((pos, change_tag(change)))
        state = await Replication(db).state()
        assert state is not None
        return txs, state.last_watermark
    finally:
        await db.dispose()


async def test_sigkill_during_ingest_loses_no_acked_transaction_and_keeps_none_partial(
    tmp_path: Path,
) -> None:
    db, events = tmp_path / "cdc.db", tmp_path / "events.log"
    child = start_child(db, events)
    try:
        # Let it ingest for a while: at least 3 group commits acked.
        wait_for(events, lambda lines: sum(line.startswith("ack ") for line in lines) >= 3)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    acked = [line.split()[1] for line in events.read_text().splitlines() if line.startswith("ack ")]

    txs, last = await stored_transactions(db)
    for w in acked:
        assert w in txs, f"acked transaction {w} is not in the log"
    for w, rows in txs.items():
        n = from_lexi(w)
        expected = (
            [(0, "begin")] + [(i, "insert") for i in range(1, 2 + n % 5)] + [(2 + n % 5, "commit")]
        )
        assert rows == expected, f"transaction {w} is stored partially or out of order: {rows}"
    assert last == max(txs), "lastWatermark is not the newest stored commit"
    assert acked[-1] <= last

    # Restart: the source is asked for what comes after lastWatermark, nothing else.
    events.write_text("")
    child = start_child(db, events)
    try:
        lines = wait_for(events, lambda lines: any(line.startswith("start ") for line in lines))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert next(line for line in lines if line.startswith("start ")) == f"start {last}"
