"""Randomized interleaving: a model upstream and model subscribers against the real
service on a real SQLite change log.

The upstream commits random transactions, rolls some back, and breaks the stream
at random points (also mid-transaction); after each break it re-sends, as a real
source must, every committed transaction after the watermark the service asks
for. Subscribers connect, consume at random speeds, drop their connection at
random points and resume from the last commit they processed.

For every subscriber: commits strictly increase, the committed transactions it
received are exactly the stored ones (no gap, no duplicate, same contents), and
once the upstream stops it reaches the last stored commit. Each seed is
reproducible in its choices; many seeds run in CI.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from app.protocol.canonical_json import loads
from app.protocol.codec import change_tag
from app.protocol.lexi import to_lexi
from app.storage import (
    ChangeLog,
    Shard,
    create_change_db,
    parse_change_db_url,
)
from app.streamer.downstream import DownstreamClosed
from app.streamer.service import ChangeStreamerService, StreamerOptions, SubscriberContext
from app.streamer.timers import ManualTimers
from tests.change_dbs import migrated
from tests.memory_source import MemoryChangeSource, MemoryChangeStream

from .helpers import whole

REPLICA_VERSION = "01"
SEEDS = range(12)
TRANSACTIONS = 120


class Upstream:
    """The model source: committed history plus a script for each new stream."""

    def __init__(self, source: MemoryChangeSource, rng: random.Random) -> None:
        self.source = source
        self.rng = rng
        self.committed: list[tuple[str, list[list[Any]]]] = []  # (watermark, data messages)
        self.next = 2
        self.done = asyncio.Event()

    def _make_tx(self) -> tuple[str, list[list[Any]]]:
        w = to_lexi(self.next)
        self.next += self.rng.randint(1, 3)
        rows = []
        for i in range(self.rng.randint(1, 5)):
            size = self.rng.choice([10, 100, 3000])
            rows.append(
                [
                    "data",
                    {
                        "tag": "insert",
                        "relation": {
                            "schema": "public",
                            "name": "t",
                            "rowKey": {"columns": ["id"]},
                        },
                        "new": {"id": f"{w}-{i}", "pad": "x" * size},
                    },
                ]
            )
        return w, rows

    async def run(self) -> None:
        streams = 0
        while len(self.committed) < TRANSACTIONS:
            streams += 1
            stream = await asyncio.wait_for(self.source.wait_for_stream(streams), 20)
            await self._serve(stream)
        self.done.set()

    async def _serve(self, stream: MemoryChangeStream) -> None:
        after = stream.after_watermark
        # Re-send what was committed after the service's durable point.
        for w, rows in self.committed:
            if w > after:
                stream.push_all(
                    [
                        ["begin", {"tag": "begin"}, {"commitWatermark": w}],
                        *rows,
                        ["commit", {"tag": "commit"}, {"watermark": w}],
                    ]
                )
        while len(self.committed) < TRANSACTIONS:
            # Jitter, not a wait: random pauses are how the interleavings vary.
            await asyncio.sleep(self.rng.choice([0, 0, 0, 0.001, 0.005]))
            if stream.closed:
                return
            w, rows = self._make_tx()
            roll = self.rng.random()
            begin = ["begin", {"tag": "begin"}, {"commitWatermark": w}]
            if roll < 0.08:
                stream.push_all([begin, *rows, ["rollback", {"tag": "rollback"}]])
            elif roll < 0.13:
                cut = self.rng.randint(0, len(rows))
                stream.push_all([begin, *rows[:cut]])
                stream.fail(ConnectionError("upstream broke mid-transaction"))
                return
            elif roll < 0.16:
                self.committed.append((w, rows))
                stream.push_all([begin, *rows, ["commit", {"tag": "commit"}, {"watermark": w}]])
                stream.fail(ConnectionError("upstream broke between transactions"))
                return
            else:
                self.committed.append((w, rows))
                stream.push_all([begin, *rows, ["commit", {"tag": "commit"}, {"watermark": w}]])
                if self.rng.random() < 0.1:
                    stream.push(["status", {"ack": True}, {"watermark": w}])


class Client:
    """A model subscriber that consumes, lags and reconnects at random."""

    def __init__(self, name: str, service: ChangeStreamerService, rng: random.Random) -> None:
        self.name = name
        self.service = service
        self.rng = rng
        self.watermark = REPLICA_VERSION
        self.commits: list[tuple[str, list[Any]]] = []
        self.errors: list[Any] = []
        self.slow = rng.random() < 0.4

    async def run(self, stop: asyncio.Event) -> None:
        connection = 0
        while not stop.is_set() or self.watermark < stop_target(stop):
            connection += 1
            ds = self.service.subscribe(
                SubscriberContext(
                    6, f"{self.name}-{connection}", "serving", REPLICA_VERSION, self.watermark
                )
            )
            open_tx: list[Any] | None = None
            budget = self.rng.randint(5, 200) if self.rng.random() < 0.5 else 10**9
            try:
                while budget > 0:
                    budget -= 1
                    msg = loads(whole(await asyncio.wait_for(ds.get(), 0.5)))
                    if self.slow:
                        # A slow reader is the point (jittered to vary interleavings).
                        await asyncio.sleep(self.rng.choice([0, 0.001, 0.003]))
                    kind = msg[0]
                    if kind == "error":
                        self.errors.append(msg)
                        return
                    if kind == "begin":
                        assert open_tx is None, f"{self.name}: begin inside a transaction"
                        open_tx = []
                    elif kind == "data":
                        assert open_tx is not None, f"{self.name}: data outside a transaction"
                        open_tx.append(msg)
                    elif kind == "rollback":
                        open_tx = None
                    elif kind == "commit":
                        assert open_tx is not None, f"{self.name}: commit outside a transaction"
                        w = msg[2]["watermark"]
                        assert w > self.watermark, (
                            f"{self.name}: commit {w} not after {self.watermark}"
                        )
                        self.commits.append((w, open_tx))
                        self.watermark = w
                        open_tx = None
                    ds.ack_next()
            except (TimeoutError, DownstreamClosed):
                pass
            finally:
                ds.close()  # a disconnect; the next connection resumes at self.watermark
            await asyncio.sleep(0)


def stop_target(stop: asyncio.Event) -> str:
    return getattr(stop, "target", "zz")


async def run_seed(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    db = create_change_db(parse_change_db_url(str(tmp_path / f"cdc-{seed}.db")), Shard())
    await migrated(db, replica_version=REPLICA_VERSION)
    source = MemoryChangeSource()
    service = ChangeStreamerService(
        db=db,
        source=source,
        task_id="owner",
        address=None,
        replica_version=REPLICA_VERSION,
        durable_watermark=REPLICA_VERSION,
        options=StreamerOptions(
            backoff_initial_s=0.001, backoff_max_s=0.01, back_pressure_bytes=200_000
        ),
        timers=ManualTimers(),
    )
    upstream = Upstream(source, random.Random(rng.random()))
    clients = [Client(f"c{i}", service, random.Random(rng.random())) for i in range(3)]
    stop = asyncio.Event()
    run = asyncio.create_task(service.run())
    client_tasks = [asyncio.create_task(c.run(stop)) for c in clients]
    try:
        await asyncio.wait_for(upstream.run(), 60)
        final = upstream.committed[-1][0]
        await asyncio.wait_for(service.storer.wait_durable(final), 20)
        stop.target = final  # type: ignore[attr-defined]
        stop.set()
        await asyncio.wait_for(asyncio.gather(*client_tasks), 30)
    finally:
        for t in client_tasks:
            t.cancel()
        await service.stop()
        await asyncio.gather(run, *client_tasks, return_exceptions=True)

    stored: list[tuple[str, list[Any]]] = []
    current: list[Any] = []
    async for batch in ChangeLog(db).read("02", "zz"):
        for w, _pos, change, _ in batch:
            tag = change_tag(change)
            if tag == "begin":
                current = []
            elif tag == "commit":
                stored.append((w, current))
            else:
                current.append(["data", loads(whole(change))])
    await db.dispose()

    assert [w for w, _ in stored] == [w for w, _ in upstream.committed], (
        f"seed {seed}: stored log differs from upstream commits"
    )
    for client in clients:
        assert client.errors == [], f"seed {seed} {client.name}: {client.errors}"
        assert [w for w, _ in client.commits] == [w for w, _ in stored], (
            f"seed {seed} {client.name}: gap or duplicate"
        )
        assert client.commits == stored, f"seed {seed} {client.name}: contents differ"


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_interleavings_deliver_every_stored_transaction_exactly_once(
    seed: int, tmp_path: Path
) -> None:
    await run_seed(seed, tmp_path)
