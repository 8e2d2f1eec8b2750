"""The replica's lock: one holder at a time, kept by the children that inherit it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.runtime.replica_lock import ReplicaLock, ReplicaLockedError, held_replica


def test_a_second_holder_is_refused_with_the_holder_named(tmp_path: Path) -> None:
    replica = tmp_path / "replica.db"
    first = ReplicaLock(replica)
    first.acquire()
    # The holder is another process: a child that inherited the descriptor.
    child = subprocess.Popen(["sleep", "3600"], pass_fds=(first.fd,))
    try:
        first.release()  # the child still holds it (one open file description)
        second = ReplicaLock(replica)
        started = time.monotonic()
        with pytest.raises(ReplicaLockedError) as refused:
            second.acquire(wait_s=0.3)
        assert time.monotonic() - started >= 0.3  # it waited for the holder first
        message = str(refused.value)
        assert f"pid {child.pid} (sleep)" in message
        assert message.startswith(f"the replica {replica} is in use by another process")
        assert "\n" not in message
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    # The kernel dropped the lock with its last holder: nothing stale is left.
    again = ReplicaLock(replica)
    again.acquire(wait_s=1)
    assert (tmp_path / "replica.db.lock").read_text() == f"{os.getpid()}\n"
    again.release()


def test_a_lock_whose_holders_end_within_the_wait_is_taken(tmp_path: Path) -> None:
    replica = tmp_path / "replica.db"
    first = ReplicaLock(replica)
    first.acquire()
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(0.5)"], pass_fds=(first.fd,)
    )
    first.release()
    try:
        ReplicaLock(replica).acquire(wait_s=10)  # the child ends after 0.5 s
    finally:
        child.wait(10)


def test_a_command_that_writes_the_replica_is_told_who_holds_it(tmp_path: Path) -> None:
    replica = tmp_path / "replica.db"
    serve = ReplicaLock(replica)
    serve.acquire()
    child = subprocess.Popen(["sleep", "3600"], pass_fds=(serve.fd,))
    try:
        with held_replica(replica) as refusal:
            assert refusal is not None
            assert f"pid {child.pid} (sleep)" in refusal
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        serve.release()
    with held_replica(replica) as refusal:  # free again: held for the block
        assert refusal is None
        with held_replica(replica, wait_s=0.1) as second:
            assert second is not None
