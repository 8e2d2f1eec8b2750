"""Connection churn and floods against one steady subscriber, on real processes.

    python -m bench.churn                          # 10 s per phase
    python -m bench.churn --seconds 5 --rate 200 --flood 2000

Starts ``changestreamer serve`` on its embedded demo source at a pace the service
cannot keep (so the steady subscriber's receive rate is what the service gives it),
subscribes one steady v6 subscriber that acks everything (``bench.pg_subscribers``'
raw client, in this process), and measures its data changes per second:

1. ``baseline`` — nothing else connected;
2. ``churn`` — another process opens and closes ``--rate`` subscriptions a second
   (each resumes at the log's head, as a reconnecting replica does, or with
   ``--churn-from start`` at its start; reads its status message, then closes);
3. ``flood`` — another process holds ``--flood`` connections open at once (beyond
   ``CHANGESTREAMER_MAX_SUBSCRIBERS`` they are refused with a close), then closes
   them all; the service's RSS (its process tree) before, with them open, and
   ``--after`` (12) s after they closed. ``--floods N`` repeats it (a leak grows
   with each; a high-water mark does not); ``--heap-window S`` prints serve's
   ``/heapz`` over S seconds from the first flood's start (what it allocated and
   serve still holds) to stderr.

Loopback only; every process it starts is stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.pg_e2e import process_tree, rss_kib
from bench.pg_subscribers import RawSocket
from bench.serve import running_serve

REPO = Path(__file__).resolve().parents[1]


def tree_rss_mib(pid: int) -> int:
    return sum(rss_kib(p) for p in process_tree(pid)) // 1024


def rss_by_process_mib(pid: int) -> dict[str, int]:
    """Each process of the tree (``pid: command``) and its RSS, to say which grew."""
    out = {}
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        name = " ".join(a.decode(errors="replace").rsplit("/", 1)[-1] for a in argv[:3] if a)
        out[f"{p}: {name}"] = rss_kib(p) // 1024
    return out


async def steady_rate(
    port: int, replica_version: str, stop: asyncio.Event, sink: list[float]
) -> None:
    """Follows the stream until ``stop`` is set; appends (time, data changes so far)
    samples to ``sink``. (Not cancelled: on Python 3.11 a cancel that meets a
    completed read inside ``asyncio.wait_for`` is lost, and under a saturated stream
    that happened every time.)"""
    path = (
        f"/replication/v6/changes?id=steady&replicaVersion={replica_version}"
        f"&watermark={replica_version}"
    )
    ws = await RawSocket.open(f"ws://127.0.0.1:{port}", path)
    changes = 0
    try:
        async for count, _last in ws.ack_each():
            changes += count
            sink.append(time.monotonic())
            sink.append(changes)
            if stop.is_set():
                return
    finally:
        await ws.close()


def get(url: str, timeout: float = 10) -> bytes:
    """The body of ``url``, with the admin password of a ``--heap-window`` run."""
    request = urllib.request.Request(url)
    if password := os.environ.get(PASSWORD_ENV):
        token = base64.b64encode(f":{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return bytes(reply.read())


def statz_field(port: int, name: str) -> str:
    url = f"http://127.0.0.1:{port}/statz?format=json&group=replication"
    return str(json.loads(get(url))["replication"][name])


def statz_replica_version(port: int) -> str:
    return statz_field(port, "replicaVersion")


def window_rate(samples: list[float], start: float, end: float) -> float:
    """Frames per second between ``start`` and ``end`` from the (time, count) pairs."""
    pairs = list(zip(samples[::2], samples[1::2], strict=True))
    inside = [(t, n) for t, n in pairs if start <= t <= end]
    if len(inside) < 2:
        return 0.0
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


CHURNER = """
import asyncio, json, sys, time
from bench.churn import get
from bench.pg_subscribers import RawSocket
port, rv, wm = int(sys.argv[1]), sys.argv[2], sys.argv[5]
rate, seconds = float(sys.argv[3]), float(sys.argv[4])
head = [wm]
def durable():
    url = f"http://127.0.0.1:{port}/statz?format=json&group=replication"
    return json.loads(get(url))["replication"]["durableWatermark"]
