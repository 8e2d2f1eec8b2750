"""Forward-store-ack throughput, latency and isolation, through the in-process API.

    python -m bench.fanout                       # all scenarios
    python -m bench.fanout --scenarios throughput --changes 200000

Until the websocket server exists this drives ``ChangeStreamerService`` directly:
an in-process source hands it pre-built, validated messages (so the source's own
parsing is not measured), the change log is a SQLite file (synchronous=FULL),
and each subscriber is a task that takes messages from its channel and acks
them at once, in the same process and on the same core as the service.

Scenarios:

* ``throughput`` — K = 1, 4, 16 subscribers; transactions of 5 inserts
  (~220-byte changes) as fast as the service takes them. Reports data changes/s
  stored and delivered to every subscriber, and messages/s delivered in total.
* ``latency`` — one subscriber, the source paced at ``--rate`` changes/s; p50 and
  p99 of commit-received-by-subscriber minus commit-handed-to-the-service.
* ``ws`` — the same over real websockets: the service behind uvicorn on loopback,
  K = 1, 4, 16 subscribers in a separate process (``bench.ws_subscribers``), with
  one message per frame (v6) and with v7 batch frames; reports changes/s stored
  and delivered to all, and frames/s in total.
* ``stall`` — 8 subscribers, as fast as possible, all healthy and with one that
  never acks, three interleaved pairs; reports the median rate of the healthy
  subscribers in each case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from app.protocol.lexi import to_lexi
from app.protocol.messages import ChangeSourceMessage, parse_change_source_message
from app.runtime.gc_tuning import tune_for_streaming
from app.sources.base import BackfillRequest, ChangeSource, ChangeStream
from app.storage import (
    ChangeDb,
    ChangeDbOptions,
    ChangeLog,
    Replication,
    Shard,
    SubscriptionState,
    create_change_db,
    migrate,
    parse_change_db_url,
)
from app.storage.engine import SqliteWriter
from app.streamer.downstream import Downstream, DownstreamClosed
from app.streamer.service import ChangeStreamerService, SubscriberContext

REPLICA_VERSION = "01"
ROWS_PER_TX = 5


def build_transactions(
    count: int, *, commit_times: bool = False
) -> list[tuple[str, list[ChangeSourceMessage]]]:
    """``count`` transactions; with ``commit_times`` their commits carry an upstream
    ``commitTimeMs``, as Postgres' do (the service then times each one to its forward)."""
    commit: dict[str, Any] = {"tag": "commit"}
    if commit_times:
        commit["commitTimeMs"] = 1764426733675
    out = []
    for n in range(2, count + 2):
        w = to_lexi(n)
        msgs: list[Any] = [["begin", {"tag": "begin"}, {"commitWatermark": w}]]
        for i in range(ROWS_PER_TX):
            msgs.append(
                [
                    "data",
                    {
                        "tag": "insert",
                        "relation": {
                            "schema": "public",
                            "name": "issues",
                            "rowKey": {"columns": ["id"], "type": "default"},
                        },
                        "new": {
                            "id": f"{n:08d}-{i}",
                            "title": f"Benchmark row number {n * 10 + i}",
                            "status": "open",
                            "priority": 3,
                            "modified": 1764426733675.125,
                        },
                    },
                ]
            )
        msgs.append(["commit", commit, {"watermark": w}])
        out.append((w, [parse_change_source_message(m) for m in msgs]))
    return out


