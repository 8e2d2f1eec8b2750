"""Subscribers on raw protocol-v6 websockets: the oracle's followers and the misbehaving ones.

:class:`Follower` is what a replicator does: it subscribes at its last commit,
acks every message once it has handled it, applies each transaction to a dict
keyed by the row key only at its ``commit`` (a ``rollback``, or a connection
ending mid-transaction, discards it), and reconnects after every drop, resuming
from the last commit it received in full. It records everything the oracle needs:
every ``seq`` it received (duplicates included: a transaction whose commit
watermark is not above the last applied one is counted and not applied), when it
first got each, and why each connection ended.

It is deliberately not :class:`app.client.ResumingSubscription`: that client drops
an already-consumed transaction silently, which is right for a replicator but
would hide exactly the duplicates this harness counts.

The misbehaving ones (:func:`stalled`, :func:`wrong_ack`, :func:`flood`) each open
one connection and report how the server ended it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

__all__ = ["Closed", "Follower", "changes_url", "flood", "stalled", "wrong_ack"]

OPEN_TIMEOUT_S = 5.0
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 0.5


def changes_url(port: int, sub_id: str, replica_version: str, watermark: str, initial: bool) -> str:
    query = urllib.parse.urlencode(
        {
            "id": sub_id,
            "mode": "serving",
            "replicaVersion": replica_version,
            "watermark": watermark,
            "initial": "true" if initial else "false",
        }
    )
    return f"ws://127.0.0.1:{port}/replication/v6/changes?{query}"


async def _open(url: str, **kwargs: Any) -> ClientConnection:
    return await connect(
        url,
        open_timeout=OPEN_TIMEOUT_S,
        close_timeout=2,
        ping_interval=None,  # the server pings; websockets answers
        ping_timeout=None,
        max_size=None,
        proxy=None,
        **kwargs,
    )


def _table(change: dict[str, Any]) -> str | None:
    relation = change.get("relation") or {}
    if relation.get("schema") != "public":
        return None
    name = relation.get("name")
    return name if isinstance(name, str) else None


@dataclass
class Follower:
    """A resuming v6 subscriber; see the module docstring. ``port`` may change
    between connections (it is read at each reconnect)."""

    name: str
    port: int
    replica_version: str
    rows: dict[int, tuple[int, str | None]] = field(default_factory=dict)
    seqs: list[int] = field(default_factory=list)
    first_got: dict[int, float] = field(default_factory=dict)
    duplicate_commits: list[str] = field(default_factory=list)
    ends: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    connections: int = 0
    commits: int = 0
    watermark: str = ""
    _task: asyncio.Task[None] | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _got: asyncio.Condition = field(default_factory=asyncio.Condition)

    def __post_init__(self) -> None:
        self.watermark = self.watermark or self.replica_version

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"flt-follower-{self.name}")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def check(self) -> None:
        if self._task is not None and self._task.done() and not self._stop.is_set():
            self._task.result()
            raise RuntimeError(f"follower {self.name} stopped")

    async def wait_seq(self, seq: int, timeout_s: float) -> float:
        """Monotonic time this follower first got ``seq`` (waits for it)."""
        deadline = time.monotonic() + timeout_s
        async with self._got:
            while seq not in self.first_got:
                self.check()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"follower {self.name} did not get seq {seq} within {timeout_s} s "
                        f"(at {self.watermark}, {self.connections} connections, "
                        f"last ends {self.ends[-3:]}, errors {self.errors[-3:]})"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._got.wait(), min(remaining, 1.0))
        return self.first_got[seq]

    async def _run(self) -> None:
        delay = RETRY_FIRST_S
        while not self._stop.is_set():
            url = changes_url(
                self.port,
                self.name,
                self.replica_version,
                self.watermark,
                initial=self.connections == 0,
            )
            try:
                ws = await _open(url)
            except (OSError, TimeoutError, InvalidHandshake):
                # serve is down or starting: retry with backoff, bounded by stop().
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            self.connections += 1
            delay = RETRY_FIRST_S
            try:
                end = await self._follow(ws)
            except ConnectionClosed as e:
                end = f"closed {e.rcvd.code if e.rcvd else 'without a close frame'}"
            finally:
                await ws.close()
            self.ends.append(end)

    async def _follow(self, ws: ClientConnection) -> str:
        tx: list[dict[str, Any]] | None = None
        async for frame in ws:
            envelope = json.loads(frame)
            message = envelope["msg"]
            kind = message[0]
            if kind == "begin":
                tx = []
            elif kind == "data":
                assert tx is not None, f"data outside a transaction: {message}"
                tx.append(message[1])
            elif kind == "commit":
                assert tx is not None, f"commit outside a transaction: {message}"
                await self._commit(message[2]["watermark"], tx)
                tx = None
            elif kind == "rollback":
                tx = None
            elif kind == "error":
                self.errors.append(json.dumps(message[1])[:200])
                await ws.send(json.dumps({"ack": envelope["id"]}))
                return "error " + str(message[1].get("type", "?"))
            await ws.send('{"ack":' + str(envelope["id"]) + "}")
        return "closed cleanly"

    async def _commit(self, watermark: str, tx: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        seqs = [c["new"]["seq"] for c in tx if _table(c) == "seq" and c["tag"] == "insert"]
        self.seqs.extend(seqs)
        if watermark <= self.watermark:
            self.duplicate_commits.append(watermark)
            return
        for change in tx:
            if _table(change) != "items":
                continue
            tag = change["tag"]
            if tag in ("insert", "update"):
                new = change["new"]
                if tag == "update" and change.get("key"):
                    self.rows.pop(change["key"]["id"], None)
                self.rows[new["id"]] = (new["n"], new["s"])
            elif tag == "delete":
                self.rows.pop(change["key"]["id"], None)
            else:
                raise AssertionError(f"unexpected change {tag}: {change}")
        self.watermark = watermark
        self.commits += 1
        async with self._got:
            for s in seqs:
                self.first_got.setdefault(s, now)
            self._got.notify_all()


@dataclass(frozen=True)
class Closed:
    """How the server ended a misbehaving connection."""

    code: int | None
    reason: str
    after_s: float
    frames_received: int
    frames_sent: int = 0

    def describe(self) -> str:
        code = "no close frame" if self.code is None else f"close {self.code}"
        reason = f" ({self.reason})" if self.reason else ""
        return f"{code}{reason} after {self.after_s:.1f} s"


def _closed(e: ConnectionClosed, t0: float, received: int, sent: int = 0) -> Closed:
    rcvd = e.rcvd
    return Closed(
        rcvd.code if rcvd else None,
        rcvd.reason if rcvd else "",
        time.monotonic() - t0,
        received,
        sent,
    )


class Stalled:
    """Connects and then neither reads nor acks; :meth:`drain` reads until the end."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ws: ClientConnection | None = None
        self.t0 = 0.0

    async def open(self) -> None:
        # One frame buffered, then websockets stops reading the socket: TCP back
        # pressure reaches the server, as from a client stuck in a long pause.
        self.ws = await _open(self.url, max_queue=1)
        self.t0 = time.monotonic()

    async def drain(self, timeout_s: float) -> Closed:
        """Reads (without acking) until the server ends the connection."""
        assert self.ws is not None
        received = 0
        error = ""
        try:
            async with asyncio.timeout(timeout_s):
                async for frame in self.ws:
                    received += 1
                    if '"error"' in frame[:40]:
                        error = f"error type {json.loads(frame)['msg'][1].get('type')}"
        except ConnectionClosed as e:
            return _closed(e, self.t0, received)
        except TimeoutError:
            await self.ws.close()
            raise TimeoutError(f"stalled subscriber not dropped within {timeout_s} s") from None
        return Closed(1000, error, time.monotonic() - self.t0, received)

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()


