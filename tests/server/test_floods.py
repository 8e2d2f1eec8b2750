"""A control-frame flood ends in any state of the connection: also once the server
began closing it, when uvicorn kept reading (and parsing) the flooder until its close
timeout, 10 s, while the subscribers beside it waited for the event loop."""

from __future__ import annotations

import asyncio
import logging

import pytest
from websockets.asyncio.client import connect

from app.protocol.lexi import to_lexi

from ..waiting import eventually
from .conftest import Server
from .test_replication_ws import QUERY, txn
from .test_robustness import follow
from .test_ws_control_bounds import masked, raw_upgrade, read_frame

# How long a flood may last at most here: uvicorn's close timeout (10 s) is what
# ended it before; the allowance runs out on the first read of pings.
FLOOD_BOUND_S = 5.0


async def flood_until_dropped(writer: asyncio.StreamWriter) -> float:
    """Sends pings (500 a write) without reading until the server drops the
    connection; returns how long that took."""
    pings = masked(9, b"p" * 125) * 500
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        while True:
            writer.write(pings)
            await writer.drain()
    except ConnectionError:
        return loop.time() - started


async def test_a_ping_flood_while_closing_is_aborted_at_once_and_others_keep_streaming(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.server.ws_protocol")
    path = f"/replication/v6/changes?{QUERY}"
    async with connect(f"{server.url}{path.replace('-1', '-healthy')}") as healthy:
        await healthy.recv()
        await healthy.send('{"ack":1}')
        reader, writer = await raw_upgrade(server, path)
        opcode, _ = await read_frame(reader)  # the status message
        assert opcode == 1
        # An ack for a frame never sent: the server closes the stream (a protocol
        # violation). From its close frame on, the connection is closing.
        writer.write(masked(1, b'{"ack":1}') + masked(1, b'{"ack":999}'))
        while opcode != 8:
            opcode, _ = await read_frame(reader)
        stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
        for n in range(2, 22):
            stream.push_all(txn(to_lexi(n)))
        try:
            flooded_s, commits = await asyncio.gather(
                asyncio.wait_for(flood_until_dropped(writer), 30),
                follow(healthy, to_lexi(21)),
            )
        finally:
            writer.close()
        assert flooded_s < FLOOD_BOUND_S, f"the flood went on for {flooded_s:.1f} s"
        assert "aborting a websocket from" in caplog.text
        assert "more than 100 control frames" in caplog.text
        await eventually(lambda: server.connections() == 1, "the flooder's connection gone")
        # The healthy subscriber got every commit meanwhile.
        assert len(commits) == 20