class ListStream(ChangeStream):
    """Yields prepared transactions, optionally paced to a change rate."""

    def __init__(
        self,
        txs: list[tuple[str, list[ChangeSourceMessage]]],
        *,
        rate: float | None,
        sent_at: dict[str, float],
        gate: asyncio.Event | None = None,
    ) -> None:
        self._txs = txs
        self._rate = rate
        self._sent_at = sent_at
        self._gate = gate
        self._closed = False
        self._closed_event = asyncio.Event()

    async def _gen(self) -> AsyncIterator[ChangeSourceMessage]:
        if self._gate is not None:
            await self._gate.wait()
        start = time.perf_counter()
        changes = 0
        for i, (w, msgs) in enumerate(self._txs):
            if self._closed:
                return
            if self._rate is not None:
                due = start + changes / self._rate
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            elif i % 20 == 0:
                await asyncio.sleep(0)
            for m in msgs[:-1]:
                yield m
            self._sent_at[w] = time.perf_counter()
            yield msgs[-1]
            changes += ROWS_PER_TX
        await self._closed_event.wait()

    def __aiter__(self) -> AsyncIterator[ChangeSourceMessage]:
        return self._gen()

    def ack(self, status: list[Any]) -> None:
        pass

    async def close(self) -> None:
        self._closed = True
        self._closed_event.set()


class ListSource(ChangeSource):
    def __init__(self, stream: ListStream) -> None:
        self._stream = stream

    async def start_stream(
        self, after_watermark: str, backfill_requests: list[BackfillRequest]
    ) -> ChangeStream:
        return self._stream


async def consume(
    ds: Downstream, final: str, received_at: dict[str, float] | None, *, ack: bool = True
) -> int:
    """Takes and acks messages until the final commit; returns messages received."""
    n = 0
    try:
        while True:
            text = await ds.get()
            n += 1
            if ack:
                ds.ack_next()
            else:
                await asyncio.sleep(3600)
            if text.startswith('["commit"'):
                w = text[text.rindex(":") + 2 : -3]
                if received_at is not None:
                    received_at[w] = time.perf_counter()
                if w == final:
                    return n
    except (DownstreamClosed, asyncio.CancelledError):
        return n


async def open_change_db(path: Path, writer: SqliteWriter) -> ChangeDb:
    """A migrated change DB at ``path``, its writer process (if any) already started,
    as it is once ``serve`` streams."""
    db = create_change_db(
        parse_change_db_url(str(path)), Shard(), ChangeDbOptions(sqlite_writer=writer)
    )
    await migrate(db)
    await Replication(db).ensure_config(
        SubscriptionState(REPLICA_VERSION, (), REPLICA_VERSION), auto_reset=False
    )
    await ChangeLog(db).start_writer()
    return db


