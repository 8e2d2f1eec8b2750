"""Progress of long work: the numbers, and how they show on a terminal and in a pipe.

The view runs in a child process (a real pseudo-terminal or a real pipe as its
stderr); the parent reads until what it expects appears, then ends the child.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import textwrap
import time

import pyte

from app.progress import Job, ProgressView, describe

READ_TIMEOUT_S = 20.0

# A job that advances until stdin closes; the view shows it from the first moment.
# argv: the log format, then "log" for a log line every 50 ms as well.
CHILD = textwrap.dedent(
    """
    import asyncio, logging, sys
    from app.logs import configure_logging
    from app.progress import Job, ProgressView

    configure_logging("info", sys.argv[1])
    log_lines = sys.argv[2:] == ["log"]

    async def main():
        job = Job("demo copy", total=1_000_000, unit="rows")
        async with ProgressView([job], after_s=0, every_s=0.05):
            loop = asyncio.get_running_loop()
            closed = loop.run_in_executor(None, sys.stdin.read)
            n = 0
            while not closed.done():
                job.advance(1000, 50_000)
                n += 1
                if log_lines and n % 5 == 0:
                    logging.getLogger("demo").info("other work goes on %d", n // 5)
                await asyncio.sleep(0.01)  # the job's work, paced: the child's point

    asyncio.run(main())
    """
)


def test_describe_gives_done_total_percent_bytes_rate_and_eta() -> None:
    job = Job("initial sync of big", total=1_000_000, done=250_000, bytes=30_000_000, started=100.0)
    now = 105.0
    assert describe(job, now) == (
        "initial sync of big: 250,000 of ~1,000,000 rows (25%), 30.0 MB, 50,000 rows/s, ETA 15 s"
    )
    assert job.fields(now)["eta_s"] == 15.0
    unknown = Job("restore", unit="bytes", done=10, started=100.0)
    assert describe(unknown, 110.0) == "restore: 10 bytes, 1 bytes/s"


def test_short_waiting_and_finished_jobs_stay_quiet() -> None:
    now = time.monotonic()
    view = ProgressView(after_s=3.0, terminal=False)
    fresh = view.add(Job("fresh", started=now - 1))
    old = view.add(Job("old", started=now - 10))
    waiting = view.add(Job("queued", started=now - 10, waiting=True))
    done = view.add(Job("done", started=now - 10, finished=True))
    assert view._due(now) == [old]
    waiting.begin()
    assert waiting not in view._due(time.monotonic())  # its clock starts now
    assert fresh not in view._due(now)
    assert done not in view._due(now)


def _read_until(fd: int, needle: bytes) -> bytes:
    out = b""
    deadline = time.monotonic() + READ_TIMEOUT_S
    while needle not in out:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} never appeared in {out[-500:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the pty's other end closed
                break
            if not chunk:
                break
            out += chunk
    return out


def test_on_a_terminal_it_draws_a_live_bar() -> None:
    master, slave = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, "text"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        env={**os.environ, "COLUMNS": "120"},
    )
    os.close(slave)
    try:
        out = _read_until(master, b"rows/s")
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
        os.close(master)
    assert b"\x1b[" in out, "no terminal control sequences: not drawn as a live bar"
    assert b"demo copy" in out
    assert "━".encode() in out  # rich's bar
    assert b"INFO" not in out  # no log lines on a terminal


def test_on_a_terminal_log_lines_print_above_the_bar_not_through_it() -> None:
    master, slave = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, "text", "log"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        env={**os.environ, "COLUMNS": "120", "LINES": "40"},
    )
    os.close(slave)
    try:
        out = _read_until(master, b"other work goes on 9")
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
        os.close(master)
    # What a terminal shows of those bytes (a VT100 emulator), up to the ninth line.
    screen = pyte.Screen(120, 40)
    pyte.ByteStream(screen).feed(out[: out.rindex(b"other work goes on 9")])
    rows = [row.rstrip() for row in screen.display]
    logged = [row for row in rows if "other work goes on" in row]
    # Each line whole, on a row of its own, in order, none drawn over by the bar.
    assert [row.split("other work goes on ")[1] for row in logged] == [str(n) for n in range(1, 9)]
    for row in logged:
        assert " INFO demo: " in row
        assert "demo copy" not in row
        assert "━" not in row


def test_in_a_pipe_it_logs_lines_with_structured_fields() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, "json"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert child.stderr is not None
    try:
        out = _read_until(child.stderr.fileno(), b"rows/s")
        while not out.endswith(b"\n"):
            out += _read_until(child.stderr.fileno(), b"\n")
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
        child.stderr.close()
    line = next(json.loads(x) for x in out.splitlines() if b"demo copy" in x)
    assert b"\x1b[" not in out
    assert line["message"].startswith("demo copy: ")
    assert "of ~1,000,000 rows" in line["message"]
    assert line["progress"]["job"] == "demo copy"
    assert line["progress"]["total"] == 1_000_000
    assert line["progress"]["done"] > 0
