"""A child process kept running: start it, fold its output into our log, restart it.

``SupervisedChild.run`` starts the command a ``ChildSpec`` gives and keeps it running
until ``stop``: when the child exits it is started again after a backoff (doubling
from ``restart_initial_s`` to ``restart_max_s``, back to the start once a child ran
for ``stable_after_s``). Every line the child prints is logged at the level the
spec's ``parse_line`` reads from it. ``stop`` sends SIGTERM and, after
``stop_timeout_s``, SIGKILL.

The child gets a pipe as stdin that only we hold: when this process dies, even by
SIGKILL, the child reads EOF there and can end itself instead of living on as an
orphan (``changestreamer replicate --stop-on-stdin-eof`` and the replica follower
do). litestream ignores it: its spec asks for the kernel's parent-death signal
(``parent_death_signal``), and it inherits the replica's lock (``pass_fds``), so a
new ``serve`` refuses to start beside one that outlived its parent anyway.
``problem`` says when a child crash-loops or has been down too long (``/ready``).

Used for litestream (``app.backup.process``) and the service's own replica follower
(``app.runtime.replica_follower``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from app.backoff import Backoff
from app.child_env import child_env
from app.timeouts import within

__all__ = [
    "LOG_LEVELS",
    "ChildLine",
    "ChildSpec",
    "ChildState",
    "SupervisedChild",
    "log_child_line",
]

# Level names children print (Python's logging, litestream's WARN), as logging levels.
LOG_LEVELS: Final = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}
# Longest output line read from a child; longer ones are cut.
MAX_LINE: Final = 64 * 1024
RECENT_LINES: Final = 20


@dataclass(slots=True)
class ChildState:
    """What /statz and /metrics say about the child."""

    pid: int | None = None
    starts: int = 0
    last_exit: int | None = None
    last_exit_at: float | None = None
    recent_errors: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT_LINES))
    # Runs that ended in an error (a non-zero exit, or a failed start) with no run of
    # ``stable_after_s`` in between; the monotonic time the running child started,
    # and since when no child has been running (None while one runs).
    failures_in_a_row: int = 0
    started_at: float | None = None
    down_since: float | None = None


# A child's output line as a spec's ``parse_line`` reads it: its level, its message
# and (optionally) the traceback it carried.
ChildLine = tuple[int, str] | tuple[int, str, str | None]


def _plain_line(line: str) -> ChildLine:
    return logging.INFO, line


def log_child_line(logger: logging.Logger, parsed: ChildLine) -> None:
    """Logs a parsed child line. Its traceback goes where a traceback of ours goes
    (the record's ``exc_text``: the lines after a text line, ``exc`` in JSON), so it
    keeps its lines while the message, like every message, is kept to one."""
    level, message = parsed[0], parsed[1]
    trace = parsed[2] if len(parsed) > 2 else None
    if not logger.isEnabledFor(level):
        return
    record = logger.makeRecord(logger.name, level, "(child)", 0, "%s", (message,), None)
    record.exc_text = trace or None
    logger.handle(record)


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str
    log: logging.Logger
    # The command line and environment, prepared anew for every start. The default
    # environment is the allow-listed minimum (app/child_env.py), never all of ours.
    command: Callable[[], Awaitable[Sequence[str]]]
    env: Callable[[], Mapping[str, str] | None] = child_env
    cwd: str | None = None
    parse_line: Callable[[str], ChildLine] = _plain_line
    restart_initial_s: float = 1.0
    restart_max_s: float = 60.0
    stable_after_s: float = 60.0
    stop_timeout_s: float = 10.0
    # Errors that mean the command cannot be started (logged, then retried).
    start_errors: tuple[type[Exception], ...] = (OSError,)
    # Exit codes after which restarting cannot help: ``run`` returns them.
    final_exit_codes: frozenset[int] = frozenset()
    # File descriptors the child inherits (the replica's lock: app/runtime/replica_lock.py).
    pass_fds: tuple[int, ...] = ()
    # The child gets SIGKILL when this process dies, even by SIGKILL, through the
    # kernel's parent-death signal (for children that have no lifeline of their own).
    parent_death_signal: bool = False


class SupervisedChild:
    """Keeps one child process running; see the module docstring."""

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.state = ChildState()
        self._stopped = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def problem(
        self, *, crash_loop_after: int = 3, down_after_s: float | None = None
    ) -> str | None:
        """Why the child cannot do its job now, or None: it failed ``crash_loop_after``
        times in a row and has not run ``stable_after_s`` since, or (with
        ``down_after_s``) no child has run for that long. A stopped child has none."""
        if self._stopped.is_set():
            return None
        state, now = self.state, time.monotonic()
        stable = (
            self.running
            and state.started_at is not None
            and now - state.started_at >= self.spec.stable_after_s
        )
        if state.failures_in_a_row >= crash_loop_after and not stable:
            return (
                f"the {self.spec.name} failed {state.failures_in_a_row} times in a row "
                f"(last exit code {state.last_exit})"
            )
        if down_after_s is not None and state.down_since is not None:
            down_s = now - state.down_since
            if down_s >= down_after_s:
                return f"the {self.spec.name} has not been running for {down_s:.0f} s"
        return None

    def send(self, data: bytes, *, max_buffered: int) -> bool:
        """Writes ``data`` to the child's stdin without waiting; False (nothing written)
        if no child runs or more than ``max_buffered`` bytes are still unread there."""
        proc = self._proc
        if proc is None or proc.returncode is not None or proc.stdin is None:
            return False
        if proc.stdin.is_closing() or proc.stdin.transport.get_write_buffer_size() > max_buffered:
            return False
        proc.stdin.write(data)
        return True

    async def run(self) -> int | None:
        """Runs the child until ``stop`` (None), restarting it with backoff when it
        exits, or until it exits with one of the spec's final exit codes (returned)."""
        spec = self.spec
        backoff = Backoff(spec.restart_initial_s, spec.restart_max_s)
        state = self.state
        state.down_since = time.monotonic()
        while not self._stopped.is_set():
            started = time.monotonic()
            try:
                code: int | None = await self._run_once()
            except spec.start_errors as e:
                spec.log.error("cannot start %s: %s", spec.name, e)
                state.recent_errors.append(str(e))
                code = None
            if self._stopped.is_set():
                return None
            if code in spec.final_exit_codes:
                spec.log.error("%s exited (code %s)", spec.name, code)
                return code
            if time.monotonic() - started >= spec.stable_after_s:
                backoff.reset()
                state.failures_in_a_row = 0
            if code != 0:
                state.failures_in_a_row += 1
            delay = backoff.next_delay()
            spec.log.warning("%s exited (code %s); restarting in %.1f s", spec.name, code, delay)
            with contextlib.suppress(TimeoutError):
                await within(self._stopped.wait(), delay)
        return None

    async def stop(self) -> None:
        """Stops the child (SIGTERM, then SIGKILL after ``stop_timeout_s``)."""
        self._stopped.set()
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await within(proc.wait(), self.spec.stop_timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def _run_once(self) -> int:
        spec = self.spec
        argv = list(await spec.command())
        if self._stopped.is_set():
            return 0
        if spec.parent_death_signal:
            argv = with_parent_death_signal(argv)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=spec.env(),
            cwd=spec.cwd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            limit=MAX_LINE,
            start_new_session=True,  # a ^C to serve reaches us, and we stop it in order
            pass_fds=spec.pass_fds,
        )
        self._proc = proc
        self.state.pid = proc.pid
        self.state.starts += 1
        self.state.started_at, self.state.down_since = time.monotonic(), None
        spec.log.info("%s started (pid %d)", spec.name, proc.pid)
        assert proc.stdout is not None
        try:
            await self._relay(proc.stdout)
            code = await proc.wait()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
        self.state.last_exit = code
        self.state.last_exit_at = time.time()
        self.state.pid = None
        self.state.started_at, self.state.down_since = None, time.monotonic()
        return code

    async def _relay(self, stream: asyncio.StreamReader) -> None:
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line over MAX_LINE: skip what is left of it
                raw = await stream.read(MAX_LINE)
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            parsed = self.spec.parse_line(line)
            if parsed[0] >= logging.WARNING:
                self.state.recent_errors.append(parsed[1])
            log_child_line(self.spec.log, parsed)


# util-linux's setpriv sets the parent-death signal and then executes the child, so
# that nothing runs in the forked child before exec (a preexec_fn is unsafe with
# threads). Where it is missing (not Linux), the child runs without the signal and
# the replica's lock still refuses a second start beside it.
_SETPRIV: Final = shutil.which("setpriv")


def with_parent_death_signal(argv: list[str]) -> list[str]:
    """``argv`` run so that it gets SIGKILL when this process's thread that starts it
    (the event loop's) ends, whatever ends it."""
    if _SETPRIV is None:
        return argv
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]
