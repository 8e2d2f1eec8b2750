"""uvicorn's websocket protocol, with zero's liveness rule.

The server pings every interval; uvicorn drops a peer whose pong does not come
back within the timeout. Zero's rule is more forgiving (spec/wire.md §1.3): a
peer is alive if *either* a pong *or* any other frame (an ack, say) arrived,
because a replicator busy applying a large transaction may answer pings late
while its acks still flow. So any inbound data here counts as the pong that
uvicorn waits for.

This leans on uvicorn's sans-I/O implementation's keepalive attributes
(``pending_ping_payload``, ``pong_timer``, ``schedule_ping``); a test pins the
behaviour, so an uvicorn upgrade that renames them fails loudly.
"""

from __future__ import annotations

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol


class LivenessProtocol(WebSocketsSansIOProtocol):
    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.pending_ping_payload is not None and self.pong_timer is not None:
            # As good as a pong: the peer is reading and writing.
            self.pending_ping_payload = None
            self.pong_timer.cancel()
            self.pong_timer = None
            self.schedule_ping()
