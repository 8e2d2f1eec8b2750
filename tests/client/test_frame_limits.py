"""A frame over the client's ``max_message_bytes`` ends the subscription at the
frame's header: a clear error at once, and the payload is never read.

The server here is hostile in the way that mattered: it streams the payload on
and never reads, so it never hears the client's close (1009). websockets' client
then waited for the server to close the TCP connection, reading and discarding
the whole payload, and the caller heard only of the liveness timeout, 33 s on."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
from websockets.http11 import Request
from websockets.server import ServerProtocol

from app.client import ChangeStreamerClient, InvalidMessageError, SubscriptionContext
from app.client.channel import MAX_MESSAGE_BYTES

from .conftest import REPLICA_VERSION, TIMEOUT, wait_until

HUGE = 150 * 1024 * 1024  # over MAX_MESSAGE_BYTES (100 MiB)


@dataclass
class HugeFrameServer:
    """A websocket server that answers the upgrade with a text frame announcing
    ``HUGE`` bytes, writes the payload, ignores what the client sends and holds the
    connection until the client drops it; ``taken`` is how much of the payload the
    connection took (the sockets' buffers included), ``done`` set once it ended."""

    url: str
    taken: int = 0
    done: bool = False


@asynccontextmanager
async def huge_frame_server() -> AsyncIterator[HugeFrameServer]:
    stub: HugeFrameServer | None = None

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert stub is not None
        protocol = ServerProtocol()
        while not (events := protocol.events_received()):
            protocol.receive_data(await reader.read(65536))
        request = events[0]
        assert isinstance(request, Request)
        protocol.send_response(protocol.accept(request))
        writer.write(b"".join(protocol.data_to_send()))
        writer.write(struct.pack("!BBQ", 0x81, 127, HUGE))  # a server's frame: unmasked
        chunk = bytes(1 << 20)
        try:
            while stub.taken < HUGE:
                writer.write(chunk)
                await writer.drain()
                stub.taken += len(chunk)
            await reader.read()  # until the client drops the connection
        except ConnectionError:
            pass
        finally:
            stub.done = True
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    stub = HugeFrameServer(f"ws://127.0.0.1:{port}")
    async with server:
        yield stub


@pytest.mark.parametrize("protocol_version", [6, 7])
async def test_a_frame_over_the_limit_fails_at_its_header_without_being_read(
    protocol_version: int,
) -> None:
    assert HUGE > MAX_MESSAGE_BYTES
    async with huge_frame_server() as stub:
        client = ChangeStreamerClient(stub.url, protocol_version=protocol_version)
        subscription = await client.subscribe(
            SubscriptionContext("sub-1", REPLICA_VERSION, REPLICA_VERSION)
        )
        with pytest.raises(InvalidMessageError) as e:
            await asyncio.wait_for(subscription.__anext__(), TIMEOUT)
        assert str(e.value) == (
            "refused a frame from the change-streamer: "
            f"frame with {HUGE} bytes exceeds limit of {MAX_MESSAGE_BYTES} bytes"
        )
        # The client stopped reading at the header and dropped the connection: the
        # server's writes broke once the sockets' buffers (a few MiB) were full, far
        # short of the payload.
        await wait_until(lambda: stub.done, "the connection to end")
        assert stub.taken < HUGE // 4, f"{stub.taken >> 20} MiB of the payload were taken"
        await subscription.close()
