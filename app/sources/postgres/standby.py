"""When to tell Postgres how far it may advance the slot (spec/source.md §3, "the Acker").

The slot's ``confirmed_flush_lsn`` may only move to a position whose changes are
durably stored in the change log. Three inputs decide it:

* a forwarded ``begin`` (not ``skipAck``) opens a wait for its commit watermark C;
* an upstream ack or status echo for W from the service clears the wait once
  C <= W, and W's LSN may be confirmed;
* an idle keepalive (no reply requested) may confirm its ``walEnd`` only when
  nothing is waiting: everything forwarded before it is stored.

This class is the bookkeeping only; the stream sends what :meth:`take` returns.
Confirmed positions only ever increase.
"""

from __future__ import annotations

from app.protocol.lexi import parse_state_version

__all__ = ["StandbyAcker"]


class StandbyAcker:
    def __init__(self) -> None:
        self._waiting_for: str | None = None
        self._sent = 0
        self._pending = 0

    def on_begin(self, commit_watermark: str, *, skip_ack: bool) -> None:
        if not skip_ack:
            self._waiting_for = commit_watermark

    def on_ack(self, watermark: str) -> None:
        """The service stored everything up to ``watermark`` (a commit or a status echo)."""
        if self._waiting_for is not None and self._waiting_for <= watermark:
            self._waiting_for = None
        # Only the major part is an LSN; a backfill minor never moves the slot further.
        self._propose(parse_state_version(watermark).major)

    def on_idle_keepalive(self, wal_end: int) -> None:
        if self._waiting_for is None:
            self._propose(wal_end)

    def take(self) -> int | None:
        """The LSN to confirm now, if it moved past the last one sent."""
        if self._pending <= self._sent:
            return None
        self._sent = self._pending
        return self._sent

    def _propose(self, lsn: int) -> None:
        if lsn > self._pending:
            self._pending = lsn
