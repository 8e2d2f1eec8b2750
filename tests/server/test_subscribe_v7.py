"""The merged v7 /subscribe protocol over real loopback sockets."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from app.protocol.canonical_json import dumps, loads

from ..waiting import eventually
from .conftest import Server, start_server
from .test_replication_ws import txn

BACKUP_URL = "file:///backups/replica"


@pytest.fixture
async def backed_up(tmp_path: Path) -> Any:
    # No start-up delay: a reservation does not end it, and reservations are
    # confirmed only by the change log's owner.
    async for server in start_server(tmp_path, backup_url=BACKUP_URL, startup_delay_s=0):
        # A backup of the replica exists: the coverage gate is open (the stream may
        # start), and reservations are confirmed at it.
        server.service.backups.set_coverage_target("01")
        server.service.backups.track("01")
        yield server


class Client:
    """A v7 client: its own frame ids, acks for what it receives."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.next_id = 1
        self.acks: list[int] = []

    async def send(self, *messages: list[Any]) -> int:
        frame_id = self.next_id
        self.next_id += 1
        if len(messages) == 1:
            await self.ws.send(dumps({"id": frame_id, "msg": messages[0]}))
        else:
            await self.ws.send(dumps({"id": frame_id, "batch": list(messages)}))
        return frame_id

    async def frame(self) -> dict[str, Any]:
        """The next server frame that is not an ack of ours (acks are recorded)."""
        while True:
            raw = await asyncio.wait_for(self.ws.recv(), 10)
            value = loads(raw)
            if set(value) == {"ack"}:
                self.acks.append(value["ack"])
                continue
            return value  # type: ignore[no-any-return]

    async def messages(self, count: int) -> list[Any]:
        """``count`` stream messages, acking each frame after reading it."""
        out: list[Any] = []
        while len(out) < count:
            f = await self.frame()
            out.extend(f["batch"] if "batch" in f else [f["msg"]])
            await self.ws.send(dumps({"ack": f["id"]}))
        return out


def start(watermark: str, task: str = "t1", **extra: Any) -> list[Any]:
    body = {
        "taskID": task,
        "id": "serving-1",
        "mode": "serving",
        "replicaVersion": "01",
        "watermark": watermark,
        **extra,
    }
    return ["start-subscription", body]


async def test_reserve_restore_then_subscribe_on_one_socket(backed_up: Server) -> None:
    server = backed_up
    async with connect(f"{server.url}/replication/v7/subscribe?taskID=t1") as ws:
        client = Client(ws)
        await client.send(["reserve-snapshot", {"taskID": "t1"}])
        stream = await asyncio.wait_for(
            server.source.wait_for_stream(), 10
        )  # a reservation starts it
        reserved = await client.frame()
        assert reserved["msg"] == [
            "reserved",
            {
                "tag": "snapshot",
                "backupURL": BACKUP_URL,
                "replicaVersion": "01",
                "minWatermark": "01",  # the backup there is
            },
        ]
        assert client.acks == [1]  # the server acked our reserve-snapshot
        await ws.send(dumps({"ack": reserved["id"]}))
        stream.push_all(txn("02"))  # the backup moves on while the client restores
        await asyncio.wait_for(server.service.storer.wait_durable("02"), 10)
        server.service.backups.track("02")
        # ... the client restores the backup at 02, then subscribes on the same socket.
        await client.send(start("02", extra_field_for_the_future=True))
        stream.push_all(txn("03", 2))
        msgs = await client.messages(5)
        assert [m[0] for m in msgs] == ["status", "begin", "data", "data", "commit"]
        assert msgs[-1][2] == {"watermark": "03"}
        assert client.acks == [1, 2]
        await eventually(
            lambda: server.service.reservations.reserved_watermarks() == [],
            "the reservation to be released",
        )
        assert server.service.reservations.reserved_watermarks() == []


