"""Freed large buffers go back to the OS (app/runtime/memory.py), in fresh processes.

The same allocation pattern runs with and without the setting: one 40 MB buffer
freed (glibc's dynamic threshold then rises to 40 MB), then 20 MB buffers — the
size of the value that comes next — made and freed. Without the setting they stay
in the heap after use; with it the process's RSS comes back down."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from app.runtime.memory import ENV

PROGRAM = """
import sys
from app.runtime.memory import return_large_frees
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6
if sys.argv[1] == "on":
    assert return_large_frees()
big = bytearray(40_000_000); del big
before = rss_mb()
for _ in range(3):
    value = bytearray(20_000_000)  # zero-filled: every page touched
    del value
print(rss_mb() - before)
"""


def held_after(setting: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, setting],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return float(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_large_buffers_are_returned_to_the_os_once_freed() -> None:
    assert held_after("off") > 15  # glibc keeps the 20 MB in its heap
    assert held_after("on") < 5


def test_an_operators_own_threshold_is_left_alone() -> None:
    env = {**os.environ, ENV: "65536"}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from app.runtime.memory import return_large_frees, ENV; "
            "print(return_large_frees(), os.environ[ENV])",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.split() == ["True", "65536"]


async def test_the_periodic_trim_runs_until_cancelled() -> None:
    # malloc_trim(0) in a worker thread, every interval; cancelling it ends it.
    import asyncio

    from app.runtime.memory import trim_periodically
    from tests.waiting import stays

    task = asyncio.create_task(trim_periodically(0.01))
    await stays(lambda: not task.done(), 0.1, "the periodic trim running")
    assert not task.done()  # glibc has malloc_trim: the loop goes on
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
