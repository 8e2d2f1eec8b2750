"""The replication websockets over real loopback sockets, checked frame by frame."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from app.protocol.canonical_json import loads

from ..waiting import eventually, stays
from .conftest import REPLICA_VERSION, Server, start_server

QUERY = f"id=serving-replicator-1&replicaVersion={REPLICA_VERSION}&watermark={REPLICA_VERSION}"


def txn(w: str, n: int = 1) -> list[list[Any]]:
    rows = [
        [
            "data",
            {
                "tag": "insert",
                "relation": {"schema": "public", "name": "t", "rowKey": {"columns": ["id"]}},
                "new": {"id": i},
            },
        ]
        for i in range(n)
    ]
    return [
        ["begin", {"tag": "begin"}, {"commitWatermark": w}],
        *rows,
        ["commit", {"tag": "commit"}, {"watermark": w}],
    ]


async def until_acked(server: Server, watermark: str) -> None:
    """Until the service's only subscriber has acked ``watermark`` (fails after 2 s)."""
    await eventually(
        lambda: server.service.forwarder.acks() == [watermark], f"the ack of {watermark}", 2
    )
    assert server.service.forwarder.acks() == [watermark]


async def closed_with(url: str) -> tuple[int | None, str]:
    async with connect(url) as ws:
        with pytest.raises(ConnectionClosed) as e:
            await asyncio.wait_for(ws.recv(), 10)
    assert e.value.rcvd is not None
    return e.value.rcvd.code, e.value.rcvd.reason


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        (
            f"/replication/v8/changes?{QUERY}",
            "Error: Cannot service client at protocol v8. Supported protocols: [v1 ... v7]",
        ),
        (
            f"/replication/v0/changes?{QUERY}",
            "Error: Cannot service client at protocol v0. Supported protocols: [v1 ... v7]",
        ),
        (
            "/replication/v6/subscribe",
            "Error: the /subscribe endpoint requires protocol v7 (client is at v6)",
        ),
        (f"/replication/6/changes?{QUERY}", "Error: invalid path: /replication/6/changes"),
        (  # an Arabic-Indic six is a digit to \d and int(), not a protocol version
            f"/replication/v%D9%A6/changes?{QUERY}",
            "Error: invalid path: /replication/v\u0666/changes",
        ),
        (
            "/replication/v6/changes?replicaVersion=01&watermark=01",
            "Error: invalid querystring - missing id",
        ),
        (
            "/replication/v6/changes?id=&replicaVersion=01&watermark=01",
            "Error: invalid querystring - missing id",
        ),
        (
            "/replication/v6/changes?id=x&watermark=01",
            "Error: invalid querystring - missing replicaVersion",
        ),
        (
            "/replication/v6/changes?id=x&replicaVersion=01",
            "Error: invalid querystring - missing watermark",
        ),
        (  # every line of the connection logs it: bounded
            f"/replication/v6/changes?id={'i' * 257}&replicaVersion=01&watermark=01",
            "Error: invalid querystring - id is 257 bytes long; at most 256 are accepted",
        ),
        (
            f"/replication/v6/changes?id=x&taskID={'t' * 300}&replicaVersion=01&watermark=01",
            "Error: invalid querystring - taskID is 300 bytes long; at most 256 are accepted",
        ),
        (
            f"/replication/v6/snapshot?taskID={'t' * 300}",
            "Error: invalid querystring - taskID is 300 bytes long; at most 256 are accepted",
        ),
        ("/replication/v6/snapshot", "Error: Missing taskID in snapshot request"),
        (
            "/replication/v6/snapshot?taskID=t1",
            "Error: replication-manager is not configured with a ZERO_LITESTREAM_BACKUP_URL",
        ),
    ],
)
async def test_bad_requests_are_upgraded_then_closed_with_1002_and_the_reason(
    server: Server, path: str, reason: str
) -> None:
    assert await closed_with(server.url + path) == (1002, reason)


