"""The fault harness (``faults/``) in CI: the fast faults, a few iterations each.

Each test is one fault's seeded loop against a real ``changestreamer serve`` over a
scratch ``flt_*`` database on the local Postgres, under write load, with three
resuming followers. The oracle must then find nothing lost, nothing duplicated,
every follower's rows and the replica equal to Postgres row by row, no orphan
process and every misbehaving subscriber dropped. Postgres restarts and a full
disk are left to the full run (``python -m faults``): the server is shared, and
a tmpfs needs root. ``clock_jump`` needs libfaketime (``scripts/ensure-tools``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from faults.scenarios import FaultResult, run_fault

SEED = 20261201
ITERATIONS = {
    "sigkill": 3,
    "walsender": 3,
    "stalled_subscriber": 2,
    "stalled_in_catchup": 1,
    "wrong_ack": 3,
    "flood": 3,
    "change_db_garbage": 2,
    "clock_jump": 4,
    "pause": 2,
}


def assert_clean(result: FaultResult, iterations: int) -> None:
    assert result.iterations == iterations
    assert len(result.recoveries) == iterations
    assert result.transactions > 0
    assert result.lost == 0, result.row_problems
    assert result.duplicated == 0, result.row_problems
    assert result.row_problems == []
    assert result.replica_problems == []
    assert result.orphans == []
    assert result.fault_problems == []


# What each fault must also show, beyond the oracle's checks.
def expect_operator_view(result: FaultResult, iterations: int) -> None:
    if result.fault == "sigkill":
        # serve, its SQLite writer and (once it started, just after /ready) the
        # replica follower; assert_clean checked that none outlived the kill.
        trees = {n: c for n, c in result.notes.items() if n.startswith("tree of")}
        assert sum(trees.values()) == iterations
        assert set(trees) <= {"tree of 2 processes killed", "tree of 3 processes killed"}
    elif result.fault == "change_db_garbage":
        assert result.notes["start on garbage: exit 1, 1 error line(s)"] == iterations
        assert result.log_line.startswith("changestreamer: ")
        assert "not a SQLite database" in result.log_line
    elif result.fault == "wrong_ack":
        assert "unexpected ack 2: expected ack 1" in result.log_line
    elif result.fault == "flood":
        assert "error parsing ack" in result.log_line
    elif result.fault in ("stalled_subscriber", "stalled_in_catchup"):
        assert len(result.drops) == iterations
    elif result.fault == "clock_jump":
        # Two steps away from true time and two back, each seen in serve's own clock
        # (the harness waits for it); assert_clean checked no follower was dropped.
        steps = {n: c for n, c in result.notes.items() if n.startswith("wall clock stepped")}
        assert sum(steps.values()) == iterations
        assert result.ready == {"200": sum(result.ready.values())}
    elif result.fault == "pause":
        assert result.notes["paused 5 s"] == iterations
    elif result.fault == "walsender":
        assert result.notes["walsenders terminated: 1"] == iterations
        assert "change stream failed" in result.log_line


@pytest.mark.parametrize("fault", sorted(ITERATIONS))
async def test_fault_loses_and_repeats_nothing(fault: str, tmp_path: Path) -> None:
    iterations = ITERATIONS[fault]
    result = await run_fault(fault, iterations, SEED, tmp_path)
    assert_clean(result, iterations)
    expect_operator_view(result, iterations)