def writer_cpu_s(db: ChangeDb) -> float:
    """CPU seconds the SQLite writer process has used so far (0 without one)."""
    pid = db.sqlite_writer.pid if db.sqlite_writer is not None else None
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(
    txs: list[tuple[str, list[ChangeSourceMessage]]],
    subscribers: int,
    *,
    rate: float | None = None,
    stalled: int = 0,
    writer: SqliteWriter = "process",
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        db = await open_change_db(Path(tmp) / "cdc.db", writer)
        sent_at: dict[str, float] = {}
        received_at: dict[str, float] = {}
        stream = ListStream(txs, rate=rate, sent_at=sent_at)
        service = ChangeStreamerService(
            db=db,
            source=ListSource(stream),
            task_id="bench",
            address=None,
            replica_version=REPLICA_VERSION,
            durable_watermark=REPLICA_VERSION,
        )
        final = txs[-1][0]
        consumers = []
        for i in range(subscribers):
            ds = service.subscribe(
                SubscriberContext(6, f"s{i}", "serving", REPLICA_VERSION, REPLICA_VERSION)
            )
            consumers.append(
                asyncio.create_task(
                    consume(ds, final, received_at if i == 0 else None, ack=i >= stalled)
                )
            )
        start = time.perf_counter()
        loop_cpu_start = time.thread_time()  # this thread runs the event loop
        runner = asyncio.create_task(service.run())
        healthy = consumers[stalled:]
        counts = await asyncio.gather(*healthy)
        delivered_s = time.perf_counter() - start
        await service.storer.wait_durable(final)
        stored_s = time.perf_counter() - start
        loop_cpu = time.thread_time() - loop_cpu_start
        for task in consumers[:stalled]:
            task.cancel()
        await service.stop()
        await asyncio.gather(runner, *consumers, return_exceptions=True)
        await db.dispose()
    changes = len(txs) * ROWS_PER_TX
    latencies = sorted((received_at[w] - sent_at[w]) * 1000 for w in received_at if w in sent_at)
    return {
        "changes/s": changes / max(delivered_s, stored_s),
        "messages/s delivered": sum(counts) / delivered_s,
        "p50 ms": statistics.median(latencies) if latencies else float("nan"),
        "p99 ms": latencies[int(len(latencies) * 0.99) - 1] if latencies else float("nan"),
        "healthy changes/s": changes / delivered_s,
        "loop us/change": loop_cpu / changes * 1e6,
    }


async def run_ws(
    txs: list[tuple[str, list[ChangeSourceMessage]]],
    subscribers: int,
    *,
    batched: bool,
    writer: SqliteWriter = "process",
) -> dict[str, float]:
    """The service behind uvicorn; K websocket subscribers in a child process."""
    import socket

    import uvicorn

    from app.server.app import create_app
    from app.server.ws_protocol import LivenessProtocol

    with tempfile.TemporaryDirectory() as tmp:
        db = await open_change_db(Path(tmp) / "cdc.db", writer)
        gate = asyncio.Event()
        stream = ListStream(txs, rate=None, sent_at={}, gate=gate)
        service = ChangeStreamerService(
            db=db,
            source=ListSource(stream),
            task_id="bench",
            address=None,
            replica_version=REPLICA_VERSION,
            durable_watermark=REPLICA_VERSION,
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(db, service),
                host="127.0.0.1",
                port=port,
                log_level="warning",
                ws_per_message_deflate=False,
                ws=LivenessProtocol,
            )
        )
        serving = asyncio.create_task(server.serve())
        for _ in range(3000):  # up to 30 s
            if server.started:
                break
            await asyncio.sleep(0.01)
        version = 7 if batched else 6
        url = (
            f"ws://127.0.0.1:{port}/replication/v{version}/changes?"
            f"replicaVersion={REPLICA_VERSION}&watermark={REPLICA_VERSION}"
            + ("&wsBatched=true" if batched else "")
        )
        final = txs[-1][0]
        children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.ws_subscribers",
            url,
            str(subscribers),
            final,
            stdout=asyncio.subprocess.PIPE,
        )
        forwarder = service.forwarder
        for _ in range(6000):  # up to 60 s for the child's connections
            if len(forwarder.active) + len(forwarder.queued) >= subscribers:
                break
            await asyncio.sleep(0.01)
        start = time.perf_counter()
        cpu_start = resource.getrusage(resource.RUSAGE_SELF)
        writer_cpu_start = writer_cpu_s(db)
        loop_cpu_start = time.thread_time()  # this thread runs the event loop
        gate.set()
        out, _ = await child.communicate()
        delivered_s = time.perf_counter() - start
        await service.storer.wait_durable(final)
        stored_s = time.perf_counter() - start
        cpu_end = resource.getrusage(resource.RUSAGE_SELF)
        writer_cpu = writer_cpu_s(db) - writer_cpu_start
        loop_cpu = time.thread_time() - loop_cpu_start
        child_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
        server.should_exit = True
        await serving
        await db.dispose()
    result = json.loads(out)
    changes = len(txs) * ROWS_PER_TX
    return {
        "changes/s": changes / max(delivered_s, stored_s),
        "frames/s": result["frames"] / delivered_s,
        "delivered s": delivered_s,
        "stored s": stored_s,
        # CPU per data change: the service process (all threads) from the gate to
        # the final commit stored, and the subscriber process over its whole life.
        # The service includes its SQLite writer process.
        "service us/change": (_cpu(cpu_start, cpu_end) + writer_cpu) / changes * 1e6,
        "loop us/change": loop_cpu / changes * 1e6,
        "subscribers us/change": _cpu(children_before, child_cpu) / changes * 1e6,
    }


