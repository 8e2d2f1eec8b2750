"""The command line as a person meets it: --version, --help, what parsing loads, Ctrl-C.

How fast ``--help`` answers is a benchmark (``python -m bench.cli_startup``); that it
loads none of the service, the reason it is fast, is checked here.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "app.cli"]
SUBCOMMANDS = ["serve", "migrate", "tail", "status", "replicate", "restore"]
# What the service is made of: none of it may load to parse a command line.
HEAVY = ["fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "psycopg", "pydantic",
         "websockets", "rich", "asyncio", "app.streamer", "app.server", "app.storage",
         "app.client", "app.config"]  # fmt: skip
TIMEOUT_S = 30


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERO_")}
    env.update(extra, PYTHONPATH=str(REPO))
    return env


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], env=environment(), capture_output=True, text=True, timeout=TIMEOUT_S
    )


def test_version_names_the_installed_package_and_the_protocols() -> None:
    done = run("--version")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        f"changestreamer {importlib.metadata.version('changestreamer')}",
        "zero replication protocol v1–v7",
    ]


def test_help_lists_every_subcommand() -> None:
    done = run("--help")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("usage: changestreamer")
    assert re.findall(r"^ {4}(\w+)", done.stdout, re.MULTILINE) == SUBCOMMANDS


@pytest.mark.parametrize(
    "argv",
    [
        [],
        [["--help"]],
        [["--version"]],
        *[[[command, "--help"]] for command in SUBCOMMANDS],
        [["replicate", "--replica", "x.db", "--log-level", "warn"], ["tail", "--from", "02"]],
    ],
)
def test_parsing_a_command_line_loads_none_of_the_service(argv: list[list[str]]) -> None:
    # Importing app.cli, then parsing (--help and --version exit after printing).
    probe = f"""
import contextlib, io, json, sys
import app.cli
for args in {argv!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        app.cli.build_parser().parse_args(args)
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
"""
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


# -- Ctrl-C on serve -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """``changestreamer serve`` (the demo source) on loopback, its stderr read line by line."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.port = port
        self.lines: list[str] = []

    async def until_line(self, text: str) -> None:
        """Reads stderr until a line containing ``text``; fails if serve ends first."""
        assert self.proc.stderr is not None
        while True:
            raw = await asyncio.wait_for(self.proc.stderr.readline(), TIMEOUT_S)
            assert raw, f"serve ended before saying {text!r}:\n" + "\n".join(self.lines)
            self.lines.append(raw.decode().rstrip("\n"))
            if text in self.lines[-1]:
                return

    async def finish(self, timeout_s: float) -> list[str]:
        """Waits for the exit (within ``timeout_s``); all of stderr."""
        _, rest = await asyncio.wait_for(self.proc.communicate(), timeout_s)
        return [*self.lines, *rest.decode().splitlines()]


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Serve]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "serve",
        "--port",
        str(port),
        cwd=tmp_path,
        # A request still running holds the graceful shutdown this long at most.
        env=environment(NODE_ENV="development", CHANGESTREAMER_SHUTDOWN_TIMEOUT_SECONDS="60"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    running = Serve(proc, port)
    try:
        await running.until_line("Uvicorn running on")
        yield running
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_ctrl_c_shuts_serve_down_gracefully_and_quietly(serve: Serve) -> None:
    serve.proc.send_signal(signal.SIGINT)
    lines = await serve.finish(TIMEOUT_S)
    assert serve.proc.returncode == 130, "\n".join(lines)
    assert any("Application shutdown complete" in line for line in lines), lines
    assert not [line for line in lines if "Traceback" in line or "Interrupt" in line], lines


async def test_a_second_ctrl_c_during_the_shutdown_exits_at_once_with_one_line(
    serve: Serve,
) -> None:
    # A 60-second /profz keeps the graceful shutdown waiting (for up to the 60 s above).
    _, profiling = await asyncio.open_connection("127.0.0.1", serve.port)
    profiling.write(b"GET /profz?seconds=60 HTTP/1.1\r\nHost: localhost\r\n\r\n")
    await profiling.drain()
    try:
        # Answered after the server read the request above, which came first.
        url = f"http://127.0.0.1:{serve.port}/"
        assert await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
        serve.proc.send_signal(signal.SIGINT)
        await serve.until_line("Waiting for connections to close")
        serve.proc.send_signal(signal.SIGINT)
        lines = await serve.finish(10)  # at once, not after the 60-second request
    finally:
        profiling.close()
        with contextlib.suppress(OSError):
            await profiling.wait_closed()
    assert serve.proc.returncode == 130
    assert lines[-1] == (
        "changestreamer: interrupted again: exiting without finishing the shutdown"
    )
    assert not [line for line in lines if "Traceback" in line], lines