async def test_a_malformed_watermark_is_rejected_with_a_clear_reason(server: Server) -> None:
    code, reason = await closed_with(
        server.url + "/replication/v6/changes?id=x&replicaVersion=01&watermark=zz"
    )
    assert code == 1002
    assert reason.startswith("Error: invalid querystring - watermark: ")
    assert len(reason.encode()) <= 123


async def recv(ws: ClientConnection) -> dict[str, Any]:
    frame = await asyncio.wait_for(ws.recv(), 10)
    assert isinstance(frame, str)
    value = loads(frame)
    assert isinstance(value, dict)
    return value


async def test_a_fresh_replica_gets_status_then_transactions_with_ids_in_order(
    server: Server,
) -> None:
    async with connect(f"{server.url}/replication/v6/changes?{QUERY}") as ws:
        first = await recv(ws)
        assert first == {"id": 1, "msg": ["status", {"tag": "status"}]}
        await ws.send('{"ack":1}')
        stream = await asyncio.wait_for(
            server.source.wait_for_stream(), 10
        )  # serving: started at once
        stream.push_all(txn("02", 2))
        frames = [await recv(ws) for _ in range(4)]
        assert [f["id"] for f in frames] == [2, 3, 4, 5]
        assert [f["msg"][0] for f in frames] == ["begin", "data", "data", "commit"]
        assert frames[-1]["msg"] == ["commit", {"tag": "commit"}, {"watermark": "02"}]
        for f in frames:
            await ws.send(f'{{"ack":{f["id"]}}}')
        await asyncio.wait_for(server.service.storer.wait_durable("02"), 10)
        await until_acked(server, "02")


@pytest.mark.parametrize("batched", [False, True], ids=["v6", "v7-batched"])
async def test_a_burst_is_written_together_in_frames_with_consecutive_ids(
    server: Server, batched: bool
) -> None:
    """Queued messages go out together: v6 as a frame each, v7 split at 64 a frame."""
    url = f"{server.url}/replication/v6/changes?{QUERY}"
    if batched:
        url = f"{server.url}/replication/v7/changes?{QUERY}&wsBatched=true"
    async with connect(url) as ws:
        assert (await recv(ws))["id"] == 1
        await ws.send('{"ack":1}')
        stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
        stream.push_all(txn("02", 600) + txn("03", 1))  # more than one write's worth
        frames: list[dict[str, Any]] = []
        messages: list[Any] = []
        while len(messages) < 605:  # acked as they come: flow control waits every 64 KiB
            frames.append(await recv(ws))
            frame = frames[-1]
            messages += frame["batch"] if "batch" in frame else [frame["msg"]]
            await ws.send(f'{{"ack":{frame["id"]}}}')
        assert len(messages) == 605
        assert [f["id"] for f in frames] == list(range(2, 2 + len(frames)))
        if batched:
            sizes = [len(f["batch"]) if "batch" in f else 1 for f in frames]
            assert max(sizes) == 64  # more was queued than fits one frame
        else:
            assert len(frames) == 605
            assert all(set(f) == {"id", "msg"} for f in frames)
        tags = [m[0] for m in messages]
        assert tags == ["begin", *["data"] * 600, "commit", "begin", "data", "commit"]
        assert [m[1]["new"]["id"] for m in messages[1:601]] == list(range(600))
        await until_acked(server, "03")


async def test_no_extension_is_negotiated_even_where_uvicorn_would_deflate(
    tmp_path: Path,
) -> None:
    # The streams write their frames as they are (app/server/ws_protocol.py): a client
    # offering per-message deflate (websockets' does by default) gets plain frames.
    async for server in start_server(tmp_path, per_message_deflate=True):
        async with connect(f"{server.url}/replication/v6/changes?{QUERY}") as ws:
            assert ws.response is not None
            assert "Sec-WebSocket-Extensions" not in ws.response.headers
            assert await recv(ws) == {"id": 1, "msg": ["status", {"tag": "status"}]}
            await ws.send('{"ack":1}')
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
            stream.push_all(txn("02"))
            frames = [await recv(ws) for _ in range(3)]
            assert [f["id"] for f in frames] == [2, 3, 4]