async def follow_head():  # resume where a reconnecting replica would: near the head
    while wm != rv:
        head[0] = await asyncio.to_thread(durable)
        await asyncio.sleep(0.5)
async def one(i):
    path = f"/replication/v6/changes?id=churn-{i}&replicaVersion={rv}&watermark={head[0]}"
    try:
        ws = await RawSocket.open(f"ws://127.0.0.1:{port}", path)
        async for _ in ws.messages():
            break
        await ws.close()
        return True
    except Exception:
        return False
async def main():
    follower = asyncio.create_task(follow_head())
    start = time.monotonic(); tasks = []; i = 0
    while time.monotonic() - start < seconds:
        tasks.append(asyncio.create_task(one(i))); i += 1
        await asyncio.sleep(1 / rate)
    ok = sum(await asyncio.gather(*tasks))
    follower.cancel()
    print(i, ok, flush=True)
asyncio.run(main())
"""

FLOODER = """
import asyncio, sys
from bench.pg_subscribers import RawSocket
port, rv, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
async def main():
    async def one(i):
        path = f"/replication/v6/changes?id=flood-{i}&replicaVersion={rv}&watermark={rv}"
        try:
            return await RawSocket.open(f"ws://127.0.0.1:{port}", path)
        except Exception:
            return None
    sockets = []
    for start in range(0, n, 100):
        sockets += await asyncio.gather(*(one(i) for i in range(start, min(n, start + 100))))
    print(sum(s is not None for s in sockets), flush=True)
    sys.stdin.readline()  # hold them until told
    for s in sockets:
        if s is not None:
            await s.close()
    print("closed", flush=True)