def stalled(url: str) -> Stalled:
    return Stalled(url)


async def wrong_ack(url: str, timeout_s: float) -> Closed:
    """Receives two frames, acks the second first: an ack out of order."""
    ws = await _open(url)
    t0 = time.monotonic()
    received = 0
    try:
        async with asyncio.timeout(timeout_s):
            while received < 2:
                await ws.recv()
                received += 1
            await ws.send('{"ack":2}')
            while True:
                await ws.recv()
                received += 1
    except ConnectionClosed as e:
        return _closed(e, t0, received, 1)
    finally:
        await ws.close()


async def flood(url: str, frames: int, frame_bytes: int, timeout_s: float) -> Closed:
    """Sends ``frames`` text frames as fast as the socket takes them, reading nothing."""
    ws = await _open(url)
    t0 = time.monotonic()
    payload = json.dumps({"flood": "x" * frame_bytes})
    sent = 0
    try:
        async with asyncio.timeout(timeout_s):
            for _ in range(frames):
                await ws.send(payload)
                sent += 1
            # All sent without the server ending it: see whether it does now.
            while True:
                await ws.recv()
    except ConnectionClosed as e:
        return _closed(e, t0, 0, sent)
    except TimeoutError:
        return Closed(None, "still open", time.monotonic() - t0, 0, sent)
    finally:
        await ws.close()
