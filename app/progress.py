"""Progress of long work (initial sync, restore, catch-up) for whoever is watching.

A :class:`Job` is a counter the worker bumps (from any thread: it only assigns ints
and floats) with an optional total. :class:`ProgressView` shows the jobs that have
run for at least ``after_s`` seconds (short work stays silent):

* on a terminal (stderr is a TTY): a live ``rich`` progress bar per job, with its
  rate and ETA, redrawn a few times a second and removed when the job ends;
* otherwise (a pipe, a file, a container's log): a log line per job every
  ``every_s`` seconds, whose ``extra`` fields carry the same numbers for the JSON
  log format (``app/logs.py``).

One view per long operation; :meth:`ProgressView.run` is a task the operation
cancels when it is done (``async with view:`` does both). A view that lasts as long
as a service (its catch-ups) is started and stopped with it and takes jobs as they
come; a finished job leaves the view once it has been shown, so it stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, Any, Final, Self

from app.logs import log_extra

__all__ = ["Job", "ProgressView", "describe"]

log = logging.getLogger("app.progress")

AFTER_S = 3.0  # work shorter than this shows nothing
EVERY_S = 5.0  # a log line per job this often when not on a terminal
REDRAW_S: Final = 0.25  # terminal redraws


@dataclass(slots=True)
class Job:
    """One piece of long work: ``done`` of ``total`` ``unit`` (total None: unknown)."""

    what: str
    total: float | None = None
    unit: str = "rows"
    done: float = 0
    bytes: int = 0
    finished: bool = False
    waiting: bool = False  # queued behind other work: not shown until begin()
    context: Mapping[str, object] = field(default_factory=dict)  # log fields (a subscriber)
    started: float = field(default_factory=time.monotonic)

    def begin(self) -> None:
        self.waiting = False
        self.started = time.monotonic()

    def advance(self, n: float, nbytes: int = 0) -> None:
        self.done += n
        self.bytes += nbytes

    def finish(self) -> None:
        self.finished = True

    def rate(self, now: float) -> float:
        elapsed = now - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    def eta_s(self, now: float) -> float | None:
        rate = self.rate(now)
        if self.total is None or rate <= 0:
            return None
        return max(self.total - self.done, 0) / rate

    def fields(self, now: float) -> dict[str, Any]:
        """The numbers, for structured logs."""
        eta = self.eta_s(now)
        return {
            "job": self.what,
            "done": self.done,
            "total": self.total,
            "unit": self.unit,
            "bytes": self.bytes,
            "rate": round(self.rate(now), 1),
            "eta_s": None if eta is None else round(eta, 1),
        }


def describe(job: Job, now: float) -> str:
    """One line: ``initial sync of items: 120,000 of ~500,000 rows (24%), 12.3 MB,
    40,000 rows/s, ETA 10 s``."""
    parts = [f"{job.what}: {job.done:,.0f}"]
    if job.total is not None:
        pct = f" ({100 * job.done / job.total:.0f}%)" if job.total > 0 else ""
        parts[0] += f" of ~{job.total:,.0f} {job.unit}{pct}"
    else:
        parts[0] += f" {job.unit}"
    if job.bytes:
        parts.append(f"{job.bytes / 1e6:.1f} MB")
    parts.append(f"{job.rate(now):,.0f} {job.unit}/s")
    eta = job.eta_s(now)
    if eta is not None:
        parts.append(f"ETA {eta:.0f} s")
    return ", ".join(parts)


class ProgressView:
    def __init__(
        self,
        jobs: list[Job] | None = None,
        *,
        after_s: float | None = None,
        every_s: float | None = None,
        stream: IO[str] | None = None,
        terminal: bool | None = None,
    ) -> None:
        self.jobs: list[Job] = list(jobs or [])
        # The module's values, read now: tests shorten them for a whole operation.
        self._after_s = AFTER_S if after_s is None else after_s
        self._every_s = EVERY_S if every_s is None else every_s
        self._stream = stream if stream is not None else sys.stderr
        self._terminal = self._stream.isatty() if terminal is None else terminal
        self._task: asyncio.Task[None] | None = None

    def add(self, job: Job) -> Job:
        self.jobs.append(job)
        return job

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="progress")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def run(self) -> None:
        if self._terminal:
            await self._run_bars()
        else:
            await self._run_lines()

    def _due(self, now: float) -> list[Job]:
        return [
            j
            for j in self.jobs
            if not j.finished and not j.waiting and now - j.started >= self._after_s
        ]

    async def _run_lines(self) -> None:
        while True:
            await asyncio.sleep(self._every_s)
            now = time.monotonic()
            for job in self._due(now):
                fields = {**job.context, "progress": job.fields(now)}
                log.info("%s", describe(job, now), extra=log_extra(fields))
            self.jobs = [j for j in self.jobs if not j.finished]

    async def _run_bars(self) -> None:
        # Imported here: rich is only needed when someone watches a terminal.
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TaskID,
            TextColumn,
            TimeRemainingColumn,
        )

        console = Console(file=self._stream, force_terminal=True)
        shown: dict[int, TaskID] = {}
        bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            auto_refresh=False,
        )
        with bars:
            while True:
                now = time.monotonic()
                due = {id(j) for j in self._due(now)}
                for job in self.jobs:
                    key = id(job)
                    if key in shown:
                        if job.finished:
                            bars.remove_task(shown.pop(key))
                            continue
                        bars.update(
                            shown[key],
                            completed=job.done,
                            total=job.total,
                            rate=f"{job.rate(now):,.0f} {job.unit}/s",
                        )
                    elif key in due:
                        shown[key] = bars.add_task(
                            job.what,
                            total=job.total,
                            completed=int(job.done),
                            rate=f"{job.rate(now):,.0f} {job.unit}/s",
                        )
                self.jobs = [j for j in self.jobs if not j.finished]
                bars.refresh()
                await asyncio.sleep(REDRAW_S)
