"""``changestreamer serve`` as a child process of a benchmark, on loopback.

``running_serve`` starts it with a clean environment (no ``ZERO_*`` or
``CHANGESTREAMER_*`` of the caller's), development mode, no start-up delay and the
replica in ``work``, plus ``env``; waits (bounded) until ``/ready`` answers; yields
the process and its port; and stops it by its PID (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.pg_e2e import free_port_block

REPO = Path(__file__).resolve().parents[1]
SERVE = REPO / ".venv" / "bin" / "changestreamer"
READY_TIMEOUT_S = 60.0


@contextmanager
def running_serve(work: Path, env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port_block(1)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_", "CHANGESTREAMER_"))}
    full_env = {
        **base,
        "NODE_ENV": "development",
        "ZERO_CHANGE_STREAMER_STARTUP_DELAY_MS": "0",
        "ZERO_REPLICA_FILE": str(work / "replica.db"),
        "ZERO_LOG_LEVEL": "warn",
        **env,
    }
    with (work / "serve.log").open("wb") as log:
        proc = subprocess.Popen(
            [str(SERVE), "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1)
                    break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError(
                            f"serve did not get ready; see {work}/serve.log"
                        ) from None
                    time.sleep(0.1)
            yield proc, port
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
