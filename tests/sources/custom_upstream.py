"""A scripted custom change source: a real websocket server on 127.0.0.1.

It plays the source side of spec/source.md §4: a connection without
``lastWatermark`` gets the initial-sync frames; a streaming connection gets every
published transaction whose commit watermark is after its ``lastWatermark``, then
each transaction as it is published. Tests can send frames on the current
streaming connection only (``send_now``) or queue them for the next one only
(``next_stream``: a rule violation that must not come back after the reconnect),
and drop the socket without a close handshake (``drop``).
Everything the client sent (acks) and every connection's query are recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from app.protocol.canonical_json import dumps, loads

Frame = list[Any]
# In the initial-sync frames: the source closes the connection here (cleanly).
CLOSE: Frame = ["<close>"]


def transaction(watermark: str, *changes: dict[str, Any]) -> list[Frame]:
    """begin, one data frame per change, commit, all at ``watermark``."""
    return [
        ["begin", {"tag": "begin"}, {"commitWatermark": watermark}],
        *(["data", change] for change in changes),
        ["commit", {"tag": "commit"}, {"watermark": watermark}],
    ]


def relation(schema: str, name: str, *key: str) -> dict[str, Any]:
    return {"schema": schema, "name": name, "rowKey": {"columns": list(key)}}


def create_table(
    schema: str, name: str, columns: dict[str, str], key: list[str], **extra: Any
) -> list[dict[str, Any]]:
    """``create-table`` (key columns NOT NULL) and the unique index over the key."""
    spec_columns = {
        col: {"pos": pos, "dataType": data_type, "notNull": col in key}
        for pos, (col, data_type) in enumerate(columns.items(), start=1)
    }
    return [
        {
            "tag": "create-table",
            "spec": {"schema": schema, "name": name, "primaryKey": key, "columns": spec_columns},
            "metadata": {"rowKey": {"columns": key}},
            **extra,
        },
        {
            "tag": "create-index",
            "spec": {
                "schema": schema,
                "tableName": name,
                "name": f"{name}_key",
                "unique": True,
                "columns": dict.fromkeys(key, "ASC"),
            },
        },
    ]


def insert(schema: str, name: str, key: list[str], row: dict[str, Any]) -> dict[str, Any]:
    return {"tag": "insert", "relation": relation(schema, name, *key), "new": row}


def required_tables(app_id: str, shard_num: int = 0) -> list[dict[str, Any]]:
    """The tables spec/source.md §4.2 item 3 requires, as schema changes."""
    shard = f"{app_id}_{shard_num}"
    return [
        *create_table(
            shard,
            "clients",
            {
                "clientGroupID": "text",
                "clientID": "text",
                "lastMutationID": "int8",
                "userID": "text",
            },
            ["clientGroupID", "clientID"],
        ),
        *create_table(
            shard,
            "mutations",
            {"clientGroupID": "text", "clientID": "text", "mutationID": "int8", "mutation": "json"},
            ["clientGroupID", "clientID", "mutationID"],
        ),
        *create_table(
            app_id, "permissions", {"lock": "bool", "permissions": "json", "hash": "text"}, ["lock"]
        ),
    ]


ISSUES_KEY = ["id"]


def issue(issue_id: int, title: str) -> dict[str, Any]:
    return insert("public", "issues", ISSUES_KEY, {"id": issue_id, "title": title})


def initial_sync(app_id: str, watermark: str, issues: int = 3) -> list[Frame]:
    """A complete initial transaction: the required tables, ``issues``, a few rows."""
    return transaction(
        watermark,
        *required_tables(app_id),
        *create_table("public", "issues", {"id": "int4", "title": "text"}, ISSUES_KEY),
        insert(app_id, "permissions", ["lock"], {"lock": True, "permissions": {}, "hash": "h0"}),
        *(issue(i, f"issue {i}") for i in range(1, issues + 1)),
    )


class CustomUpstream:
    """The server's state; see the module docstring."""

    def __init__(self, initial: list[list[Frame]]) -> None:
        # One list of frames per initial-sync connection; the last one repeats.
        self.initial = initial
        self.log: list[list[Frame]] = []
        self.connections: list[dict[str, list[str]]] = []
        self.acks: list[Frame] = []
        self.url = ""
        self._next: list[Frame] = []
        self._current: ServerConnection | None = None
        self._wakers: set[asyncio.Event] = set()

    @property
    def streams(self) -> list[dict[str, list[str]]]:
        """The streaming connections' queries (not the initial syncs')."""
        return [q for q in self.connections if "lastWatermark" in q]

    @property
    def initial_syncs(self) -> list[dict[str, list[str]]]:
        return [q for q in self.connections if "lastWatermark" not in q]

    def acked(self) -> list[str]:
        return [ack[2]["watermark"] for ack in self.acks]

    def publish(self, frames: list[Frame]) -> None:
        """A committed transaction: sent now to the current stream, and to later ones."""
        self.log.append(frames)
        self._wake()

    def next_stream(self, frames: list[Frame]) -> None:
        """Frames for the next streaming connection only, after its backlog."""
        self._next.extend(frames)

    async def send_now(self, frames: list[Frame]) -> None:
        """Frames for the current streaming connection only (not in the log)."""
        assert self._current is not None, "no streaming connection"
        for frame in frames:
            await self._current.send(dumps(frame))

    def _wake(self) -> None:
        for event in self._wakers:
            event.set()

    def drop(self) -> None:
        """Drops the streaming connection's TCP connection, no close handshake."""
        assert self._current is not None, "no streaming connection"
        self._current.transport.abort()

    async def _handle(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        query = parse_qs(urlsplit(ws.request.path).query)
        self.connections.append(query)
        reader = asyncio.create_task(self._read(ws))
        try:
            with contextlib.suppress(ConnectionClosed):
                if "lastWatermark" not in query:
                    frames = self.initial.pop(0) if len(self.initial) > 1 else self.initial[0]
                    for frame in frames:
                        if frame is CLOSE:
                            await ws.close()
                            return
                        await ws.send(dumps(frame))
                    await reader
                    return
                await self._stream(ws, query["lastWatermark"][0], reader)
        finally:
            reader.cancel()
            if self._current is ws:
                self._current = None

    async def _stream(self, ws: ServerConnection, after: str, reader: asyncio.Task[None]) -> None:
        self._current = ws
        wake = asyncio.Event()
        self._wakers.add(wake)
        once, self._next = self._next, []
        try:
            sent = 0
            while not reader.done():
                wake.clear()  # before reading the log: a later publish sets it again
                pending = [tx for tx in self.log[sent:] if _commit(tx) > after]
                sent = len(self.log)
                for frame in [f for tx in pending for f in tx] + once:
                    await ws.send(dumps(frame))
                once = []
                waiter = asyncio.ensure_future(wake.wait())
                await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
        finally:
            self._wakers.discard(wake)

    async def _read(self, ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                self.acks.append(loads(frame))


def _commit(tx: list[Frame]) -> str:
    watermark: str = tx[-1][2]["watermark"]
    return watermark


@contextlib.asynccontextmanager
async def custom_upstream(initial: list[list[Frame]]) -> AsyncIterator[CustomUpstream]:
    upstream = CustomUpstream(initial)
    async with serve(upstream._handle, "127.0.0.1", 0, close_timeout=1) as server:
        port = server.sockets[0].getsockname()[1]
        upstream.url = f"ws://127.0.0.1:{port}/changes/v0/stream?apiKey=k"
        yield upstream
