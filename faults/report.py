"""The figures of a run as markdown: one table row per fault, then the details."""

from __future__ import annotations

from collections.abc import Sequence

from faults.scenarios import FaultResult

__all__ = ["markdown"]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _ready(result: FaultResult) -> str:
    total = sum(result.ready.values())
    if not total:
        return "–"
    parts = [f"{answer} ({n * 100 // total}%)" for answer, n in result.ready.most_common(3)]
    return "; ".join(parts)


def _recovery(result: FaultResult) -> str:
    figures = result.recovery()
    return "–" if figures is None else f"{figures[0]:.2f} / {figures[1]:.2f}"


def markdown(results: Sequence[FaultResult], seed: int) -> str:
    lines = [
        f"Seed {seed}. Recovery: seconds from the fault until every follower received "
        "the first transaction committed after it took effect (p50 / max).",
        "",
        "| fault | iterations | transactions | lost | duplicated | recovery p50 / max s "
        "| rows = Postgres (followers, replica) | orphans | /ready during the fault "
        "| peak RSS MiB | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.fault} |" + " – |" * 9 + f" skipped: {r.skipped} |")
            continue
        if not r.verified:
            lines.append(
                f"| {r.fault} | {r.iterations} | – | not checked | not checked "
                f"| {_recovery(r)} + no recovery | not checked | {len(r.orphans)} "
                f"| {_cell(_ready(r))} | {r.peak_rss_kib / 1024:.0f} | FAILED: did not recover |"
            )
            continue
        rows = "yes" if not r.row_problems else f"NO ({len(r.row_problems)})"
        replica = "yes" if not r.replica_problems else f"NO ({len(r.replica_problems)})"
        lines.append(
            f"| {r.fault} | {r.iterations} | {r.transactions} | {r.lost} | {r.duplicated} "
            f"| {_recovery(r)} | {rows}, {replica} | {len(r.orphans)} | {_cell(_ready(r))} "
            f"| {r.peak_rss_kib / 1024:.0f} | {'ok' if r.ok else 'FAILED'} |"
        )
    lines += ["", "What the operator saw, per fault:", ""]
    for r in results:
        if r.skipped:
            continue
        lines.append(f"* **{r.fault}** ({r.seconds:.0f} s)")
        if r.notes:
            notes = ", ".join(f"{note} ×{n}" for note, n in r.notes.most_common())
            lines.append(f"  * outcome: {notes}")
        if r.drops:
            lines.append(
                f"  * faulty subscriber gone from `changestreamer_subscribers` after "
                f"{min(r.drops):.1f}–{max(r.drops):.1f} s"
            )
        if r.backup_catch_ups:
            lines.append(
                f"  * backup caught up (`changestreamer_backup_lag_seconds` < 2) "
                f"{min(r.backup_catch_ups):.1f}–{max(r.backup_catch_ups):.1f} s after "
                "the destination was writable again"
            )
        if r.log_line:
            lines.append(f"  * log: `{r.log_line[:300]}`")
        for metric in r.metrics[:6]:
            lines.append(f"  * metric: `{metric}`")
        for problem in [*r.orphans, *r.fault_problems, *r.row_problems, *r.replica_problems][:10]:
            lines.append(f"  * PROBLEM: {problem}")
    return "\n".join(lines) + "\n"