async def test_wrong_replica_version_is_message_1_then_the_socket_closes(server: Server) -> None:
    url = f"{server.url}/replication/v6/changes?id=x&replicaVersion=0z&watermark=0z"
    async with connect(url) as ws:
        first = await recv(ws)
        assert first == {
            "id": 1,
            "msg": [
                "error",
                {"type": 1, "message": "current replica version is 01 (requested 0z)"},
            ],
        }
        await ws.send('{"ack":1}')
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)


@pytest.mark.parametrize(
    ("frame", "reason_part"),
    [
        ('{"ack":2}', "unexpected ack 2: expected ack 1"),
        ('{"ack":1,"x":1}', "unexpected keys"),
        (b'{"ack":1}', "binary frames"),
        ("not json", "not valid JSON"),
        ('{"ack":true}', "boolean"),
    ],
)
async def test_a_bad_ack_closes_that_stream_and_nobody_elses(
    server: Server, frame: str | bytes, reason_part: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.server.transport")
    async with (
        connect(f"{server.url}/replication/v6/changes?{QUERY}") as good,
        connect(f"{server.url}/replication/v6/changes?{QUERY.replace('-1', '-2')}") as bad,
    ):
        assert (await recv(good))["id"] == 1
        assert (await recv(bad))["id"] == 1
        await bad.send(frame)
        with pytest.raises(ConnectionClosed) as e:
            await asyncio.wait_for(bad.recv(), 10)
        # A plain close once streaming began (peers see 1005, spec/wire.md §1.4);
        # the reason is in our log.
        assert e.value.rcvd is not None
        assert e.value.rcvd.code == 1005
        assert reason_part in caplog.text
        await good.send('{"ack":1}')
        stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
        stream.push_all(txn("02"))
        frames = [await recv(good) for _ in range(3)]
        assert frames[-1]["msg"][0] == "commit"


async def test_a_backup_subscription_does_not_end_the_startup_delay(server: Server) -> None:
    url = f"{server.url}/replication/v6/changes?{QUERY}&mode=backup"
    async with connect(url) as ws:
        assert (await recv(ws))["msg"][0] == "status"
        await stays(lambda: server.source.start_calls == [], 0.2, "no upstream stream started")
        assert server.source.start_calls == []
    async with connect(f"{server.url}/replication/v6/changes?{QUERY}") as ws:
        await recv(ws)
        await asyncio.wait_for(server.source.wait_for_stream(), 10)


async def test_a_snapshot_reservation_streams_its_status_and_ends_on_subscribe(
    tmp_path: Path,
) -> None:
    async for server in start_server(tmp_path, backup_url="file:///backups/r", startup_delay_s=0):
        server.service.backups.set_coverage_target("01")  # the replica's position
        async with connect(f"{server.url}/replication/v6/snapshot?taskID=t1") as snap:
            # No backup yet: the coverage gate holds the stream back, and the
            # reservation waits for one.
            assert server.source.start_calls == []
            server.service.backups.track("01")
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
            stream.push_all(txn("02"))
            await asyncio.wait_for(server.service.storer.wait_durable("02"), 10)
            server.service.backups.track("02")
            first = await recv(snap)
            assert first == {
                "id": 1,
                "msg": [
                    "status",
                    {
                        "tag": "status",
                        "backupURL": "file:///backups/r",
                        "replicaVersion": "01",
                        "minWatermark": "01",  # the backup that opened the gate
                    },
                ],
            }
            await snap.send('{"ack":1}')
            query = "id=x&replicaVersion=01&watermark=02&taskID=t1&initial=true"
            url = f"{server.url}/replication/v6/changes?{query}"
            async with connect(url) as sub:
                assert (await recv(sub))["msg"][0] == "status"
                with pytest.raises(ConnectionClosed):
                    await asyncio.wait_for(snap.recv(), 10)