async def test_a_valid_replica_subscribes_directly_and_gets_batch_frames(backed_up: Server) -> None:
    server = backed_up
    async with connect(f"{server.url}/replication/v7/subscribe") as ws:
        client = Client(ws)
        await client.send(start("01"))
        first = await client.frame()
        assert first["msg"] == ["status", {"tag": "status"}]
        await ws.send(dumps({"ack": first["id"]}))
        stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
        stream.push_all(txn("02", 100) + txn("03", 100))
        frames = []
        received = 0
        while received < 204:
            f = await client.frame()
            frames.append(f)
            received += len(f["batch"]) if "batch" in f else 1
            await ws.send(dumps({"ack": f["id"]}))
        assert any("batch" in f for f in frames)
        assert all(len(f.get("batch", [0])) <= 64 for f in frames)
        assert [f["id"] for f in frames] == list(range(2, 2 + len(frames)))


async def test_disconnecting_before_subscribing_cancels_the_reservation(backed_up: Server) -> None:
    server = backed_up
    async with connect(f"{server.url}/replication/v7/subscribe") as ws:
        client = Client(ws)
        await client.send(["reserve-snapshot", {"taskID": "t9"}])
        await asyncio.wait_for(server.source.wait_for_stream(), 10)
        await eventually(
            lambda: client.acks or server.service.reservations.is_open("t9"),
            "the reservation t9 to open",
        )
        assert server.service.reservations.is_open("t9")
    await eventually(
        lambda: not server.service.reservations.is_open("t9"), "the reservation t9 to close"
    )
    assert not server.service.reservations.is_open("t9")


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        ([["start-subscription", {"taskID": "t"}]], "start-subscription: missing id"),
        (
            [start("01"), ["reserve-snapshot", {"taskID": "t1"}]],
            "reserve-snapshot after start-subscription",
        ),
        ([start("01"), start("01")], "start-subscription was already received"),
        ([["hello", {}]], "unknown message type 'hello'"),
        ([start("zz")], "start-subscription: watermark"),
        (
            [["reserve-snapshot", {"taskID": "a"}], ["reserve-snapshot", {"taskID": "b"}]],
            "reserve-snapshot of task b: this socket holds the reservation of task a",
        ),
        ([start("01", task="t" * 257)], "taskID is 257 bytes long; at most 256"),
        ([start("01", id="é" * 129)], "id is 258 bytes long; at most 256"),
    ],
)
async def test_out_of_order_or_malformed_control_messages_close_with_1002(
    backed_up: Server, messages: list[list[Any]], reason: str
) -> None:
    async with connect(f"{backed_up.url}/replication/v7/subscribe") as ws:
        client = Client(ws)
        for m in messages:
            await client.send(m)
        with pytest.raises(ConnectionClosed) as e:
            while True:
                await client.frame()
                await ws.send(dumps({"ack": client.next_id}))  # harmless if ignored
    assert e.value.rcvd is not None
    assert e.value.rcvd.code == 1002
    assert reason in e.value.rcvd.reason


async def test_reserving_without_backups_is_a_protocol_error(server: Server) -> None:
    async with connect(f"{server.url}/replication/v7/subscribe") as ws:
        await Client(ws).send(["reserve-snapshot", {"taskID": "t1"}])
        with pytest.raises(ConnectionClosed) as e:
            await asyncio.wait_for(ws.recv(), 10)
    assert e.value.rcvd is not None
    assert e.value.rcvd.code == 1002
    assert "not configured with a ZERO_LITESTREAM_BACKUP_URL" in e.value.rcvd.reason


async def test_v7_changes_with_ws_batched_sends_batch_frames(server: Server) -> None:
    url = f"{server.url}/replication/v7/changes?id=x&replicaVersion=01&watermark=01&wsBatched=true"
    async with connect(url) as ws:
        client = Client(ws)
        await client.messages(1)
        stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
        stream.push_all(txn("02", 50))
        msgs = await client.messages(52)
        assert msgs[-1][0] == "commit"


