"""Liveness: a peer that never answers pings but keeps acking stays; a silent one goes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import uvicorn
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.uri import parse_uri

from app.protocol.canonical_json import loads
from app.protocol.lexi import to_lexi
from app.server.app import create_app
from app.server.ws_protocol import LivenessProtocol

from ..waiting import eventually
from .conftest import free_port, new_service
from .test_replication_ws import QUERY, txn


class NoPongClient:
    """A websocket client that never answers pings (sans-I/O; its pongs are dropped)."""

    def __init__(self, port: int, path: str, *, acks: bool) -> None:
        self._port, self._path, self._acks = port, path, acks
        self.closed_with: int | None = None
        self.frames = 0

    async def run(self, seconds: float) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self._port)
        conn = ClientProtocol(parse_uri(f"ws://127.0.0.1:{self._port}{self._path}"))
        conn.send_request(conn.connect())
        writer.write(b"".join(conn.data_to_send()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        try:
            while loop.time() < deadline:
                try:
                    data = await asyncio.wait_for(reader.read(65536), deadline - loop.time())
                except TimeoutError:
                    break
                if not data:
                    break
                conn.receive_data(data)
                conn.data_to_send()  # drop what the protocol queued itself: the pongs
                for event in conn.events_received():
                    if getattr(event, "opcode", None) == Opcode.CLOSE:
                        self.closed_with = conn.close_rcvd.code if conn.close_rcvd else 1005
                        return
                    if getattr(event, "opcode", None) == Opcode.TEXT:
                        self.frames += 1
                        if self._acks:
                            assert isinstance(event, Frame)
                            assert isinstance(event.data, (bytes, bytearray))
                            frame_id = loads(event.data.decode())["id"]
                            conn.send_text(f'{{"ack":{frame_id}}}'.encode())
                            writer.write(b"".join(conn.data_to_send()))
        finally:
            writer.close()


async def test_acks_count_as_liveness_and_silence_does_not(tmp_path: Path) -> None:
    db, source, service = await new_service(tmp_path, task_id="t")
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(db, service),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            ws=LivenessProtocol,
            ws_ping_interval=0.2,
            ws_ping_timeout=0.4,
        )
    )
    serving = asyncio.create_task(server.serve())
    await eventually(lambda: server.started, "uvicorn to start", 20)
    try:
        stream = await asyncio.wait_for(source.wait_for_stream(), 10)

        async def produce() -> None:
            for n in range(2, 32):  # a transaction every 100 ms for 3 s
                stream.push_all(txn(to_lexi(n)))
                # Paced, not a wait: acks must keep coming past the ping timeout.
                await asyncio.sleep(0.1)

        path = f"/replication/v6/changes?{QUERY}"
        acking = NoPongClient(port, path, acks=True)
        silent = NoPongClient(port, path.replace("-1", "-silent"), acks=False)
        await asyncio.gather(produce(), acking.run(3.0), silent.run(3.0))
        # The silent peer neither pongs nor acks: dropped by the ping timeout.
        assert silent.closed_with == 1011
        # The acking peer never pongs either, but its acks keep it alive.
        assert acking.closed_with is None
        assert acking.frames > 60
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 20)
