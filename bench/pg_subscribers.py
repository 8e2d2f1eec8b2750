"""K v6 ``/changes`` subscribers in their own process, for ``bench.pg_e2e``.

    python -m bench.pg_subscribers BASE_URL K REPLICA_VERSION WATERMARK SENTINEL [--timeout S]

Each subscriber opens ``BASE_URL/replication/v6/changes`` at WATERMARK (a stored
commit watermark, or the replica version itself), acks every frame the moment it
arrives (as zero's replicator acks each message once it has taken it), and stops
at the commit of the transaction whose data carries SENTINEL. The process speaks
JSON lines on stdout:

* ``{"event": "ready"}`` once every subscriber has its first message (``status``):
  the server validated the watermark and the subscriber is live, so the writer may
  start;
* ``{"event": "done", ...}`` with, per subscriber, data changes received, the wall
  clock (``time.time()``) of the final commit, the final watermark, and commit
  latencies (receipt time minus the commit's upstream ``commitTime``) for the
  first subscriber;
* ``{"event": "error", "message": ...}`` on a refused subscription, a closed socket
  or the timeout (with the progress so far), exit status 1.

Both implementations frame envelopes as ``{"id":N,"msg":[...]}`` (key order id,
msg, no spaces), so the tag and id are read by position, not by parsing JSON;
only commit frames are parsed, and only when their body is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect

_MSG = ',"msg":["'
# A change-streamer that falls silent for this long mid-run has stalled: fail
# instead of waiting for the global timeout.
_FRAME_TIMEOUT_S = 60.0


@dataclass
class Progress:
    """What one subscriber has seen so far."""

    frames: int = 0
    changes: int = 0
    final_receipt: float | None = None
    final_watermark: str | None = None
    latencies_ms: list[float] = field(default_factory=list)


class SubscriptionRefused(Exception):
    """The first message was not ``status`` (e.g. an ``error`` message)."""


def changes_url(base: str, sub_id: str, replica_version: str, watermark: str) -> str:
    """The v6 ``/changes`` URL, with the query a 1.9.0 replicator sends."""
    return (
        f"{base.rstrip('/')}/replication/v6/changes?taskID=&id={sub_id}&mode=serving"
        f"&watermark={watermark}&replicaVersion={replica_version}&initial=true"
    )


def _tag(frame: str) -> tuple[str, str]:
    """(envelope id, message tag) by position: ``{"id":N,"msg":["tag",...``."""
    head = frame.index(_MSG)
    start = head + len(_MSG)
    return frame[6:head], frame[start : frame.index('"', start)]


def _commit_latency_ms(msg: Any, received: float) -> float:
    """Receipt minus upstream commit time: ``commitTime`` (µs) if sent, else ms."""
    body = msg[1]
    commit_us = body.get("commitTime")
    if isinstance(commit_us, int):
        return received * 1000.0 - commit_us / 1000.0
    return received * 1000.0 - float(body["commitTimeMs"])


async def _next(ws: ClientConnection) -> str:
    frame = await asyncio.wait_for(ws.recv(), _FRAME_TIMEOUT_S)
    if not isinstance(frame, str):
        raise SubscriptionRefused("binary frame from the change-streamer")
    return frame


async def subscribe(
    url: str,
    sentinel: str,
    progress: Progress,
    ready: asyncio.Event,
    record_latency: bool,
) -> None:
    """Run one subscriber until the sentinel transaction's commit."""
    async with connect(url, max_size=None, max_queue=None, compression=None) as ws:
        first = await _next(ws)
        msg_id, tag = _tag(first)
        await ws.send('{"ack":' + msg_id + "}")
        if tag != "status":
            raise SubscriptionRefused(first[:300])
        ready.set()
        seen_sentinel = False
        while True:
            frame = await _next(ws)
            received = time.time()
            msg_id, tag = _tag(frame)
            progress.frames += 1
            # Ack before anything else: the server's flow control waits on acks.
            await ws.send('{"ack":' + msg_id + "}")
            if tag == "data":
                progress.changes += 1
                if not seen_sentinel and sentinel in frame:
                    seen_sentinel = True
            elif tag == "commit":
                if record_latency or seen_sentinel:
                    msg = orjson.loads(frame)["msg"]
                    if record_latency:
                        progress.latencies_ms.append(_commit_latency_ms(msg, received))
                    if seen_sentinel:
                        progress.final_receipt = received
                        progress.final_watermark = msg[2]["watermark"]
                        return
            elif tag == "error":
                raise SubscriptionRefused(frame[:300])


def _emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


async def run(args: argparse.Namespace) -> int:
    progress = [Progress() for _ in range(args.k)]
    readies = [asyncio.Event() for _ in range(args.k)]
    tasks = [
        asyncio.create_task(
            subscribe(
                changes_url(args.base_url, f"hpd-bench-{i}", args.replica_version, args.watermark),
                args.sentinel,
                progress[i],
                readies[i],
                record_latency=(i == 0),
            )
        )
        for i in range(args.k)
    ]

    async def announce_ready() -> None:
        for ready in readies:
            await ready.wait()
        _emit({"event": "ready"})

    announcer = asyncio.create_task(announce_ready())
    try:
        async with asyncio.timeout(args.timeout):
            await asyncio.gather(*tasks)
    except Exception as e:  # timeout, refusal, closed socket: all end the run
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        _emit(
            {
                "event": "error",
                "message": f"{type(e).__name__}: {e}",
                "changes": [p.changes for p in progress],
                "frames": [p.frames for p in progress],
            }
        )
        return 1
    finally:
        announcer.cancel()
        await asyncio.gather(announcer, return_exceptions=True)
    _emit(
        {
            "event": "done",
            "changes": [p.changes for p in progress],
            "frames": [p.frames for p in progress],
            "final_receipts": [p.final_receipt for p in progress],
            "final_watermark": progress[0].final_watermark,
            "latencies_ms": progress[0].latencies_ms,
        }
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.pg_subscribers")
    parser.add_argument("base_url", help="ws://host:port of the change-streamer")
    parser.add_argument("k", type=int, help="number of subscribers")
    parser.add_argument("replica_version")
    parser.add_argument("watermark", help="a stored commit watermark or the replica version")
    parser.add_argument("sentinel", help="text in the last transaction's data")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