asyncio.run(main())
"""


async def run(
    port: int, proc: subprocess.Popen[bytes], args: argparse.Namespace
) -> dict[str, object]:
    replica_version = await asyncio.to_thread(statz_replica_version, port)
    phase = args.seconds
    samples: list[float] = []
    # Until stopped: opening the flood takes longer than a phase now that new
    # streams are admitted at CHANGESTREAMER_MAX_HANDSHAKES_PER_SECOND.
    stop = asyncio.Event()
    steady = asyncio.create_task(steady_rate(port, replica_version, stop, samples))
    await asyncio.sleep(2)  # past the catch-up
    t0 = time.monotonic()
    await asyncio.sleep(phase)
    baseline = window_rate(samples, t0, time.monotonic())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # A reconnecting replica resumes near the head; "start" makes every one catch up
    # on the whole log.
    from_watermark = (
        replica_version
        if args.churn_from == "start"
        else await asyncio.to_thread(statz_field, port, "durableWatermark")
    )
    churner = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHURNER,
        str(port),
        replica_version,
        str(args.rate),
        str(phase),
        from_watermark,
        env=env,
        stdout=subprocess.PIPE,
    )
    t1 = time.monotonic()
    out, _ = await churner.communicate()
    churn = window_rate(samples, t1, time.monotonic())
    opened, served = (int(x) for x in out.split())
    rss_before = tree_rss_mib(proc.pid)
    by_process_before = rss_by_process_mib(proc.pid)
    heap = (
        asyncio.create_task(asyncio.to_thread(heap_window, port, args.heap_window))
        if args.heap_window
        else None
    )
    floods = [
        await flood_once(port, proc, replica_version, args, samples, env)
        for _ in range(args.floods)
    ]
    held, rss_open, flood, rss_after = floods[0]
    by_process_after = rss_by_process_mib(proc.pid)
    stop.set()
    await steady
    metrics = await asyncio.to_thread(connection_metrics, port)
    if heap is not None:
        print(await heap, file=sys.stderr)
    return {
        "baseline_changes_per_s": round(baseline),
        "churn_changes_per_s": round(churn),
        "churn_ratio": round(churn / baseline, 3) if baseline else None,
        "churn_connections": opened,
        "churn_served": served,
        "flood_connections_held": held,
        "flood_changes_per_s": round(flood),
        "rss_before_flood_mib": rss_before,
        "rss_flood_open_mib": rss_open,
        "rss_after_flood_mib": rss_after,
        "rss_after_each_flood_mib": [f[3] for f in floods],
        "rss_by_process_before_flood_mib": by_process_before,
        "rss_by_process_after_flood_mib": by_process_after,
        **metrics,
    }


PASSWORD_ENV = "BENCH_CHURN_ADMIN_PASSWORD"


async def flood_once(
    port: int,
    proc: subprocess.Popen[bytes],
    replica_version: str,
    args: argparse.Namespace,
    samples: list[float],
    env: dict[str, str],
) -> tuple[int, int, float, int]:
    """One flood: connections held, RSS with them open, the steady subscriber's rate
    meanwhile, and RSS ``--after`` seconds after they all closed."""
    flooder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        FLOODER,
        str(port),
        replica_version,
        str(args.flood),
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert flooder.stdout is not None
    assert flooder.stdin is not None
    held = int(await flooder.stdout.readline())
    rss_open = tree_rss_mib(proc.pid)
    t2 = time.monotonic()
    await asyncio.sleep(min(args.seconds, 5))
    rate = window_rate(samples, t2, time.monotonic())
    flooder.stdin.write(b"\n")
    await flooder.stdin.drain()
    await flooder.stdout.readline()
    await flooder.wait()
    await asyncio.sleep(args.after)  # past serve's next malloc_trim (every 10 s)
    return held, rss_open, rate, tree_rss_mib(proc.pid)


def heap_window(port: int, seconds: int) -> str:
    """``/heapz`` over a tracing window of ``seconds`` from now: what was allocated
    in it and is still held at its end (a leak's signature)."""
    return get(f"http://127.0.0.1:{port}/heapz?seconds={seconds}", seconds + 60).decode()


def connection_metrics(port: int) -> dict[str, float]:
    """What the connection bounds did over the whole run (/metrics)."""
    body = get(f"http://127.0.0.1:{port}/metrics").decode()
    wanted = ("changestreamer_handshakes_held_total", "changestreamer_connections_refused_total")
    return {
        line.split()[0]: float(line.split()[1])
        for line in body.splitlines()
        if line.startswith(wanted)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase")
    parser.add_argument("--rate", type=float, default=200.0, help="churn: connections a second")
    parser.add_argument("--flood", type=int, default=2000, help="connections held at once")
    parser.add_argument("--demo-rate", type=float, default=20000.0, help="demo transactions/s")
    parser.add_argument(
        "--churn-from",
        choices=("head", "start"),
        default="head",
        help="where churning subscribers resume: the log's head, or its start",
    )
    parser.add_argument("--floods", type=int, default=1, help="floods, one after another")
    parser.add_argument(
        "--after", type=float, default=12.0, help="seconds from a flood's end to its RSS"
    )
    parser.add_argument(
        "--heap-window",
        type=int,
        default=0,
        metavar="S",
        help="trace allocations for S seconds (at most 60) from the flood's start and "
        "print /heapz to stderr: what the flood allocated and serve still holds",
    )
    args = parser.parse_args(argv)
    demo = {
        "CHANGESTREAMER_DEMO_TRANSACTIONS_PER_SECOND": str(args.demo_rate),
        # Every connection comes from this host: the subscriber limit is what is measured.
        "CHANGESTREAMER_MAX_SOCKETS_PER_ADDRESS": str(10 * args.flood),
    }
    if args.heap_window:
        os.environ[PASSWORD_ENV] = demo["ZERO_ADMIN_PASSWORD"] = "bench-churn"
    with (
        tempfile.TemporaryDirectory(prefix="bch-") as work,
        running_serve(Path(work), demo) as (proc, port),
    ):
        result = asyncio.run(run(port, proc, args))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
