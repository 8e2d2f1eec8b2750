"""K v6 ``/changes`` subscribers in their own process, for ``bench.pg_e2e``.

    python -m bench.pg_subscribers BASE_URL K REPLICA_VERSION WATERMARK SENTINEL [--timeout S]

Each subscriber opens ``BASE_URL/replication/v6/changes`` at WATERMARK (a stored
commit watermark, or the replica version itself), acks every frame the moment it
arrives (as zero's replicator acks each message once it has taken it), and stops
at the commit of the transaction whose data carries SENTINEL. The process speaks
JSON lines on stdout:

* ``{"event": "ready", "connecting_at": T}`` once every subscriber has its first
  message (``status``): the server validated the watermark and the subscriber is
  live, so the writer may start; T is the wall clock just before the first socket
  was opened (a catch-up is timed from there, not from this process's start-up);
* ``{"event": "done", ...}`` with, per subscriber, data changes received, the wall
  clock (``time.time()``) of the final commit, the final watermark, and commit
  latencies (receipt time minus the commit's upstream ``commitTime``) for the
  first subscriber;
* ``{"event": "error", "message": ...}`` on a refused subscription, a closed socket
  or the timeout (with the progress so far), exit status 1.

The websocket client is a minimal one written here (``RawSocket``): a 16-subscriber
run moves about a million frames, and with the ``websockets`` library this process
burnt more CPU than the service under test on a 2-core machine. Both
implementations frame envelopes as ``{"id":N,"msg":[...]}`` (key order id, msg, no
spaces), so the tag and id are read by position, not by parsing JSON; only commit
messages are parsed, and only when their body is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from bench._build import rawscan

# The frame loop in C (bench/_rawscan.c, compiled on first use by bench/_build.py);
# None without a compiler or with CHANGESTREAMER_SPEEDUPS=0: the Python loop below.
_rawscan = rawscan()
scan_acks = None if _rawscan is None else _rawscan.scan_acks

_MSG = b',"msg":["'
# A change-streamer that falls silent for this long mid-run has stalled: fail
# instead of waiting for the global timeout.
_FRAME_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 5.0
_READ_SIZE = 1 << 18
_OP_CONT, _OP_TEXT, _OP_CLOSE, _OP_PING = 0x0, 0x1, 0x8, 0x9


@dataclass
class Progress:
    """What one subscriber has seen so far."""

    frames: int = 0
    changes: int = 0
    final_receipt: float | None = None
    final_watermark: str | None = None
    latencies_ms: list[float] = field(default_factory=list)
    latency_receipts: list[float] = field(default_factory=list)  # time.time() of each


class SubscriptionRefused(Exception):
    """The first message was not ``status`` (e.g. an ``error`` message)."""


def changes_path(sub_id: str, replica_version: str, watermark: str) -> str:
    """The v6 ``/changes`` path and query, as a 1.9.0 replicator sends them."""
    return (
        f"/replication/v6/changes?taskID=&id={sub_id}&mode=serving"
        f"&watermark={watermark}&replicaVersion={replica_version}&initial=true"
    )


def _client_frame(opcode: int, payload: bytes) -> bytes:
    """A masked client frame (payload < 126 bytes). The all-zero mask key is legal
    and leaves the payload as is, so acks need no XOR pass."""
    return bytes((0x80 | opcode, 0x80 | len(payload))) + b"\0\0\0\0" + payload


def ack_frame(msg_id: bytes) -> bytes:
    return _client_frame(_OP_TEXT, b'{"ack":' + msg_id + b"}")


@functools.cache
def _ack_prefix(id_length: int) -> bytes:
    """``ack_frame(id)`` without its id and closing brace, for ids of this length."""
    return ack_frame(b"x" * id_length)[: -(id_length + 1)]


class RawSocket:
    """A minimal websocket client: handshake, unmasked server frames in, acks out.

    The ``websockets`` library costs ~35 µs of CPU per frame-plus-ack in this
    process; with 16 subscribers on a 2-core machine that CPU is taken from the
    service under test. This client parses frames straight from the read buffer
    and writes all acks for one read in one call.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._buf = b""
        self._pos = 0
        self._partial: list[bytes] = []

    @classmethod
    async def open(cls, base_url: str, path: str) -> RawSocket:
        host_port = base_url.split("://", 1)[1].rstrip("/")
        host, _, port = host_port.partition(":")
        reader, writer = await asyncio.open_connection(host, int(port or 80), limit=_READ_SIZE)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            (
                f"GET {path} HTTP/1.1\r\nHost: {host_port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _FRAME_TIMEOUT_S)
        if not head.startswith(b"HTTP/1.1 101"):
            writer.close()
            raise SubscriptionRefused(f"handshake refused: {head[:200]!r}")
        return cls(reader, writer)

    async def messages(self) -> AsyncIterator[list[bytes]]:
        """Text messages, a batch per socket read; control frames are handled here."""
        while True:
            await self._read()
            batch: list[bytes] = []
            self._scan(batch, ids_only=False)
            if batch:
                yield batch

    async def ack_each(self) -> AsyncIterator[tuple[int, bytes]]:
        """Per socket read: acks every text message (all acks in one write) and
        yields how many there were and the last one. For clients that only count
        (``bench.ws_subscribers``): no copy of each payload, ~2.5× less CPU per
        frame than ``messages`` plus per-message acks; with ``bench/_rawscan.c``
        compiled, the common frames are scanned and acked in C."""
        while True:
            await self._read()
            acks, count, last = self.take_acks()
            if count:
                self._writer.write(acks)
                yield count, last

    def take_acks(self) -> tuple[bytes, int, bytes]:
        """The ack frames for the whole text messages in the buffer, how many, and
        the last message; control frames are handled as ``_scan`` handles them."""
        acks, count, last = b"", 0, b""
        if scan_acks is not None:
            pos, acks, count, start, end, stuck = scan_acks(self._buf, self._pos)
            if count:
                last = self._buf[start:end]
            self._pos = pos
            if not stuck:
                return acks, count, last
        ids: list[bytes] = []
        rest_last = self._scan(ids, ids_only=True)
        if ids:
            acks += b"".join([_ack_prefix(len(i)) + i + b"}" for i in ids])
            count += len(ids)
            last = rest_last
        return acks, count, last

    async def _read(self) -> None:
        """Appends the next socket read to the unparsed rest of the buffer."""
        chunk = await asyncio.wait_for(self._reader.read(_READ_SIZE), _FRAME_TIMEOUT_S)
        if not chunk:
            raise SubscriptionRefused("the change-streamer closed the connection")
        self._buf = self._buf[self._pos :] + chunk
        self._pos = 0

    def _scan(self, out: list[bytes], *, ids_only: bool) -> bytes:
        """Takes the whole frames in the buffer: appends each text message to
        ``out``, or with ``ids_only`` just its id (``{"id":N,`` opens every server
        message); answers pings. Returns the last text message."""
        buf, pos, n = self._buf, self._pos, len(self._buf)
        last = b""
        while n - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            length, head = b1 & 0x7F, 2
            if length == 126:
                if n - pos < 4:
                    break
                length, head = int.from_bytes(buf[pos + 2 : pos + 4], "big"), 4
            elif length == 127:
                if n - pos < 10:
                    break
                length, head = int.from_bytes(buf[pos + 2 : pos + 10], "big"), 10
            if b1 & 0x80:
                raise SubscriptionRefused("masked frame from the server")
            start, end = pos + head, pos + head + length
            if n < end:
                break
            pos = end
            if b0 == 0x80 | _OP_TEXT and not self._partial and ids_only:
                # The common case when only counting: no copy of the message.
                out.append(buf[start + 6 : buf.index(b",", start + 6, end)])
                last = buf[start:end]
                continue
            opcode = b0 & 0x0F
            payload = buf[start:end]
            if opcode in (_OP_TEXT, _OP_CONT):
                self._partial.append(payload)
                if b0 & 0x80:
                    last = b"".join(self._partial)
                    self._partial.clear()
                    out.append(last[6 : last.index(b",")] if ids_only else last)
            elif opcode == _OP_PING:
                self._writer.write(_client_frame(0xA, payload))
            elif opcode == _OP_CLOSE:
                raise SubscriptionRefused(f"close frame {payload[:2].hex()} {payload[2:]!r}")
        self._pos = pos
        return last

    def send(self, data: bytes) -> None:
        self._writer.write(data)

    async def drain(self) -> None:
        await self._writer.drain()

    async def close(self) -> None:
        """Closes the socket; bounded: a peer that stops reading cannot take our
        unsent bytes, and waiting for them hung bench.churn's end."""
        self._writer.close()
        try:
            await asyncio.wait_for(self._writer.wait_closed(), CLOSE_TIMEOUT_S)
        except OSError:
            pass
        except TimeoutError:
            self._writer.transport.abort()


def _split(message: bytes) -> tuple[bytes, bytes]:
    """(envelope id, message tag) by position: ``{"id":N,"msg":["tag",...``."""
    head = message.index(_MSG)
    start = head + len(_MSG)
    return message[6:head], message[start : message.index(b'"', start)]


def _commit_latency_ms(msg: Any, received: float) -> float | None:
    """Receipt minus upstream commit time: ``commitTime`` (µs) if sent, else ms; None
    for a commit with neither (a backfill transaction is no upstream commit)."""
    body = msg[1]
    commit_us = body.get("commitTime")
    if isinstance(commit_us, int):
        return received * 1000.0 - commit_us / 1000.0
    commit_ms = body.get("commitTimeMs")
    return None if commit_ms is None else received * 1000.0 - float(commit_ms)


_BACKFILL_COMPLETED = b'"tag":"backfill-completed"'


async def subscribe(
    base_url: str,
    path: str,
    sentinel: bytes,
    progress: Progress,
    ready: asyncio.Event,
    record_latency: bool,
    watch_backfill: bool = False,
) -> None:
    """Run one subscriber until the sentinel transaction's commit."""
    ws = await RawSocket.open(base_url, path)
    try:
        seen_sentinel = False
        async for batch in ws.messages():
            received = time.time()
            # Ack the whole read first, in one write: the server's flow control
            # waits on acks. The replicator acks each message, in order, as here.
            ws.send(b"".join(ack_frame(_split(m)[0]) for m in batch))
            for message in batch:
                _, tag = _split(message)
                if not ready.is_set():
                    if tag != b"status":
                        raise SubscriptionRefused(message[:300].decode(errors="replace"))
                    ready.set()
                    continue
                progress.frames += 1
                if tag == b"data":
                    progress.changes += 1
                    if not seen_sentinel and sentinel in message:
                        seen_sentinel = True
                    if watch_backfill and _BACKFILL_COMPLETED in message:
                        _emit({"event": "backfill_completed", "at": received})
                elif tag == b"commit":
                    if record_latency or seen_sentinel:
                        msg = orjson.loads(message)["msg"]
                        latency = _commit_latency_ms(msg, received) if record_latency else None
                        if latency is not None:
                            progress.latencies_ms.append(latency)
                            progress.latency_receipts.append(received)
                        if seen_sentinel:
                            progress.final_receipt = received
                            progress.final_watermark = msg[2]["watermark"]
                            await ws.drain()
                            return
                elif tag == b"error":
                    raise SubscriptionRefused(message[:300].decode(errors="replace"))
            await ws.drain()
    finally:
        await ws.close()


def _emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


async def run(args: argparse.Namespace) -> int:
    connecting_at = time.time()
    progress = [Progress() for _ in range(args.k)]
    readies = [asyncio.Event() for _ in range(args.k)]
    tasks = [
        asyncio.create_task(
            subscribe(
                args.base_url,
                changes_path(f"hpd-bench-{i}", args.replica_version, args.watermark),
                args.sentinel.encode(),
                progress[i],
                readies[i],
                record_latency=(i == 0),
                watch_backfill=args.watch_backfill and i == 0,
            )
        )
        for i in range(args.k)
    ]

    async def announce_ready() -> None:
        for ready in readies:
            await ready.wait()
        _emit({"event": "ready", "connecting_at": connecting_at})

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
            "latency_receipts": progress[0].latency_receipts,
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
    parser.add_argument(
        "--watch-backfill",
        action="store_true",
        help='emit {"event": "backfill_completed", "at": T} when one arrives',
    )
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
