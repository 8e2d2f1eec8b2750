"""The collector settings `serve` applies (app/runtime/gc_tuning.py).

Each case runs in a child interpreter: freezing is process-wide and would keep
every test's garbage alive for the rest of the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.runtime.gc_tuning import tune_for_streaming

REPO = Path(__file__).resolve().parent.parent


def _in_child(code: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_tuning_freezes_start_up_objects_and_raises_the_young_threshold() -> None:
    result = _in_child(
        "import gc, json\n"
        "import app.server.app\n"  # something sizeable to freeze
        "before = (gc.get_threshold(), gc.get_freeze_count())\n"
        "from app.runtime.gc_tuning import tune_for_streaming\n"
        "tune_for_streaming()\n"
        "after = (gc.get_threshold(), gc.get_freeze_count())\n"
        "print(json.dumps({'before': before, 'after': after}))\n"
    )
    before, after = result["before"], result["after"]
    assert isinstance(before, list)
    assert isinstance(after, list)
    (threshold_before, frozen_before), (threshold_after, frozen_after) = before, after
    assert frozen_before == 0
    assert frozen_after > 10_000
    assert threshold_after == [50_000, threshold_before[1], threshold_before[2]]


def test_garbage_present_at_tuning_is_collected_not_frozen() -> None:
    result = _in_child(
        "import gc, json, weakref\n"
        "class Node:\n"
        "    pass\n"
        "a, b = Node(), Node()\n"
        "a.other, b.other = b, a\n"  # a cycle: only the collector frees it
        "alive = weakref.ref(a)\n"
        "del a, b\n"
        "from app.runtime.gc_tuning import tune_for_streaming\n"
        "tune_for_streaming()\n"
        "print(json.dumps({'alive': alive() is not None}))\n"
    )
    assert result == {"alive": False}


def test_a_young_threshold_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="young_threshold must be at least 1, got 0"):
        tune_for_streaming(0)


def test_a_connection_dropped_in_a_cycle_does_not_keep_the_process_alive() -> None:
    # aiosqlite's connection thread is not a daemon and stops only when the
    # connection is closed or collected; with the raised threshold nothing
    # collects it unless before_exit() does, and the interpreter waits for it.
    code = (
        "import asyncio, aiosqlite\n"
        "from app.runtime.gc_tuning import before_exit, tune_for_streaming\n"
        "tune_for_streaming()\n"
        "async def leak():\n"
        "    holder = {'conn': await aiosqlite.connect(':memory:')}\n"
        "    holder['self'] = holder\n"
        "asyncio.run(leak())\n"
        "before_exit()\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], cwd=REPO, capture_output=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