async def test_a_reservation_superseded_by_another_socket_closes_the_first(
    backed_up: Server,
) -> None:
    server = backed_up
    url = f"{server.url}/replication/v7/subscribe"
    async with connect(url) as first, connect(url) as second:
        one, two = Client(first), Client(second)
        await one.send(["reserve-snapshot", {"taskID": "same-task"}])
        await eventually(
            lambda: one.acks or server.service.reservations.is_open("same-task"),
            "the first reservation of same-task to open",
        )
        await two.send(["reserve-snapshot", {"taskID": "same-task"}])
        with pytest.raises(ConnectionClosed) as e:
            while True:
                await one.frame()
        # Told why: its restore is no longer protected (zero's client reserves again).
        assert e.value.rcvd is not None
        assert e.value.rcvd.code == 1002
        assert e.value.rcvd.reason == (
            "Error: the reservation of task same-task was ended on another connection; "
            "reserve again"
        )
        # The second socket's reservation stands.
        assert server.service.reservations.is_open("same-task")


async def test_one_frame_of_many_reservations_opens_none_and_leaves_nothing_behind(
    backed_up: Server,
) -> None:
    # The probe: 64 task ids in one batch, then close. One reservation per
    # socket, and the frame is refused whole: nothing was reserved.
    url = f"{backed_up.url}/replication/v7/subscribe"
    batch = [["reserve-snapshot", {"taskID": f"leak{i}"}] for i in range(64)]
    async with connect(url) as ws:
        await Client(ws).send(*batch)
        with pytest.raises(ConnectionClosed) as e:
            await asyncio.wait_for(ws.recv(), 10)
    assert e.value.rcvd is not None
    assert (e.value.rcvd.code, e.value.rcvd.reason) == (
        1002,
        "Error: a frame carries at most 8 messages (frame 1 has 64)",
    )
    assert backed_up.service.reservations.open_tasks == []
    # Within the cap, a second task is refused and the socket's one reservation ends
    # with it.
    async with connect(url) as ws:
        await Client(ws).send(*batch[:2])
        with pytest.raises(ConnectionClosed):
            while True:
                await asyncio.wait_for(ws.recv(), 10)
    await eventually(
        lambda: backed_up.service.reservations.open_tasks == [], "every reservation to end"
    )


async def test_a_frame_longer_than_a_client_sends_is_refused_at_its_header(
    backed_up: Server,
) -> None:
    # 100,000 reservations of one task in one 4.3 MB frame held the loop for 3.9 s.
    message = ["reserve-snapshot", {"taskID": "same"}]
    frame = dumps({"id": 1, "batch": [message] * 100_000})
    assert len(frame) > 3_800_000
    async with connect(f"{backed_up.url}/replication/v7/subscribe", max_size=None) as ws:
        with pytest.raises(ConnectionClosed) as e:  # while sending, or right after
            await ws.send(frame)
            await asyncio.wait_for(ws.recv(), 10)
    assert e.value.rcvd is not None
    assert e.value.rcvd.code == 1009  # message too big
    assert backed_up.service.reservations.open_tasks == []


async def test_a_reservation_completed_by_another_connection_closes_its_socket_with_why(
    backed_up: Server,
) -> None:
    # Anyone who knows a task id can subscribe as it: the restoring client must not
    # be left holding a socket that protects nothing.
    server = backed_up
    async with connect(f"{server.url}/replication/v7/subscribe") as ws:
        client = Client(ws)
        await client.send(["reserve-snapshot", {"taskID": "victim"}])
        await eventually(lambda: server.service.reservations.is_open("victim"), "the reservation")
        query = "id=intruder&replicaVersion=01&watermark=01&taskID=victim"
        async with connect(f"{server.url}/replication/v6/changes?{query}"):
            with pytest.raises(ConnectionClosed) as e:
                while True:
                    await client.frame()
    assert e.value.rcvd is not None
    assert e.value.rcvd.code == 1002
    assert e.value.rcvd.reason == (
        "Error: the reservation of task victim was completed by a subscription on another "
        "connection; reserve again"
    )
