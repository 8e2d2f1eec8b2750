"""A crowd of subscribers that connect, never read, and leave: nothing of it stays.

Over real loopback sockets, as ``bench.churn``'s flood: ``/changes`` subscribers
that read nothing after the handshake (more than the subscriber limit, so some are
refused), some closing their socket and some vanishing (RST), while transactions
stream. Once they are gone the service's registries are back to their size before
the flood, ``/metrics`` has the same series (none per subscriber), and each
connection's objects — its Subscriber and Downstream, the websocket protocol with
its parser, queues and buffers — were freed by reference counting alone: the test
runs with the cyclic collector off, since in ``serve`` it rarely makes a full pass
(``app/runtime/gc_tuning.py``), and a reference cycle kept each closed connection
until one came (issue 25: +140 MiB after a 2,000-connection flood).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import os
import weakref
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from app.server import transport
from app.server.http_protocol import GuardedHttpProtocol
from app.server.ws_protocol import LivenessProtocol

from ..waiting import eventually
from .conftest import REPLICA_VERSION, Server, start_server
from .scraping import scrape

CLIENTS = 200
MAX_SUBSCRIBERS = 150  # the other 50 are refused (1002) after the upgrade


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    # Handshakes at once: the admission rate would spread 200 over 4 s. Every socket
    # comes from 127.0.0.1: no per-address cap below the subscriber limit here.
    async for s in start_server(
        tmp_path,
        handshakes_per_s=100_000,
        max_subscribers=MAX_SUBSCRIBERS,
        max_sockets_per_address=10 * MAX_SUBSCRIBERS,
    ):
        yield s


async def open_silent(url: str, i: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A subscriber's socket: the upgrade, then nothing read (a flood's client)."""
    host, port = url.removeprefix("ws://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    key = base64.b64encode(os.urandom(16)).decode()
    path = (
        f"/replication/v6/changes?id=flood-{i}&replicaVersion={REPLICA_VERSION}"
        f"&watermark={REPLICA_VERSION}"
    )
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


def txn(watermark: str, rows: int) -> list[list[Any]]:
    data = [
        [
            "data",
            {
                "tag": "insert",
                "relation": {"schema": "public", "name": "t", "rowKey": {"columns": ["id"]}},
                "new": {"id": i, "pad": "x" * 200},
            },
        ]
        for i in range(rows)
    ]
    return [
        ["begin", {"tag": "begin"}, {"commitWatermark": watermark}],
        *data,
        ["commit", {"tag": "commit"}, {"watermark": watermark}],
    ]


def registries(server: Server) -> dict[str, int]:
    """Everything the service keeps per subscriber or per connection, by size."""
    service, forwarder, storer = server.service, server.service.forwarder, server.service.storer
    protocol = server.http.config.http_protocol_class
    assert issubclass(protocol, GuardedHttpProtocol)
    limits = protocol.limits
    return {
        "active subscribers": len(forwarder.active),
        "queued subscribers": len(forwarder.queued),
        "subscribers' rate samples": forwarder.rate_samples,
        "sockets admitted before subscribing": service.open_sockets,
        "open connections": server.connections(),
        "catch-up tasks": storer.catchups.running,
        "catch-ups waiting for durability": storer.durable_waiters,
        "parked catch-ups": len(storer.catchups.parked),
        "unfinished catch-up jobs": sum(not job.finished for job in storer.catchups.progress.jobs),
        "snapshot reservations": len(service.reservations.open_tasks),
        "handshakes pending": limits.pending,
        "handshakes waiting for admission": limits.admission.queue_length,
    }


async def series(server: Server) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """``/metrics``' sample names with their label sets (values aside)."""
    families = await scrape(server.url.replace("ws://", "http://"))
    return {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in families.values()
        for sample in family.samples
    }


async def test_a_silent_flood_that_leaves_leaves_nothing_behind(server: Server) -> None:
    before = registries(server)
    series_before = await series(server)
    objects: list[weakref.ref[Any]] = []
    gc.collect()
    gc.disable()
    try:
        sockets = await asyncio.gather(*(open_silent(server.url, i) for i in range(CLIENTS)))
        forwarder = server.service.forwarder
        await eventually(
            lambda: len(forwarder.active) + len(forwarder.queued) == MAX_SUBSCRIBERS,
            "the flood's subscribers to subscribe",
        )
        stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
        for w in ("02", "03", "04"):  # live changes for them, while they read nothing
            stream.push_all(txn(w, 50))
        await asyncio.wait_for(server.service.storer.wait_durable("04"), 10)
        subscribers = [*forwarder.active, *forwarder.queued]
        objects += [weakref.ref(s) for s in subscribers]
        objects += [weakref.ref(s.downstream) for s in subscribers]
        protocols = [
            p for p in server.http.server_state.connections if isinstance(p, LivenessProtocol)
        ]
        assert len(protocols) == CLIENTS
        objects += [weakref.ref(p) for p in protocols]
        objects += [weakref.ref(p.conn) for p in protocols]  # websockets' parser and buffers
        del subscribers, protocols
        for i, (_, writer) in enumerate(sockets):
            if i % 2:
                writer.transport.abort()  # gone without a word
            else:
                writer.close()
        del sockets, writer

        def alive() -> Counter[str]:
            return Counter(type(o).__qualname__ for r in objects if (o := r()) is not None)

        with contextlib.suppress(AssertionError):  # the asserts below name what is left
            await eventually(
                lambda: registries(server) == before and not alive(),
                "the flood's connections to be gone",
                timeout_s=3,
            )
        assert registries(server) == before
        assert alive() == Counter(), "still held after their sockets closed"
    finally:
        gc.enable()
    assert await series(server) == series_before  # no series per subscriber


async def test_a_stream_the_server_ends_closes_at_once_not_after_the_sender_grace(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The grace lets a sender finish the frame it writes; the ack reader waits for the
    # client and would take all of it. With the grace made an hour, a close that
    # waited for the reader would not arrive within the bound below.
    monkeypatch.setattr(transport, "SENDER_GRACE_S", 3600.0)
    url = f"{server.url}/replication/v6/changes?id=s&replicaVersion=01&watermark=01"
    async with connect(url) as ws:
        await ws.recv()  # the status
        await eventually(lambda: server.service.forwarder.active, "the subscriber to join")
        server.service.forwarder.close_all()  # e.g. this node retired
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