def _cpu(start: resource.struct_rusage, end: resource.struct_rusage) -> float:
    return end.ru_utime + end.ru_stime - start.ru_utime - start.ru_stime


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default="throughput,ws,latency,stall")
    parser.add_argument("--changes", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=10_000.0)
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--ks", default="1,4,16", help="subscriber counts to run")
    parser.add_argument("--frames", default="msg,batch", help="ws framings: msg (v6), batch (v7)")
    parser.add_argument(
        "--commit-times", action="store_true", help="commits carry commitTimeMs (as Postgres')"
    )
    parser.add_argument(
        "--sqlite-writer",
        default="process",
        choices=["process", "thread"],
        help="where SQLite group commits run (ChangeDbOptions.sqlite_writer)",
    )
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    txs = build_transactions(args.changes // ROWS_PER_TX, commit_times=args.commit_times)
    # As `changestreamer serve` does after start-up; this also takes the prebuilt
    # transactions (over a million objects) out of the collector's full passes,
    # which had cost up to ~0.9 s a run: that was the benchmark, not the service.
    tune_for_streaming()
    ks = [int(k) for k in args.ks.split(",")]
    framings = args.frames.split(",")

    if "throughput" in scenarios:
        print(
            f"{'K':>3} {'changes/s (stored+delivered)':>30} {'messages/s delivered':>22}"
            f" {'event loop CPU µs/change':>26}"
        )
        for k in ks:
            r = await run(txs, k, writer=args.sqlite_writer)
            rate, delivered = r["changes/s"], r["messages/s delivered"]
            print(
                f"{k:>3} {rate:>30,.0f} {delivered:>22,.0f} {r['loop us/change']:>26.1f}",
                flush=True,
            )
    if "ws" in scenarios:
        print(f"{'K':>3} {'frames':>8} {'changes/s (stored+delivered)':>30} {'frames/s':>10}")
        for k in ks:
            for kind in framings:
                r = await run_ws(txs, k, batched=kind == "batch", writer=args.sqlite_writer)
                print(
                    f"{k:>3} {kind:>8} {r['changes/s']:>30,.0f} {r['frames/s']:>10,.0f}"
                    f"  (delivered {r['delivered s']:.2f} s, stored {r['stored s']:.2f} s; CPU "
                    f"per change: service {r['service us/change']:.1f} µs "
                    f"(event loop {r['loop us/change']:.1f}), "
                    f"subscribers {r['subscribers us/change']:.1f} µs)",
                    flush=True,
                )
    if "latency" in scenarios:
        n = int(args.rate * args.latency_seconds) // ROWS_PER_TX
        r = await run(
            build_transactions(n, commit_times=args.commit_times),
            1,
            rate=args.rate,
            writer=args.sqlite_writer,
        )
        print(
            f"latency at {args.rate:,.0f} changes/s, 1 subscriber: "
            f"p50 {r['p50 ms']:.2f} ms, p99 {r['p99 ms']:.2f} ms",
            flush=True,
        )
    if "stall" in scenarios:
        # Interleaved pairs, medians: on a shared 2-core VM single runs swing ±30 %.
        healthy, stalled = [], []
        for _ in range(3):
            healthy.append((await run(txs, 8, writer=args.sqlite_writer))["healthy changes/s"])
            stalled.append(
                (await run(txs, 8, stalled=1, writer=args.sqlite_writer))["healthy changes/s"]
            )
        base, slow = statistics.median(healthy), statistics.median(stalled)
        print(
            f"8 subscribers (median of 3 interleaved pairs): all healthy {base:,.0f} "
            f"changes/s each; one stalled: the 7 others {slow:,.0f} changes/s "
            f"({slow / base:.0%} of healthy)",
            flush=True,
        )


if __name__ == "__main__":
    # uvloop, as `changestreamer serve` gets it from uvicorn.
    import uvloop

    uvloop.run(main())
