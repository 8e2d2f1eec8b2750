"""The supervisor of child processes: crash loops and downtime reported, and children
that die with their parent (real processes)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.supervise import ChildSpec, SupervisedChild, with_parent_death_signal
from tests.waiting import eventually

log = logging.getLogger("test-child")


def _spec(script: str, **options: float) -> ChildSpec:
    async def command() -> list[str]:
        return [sys.executable, "-c", script]

    return ChildSpec(
        name="test child",
        log=log,
        command=command,
        restart_initial_s=0.01,
        restart_max_s=0.02,
        stable_after_s=options.pop("stable_after_s", 60.0),
        stop_timeout_s=5.0,
    )


async def test_a_child_that_keeps_failing_is_a_crash_loop_until_it_runs_stably() -> None:
    marker = Path(os.environ.get("TMPDIR", "/tmp")) / f"supervise-{os.getpid()}"
    marker.unlink(missing_ok=True)
    # Fails until the marker exists, then runs for good.
    script = textwrap.dedent(
        f"""
        import os, sys, time
        if not os.path.exists({str(marker)!r}):
            sys.exit(1)
        time.sleep(3600)
        """
    )
    child = SupervisedChild(_spec(script, stable_after_s=0.5))
    runner = asyncio.create_task(child.run())
    try:
        problem = await eventually(lambda: child.problem(crash_loop_after=3), "a crash loop")
        assert problem.startswith("the test child failed ")
        assert "in a row (last exit code 1)" in problem
        marker.touch()
        await eventually(lambda: child.running, "a run that lasts")
        # Still a crash loop until it has run stable_after_s.
        await eventually(lambda: child.problem(crash_loop_after=3) is None, "a stable run", 10)
    finally:
        marker.unlink(missing_ok=True)
        await child.stop()
        await asyncio.wait_for(runner, 10)
    assert child.problem(crash_loop_after=3) is None  # stopped: nothing to report


async def test_a_child_that_cannot_start_is_down_for_as_long_as_it_does_not_run() -> None:
    async def missing() -> list[str]:
        return ["/nonexistent/litestream"]

    spec = ChildSpec(
        name="missing child", log=log, command=missing, restart_initial_s=0.01, restart_max_s=0.02
    )
    child = SupervisedChild(spec)
    runner = asyncio.create_task(child.run())
    try:
        problem = await eventually(lambda: child.problem(down_after_s=0.2), "downtime reported")
        assert problem.startswith("the missing child ")
    finally:
        await child.stop()
        await asyncio.wait_for(runner, 10)


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's"
)
def test_a_child_with_the_parent_death_signal_dies_with_its_parent_even_by_sigkill(
    tmp_path: Path,
) -> None:
    # A parent (a Python process) starts a long child with the signal and prints its
    # PID; the parent is SIGKILLed; the child must be gone, not reparented to init.
    argv = with_parent_death_signal(["sleep", "3600"])
    assert argv[0].endswith("setpriv"), "setpriv (util-linux) is part of the tested setup"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time\n"
            f"p = subprocess.Popen({argv!r})\nprint(p.pid, flush=True)\ntime.sleep(3600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())

    def exec_done() -> bool:  # setpriv set the signal and became the child
        with open(f"/proc/{child_pid}/comm") as f:
            return f.read().strip() == "sleep"

    asyncio.run(eventually(exec_done, "setpriv to run the child", 10))
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)

    def gone() -> bool:
        try:
            with open(f"/proc/{child_pid}/stat") as f:
                return f.read().split()[2] == "Z"  # a zombie until init reaps it
        except FileNotFoundError:
            return True

    asyncio.run(eventually(gone, "the child to die with its parent", 10))
    parent.stdout.close()
