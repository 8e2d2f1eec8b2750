"""The keep-alive rule of a custom change-source connection (spec/source.md §4.1).

Every interval the client checks whether anything came from the peer since the
previous check (a message or a pong) and then pings again; an interval without
either means the peer is gone. One refinement: while our own reader is not
waiting for input (the consumer is busy storing), the websocket library stops
reading the socket once its small buffer is full, so pongs go unread too. That is
back-pressure from our side, not silence from the peer, and does not count.
"""

from __future__ import annotations


class Liveness:
    """Decides at each tick whether the peer showed any sign of life since the last one."""

    def __init__(self) -> None:
        # The connection was just opened: that counts as activity for the first interval.
        self._active = True

    def activity(self) -> None:
        """Something arrived from the peer (a message or a pong)."""
        self._active = True

    def tick(self, *, reader_waiting: bool) -> bool:
        """Ends an interval; False means the peer has been silent and must be dropped.

        ``reader_waiting`` says whether our reader is blocked waiting for input right now.
        """
        alive = self._active or not reader_waiting
        self._active = False
        return alive
