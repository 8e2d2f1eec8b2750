"""Upstream acks: what the change source may forget, and when (core.md §2.7 [new], §8 B4).

An ack for watermark W tells the source that everything it sent at or below W is
durable, so it may discard it (Postgres: advance the slot's ``confirmed_flush_lsn``).
``UpstreamAcker`` owns that decision for the whole service. It combines

* the upstream message order (``on_upstream``): which transactions and
  ack-requesting statuses this connection has seen, and
* store progress (``track_change_log`` / ``track_backup``): how far the change log
  and, when configured, the replica backup durably reach,

and pushes ``["status", body, {"watermark": W}]`` tuples into the current stream's
ack sink. Acks are monotonic per connection, never repeated, and never above what
every tracked store holds. Store progress survives ``reset`` (a new connection);
everything learnt from the old connection does not.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

from app.protocol.messages import Begin, ChangeSourceMessage, Commit, Rollback, Status

__all__ = ["RECENT_COMMIT_BODIES", "AckSink", "UpstreamAcker"]

AckSink = Callable[[list[Any]], None]

# Commit bodies kept so that an ack can echo the commit payload exactly as
# received (sources may read fields such as PG's commitLsn back from it). Only
# commits not yet acked are kept, so this bound matters only when the store lags
# far behind the stream; older ones are then acked with a bare {"tag":"commit"}.
RECENT_COMMIT_BODIES: Final = 1000


class UpstreamAcker:
    """Decides which acks the upstream change source gets (one per service).

    ``with_change_log`` / ``with_backup`` choose the stores an ack must wait for:
    the durable watermark is the minimum over the tracked stores, and nothing is
    acked until every tracked store has reported once.
    """

    def __init__(
        self,
        *,
        with_change_log: bool = True,
        with_backup: bool = False,
        recent_commits: int = RECENT_COMMIT_BODIES,
        logger: logging.Logger | None = None,
    ) -> None:
        if not (with_change_log or with_backup):
            raise ValueError("UpstreamAcker needs at least one store to track")
        if recent_commits < 1:
            raise ValueError(f"recent_commits must be at least 1, got {recent_commits}")
        self._with_change_log = with_change_log
        self._with_backup = with_backup
        self._recent_limit = recent_commits
        self._log = logger or logging.getLogger(__name__)

        # Store progress: survives reset().
        self._change_log: str | None = None
        self._backup: str | None = None

        # Per connection: cleared by reset().
        self._sink: AckSink | None = None
        self._last_ack = ""
        self._last_tx = ""
        self._last_status: Status | None = None
        self._held_status: Status | None = None
        self._open_tx: Begin | None = None
        self._commit_bodies: OrderedDict[str, dict[str, Any]] = OrderedDict()

    # -- inputs ---------------------------------------------------------------

    def reset(self, sink: AckSink | None) -> None:
        """Starts a new upstream connection (``sink``) or ends the current one (None).

        The new connection starts with no ack sent, so the next input re-acks the
        durable watermark on it: harmless for the source, and it recovers an ack
        that the old connection may have lost in flight.
        """
        self._sink = sink
        self._last_ack = ""
        self._last_tx = ""
        self._last_status = None
        self._held_status = None
        self._open_tx = None
        self._commit_bodies.clear()

    def on_upstream(self, msg: ChangeSourceMessage) -> None:
        """Every upstream message, in stream order (data and control are ignored)."""
        if isinstance(msg, Begin):
            self.on_begin(msg)
        elif isinstance(msg, Commit):
            self.on_commit(msg)
        elif isinstance(msg, Rollback):
            self._open_tx = None
            self._release_held_status()
            self._maybe_ack()
        elif isinstance(msg, Status) and msg.ack:
            if self._open_tx is not None:
                # B4, conservative: a status that arrives inside a transaction may
                # sit at or beyond that transaction's commit, so it waits until the
                # transaction has ended (and, if committed, has been stored).
                self._held_status = _later(self._held_status, msg)
                return
            self._last_status = _later(self._last_status, msg)
            self._maybe_ack()

    def on_begin(self, msg: Begin) -> None:
        """``on_upstream`` of a begin (the main loop calls it directly)."""
        self._open_tx = msg
        self._maybe_ack()

    def on_commit(self, msg: Commit) -> None:
        """``on_upstream`` of a commit."""
        begin, self._open_tx = self._open_tx, None
        # A skipAck (backfill) transaction is never acked: its commit neither
        # becomes lastTx nor has a body to echo. Backfills are re-requested from
        # the persisted backfill state after a restart, so the source may
        # forget them.
        if begin is None or not begin.skip_ack:
            self._last_tx = max(self._last_tx, msg.watermark)
            self._remember_commit(msg)
        self._release_held_status()
        self._maybe_ack()

    def track_change_log(self, watermark: str) -> None:
        """The storer made a (non-skipAck) commit at ``watermark`` durable."""
        if self._change_log is None or watermark > self._change_log:
            self._change_log = watermark
        if self._with_change_log:
            self._maybe_ack()

    def track_backup(self, watermark: str) -> None:
        """The replica backup durably reaches ``watermark`` (ignored unless tracked)."""
        if not self._with_backup:
            return
        if self._backup is None or watermark > self._backup:
            self._backup = watermark
        self._maybe_ack()

    # -- state ----------------------------------------------------------------

    @property
    def durable(self) -> str | None:
        """The watermark every tracked store has reached, if all have reported."""
        # Read on every commit: no temporary collections.
        if not self._with_backup:
            return self._change_log
        if not self._with_change_log or self._backup is None:
            return self._backup
        if self._change_log is None:
            return None
        return min(self._change_log, self._backup)

    @property
    def last_ack(self) -> str:
        """The newest watermark acked on the current connection ("" if none)."""
        return self._last_ack

    # -- decision -------------------------------------------------------------

    def _maybe_ack(self) -> None:
        if self._sink is None:
            return  # between connections: the next stream restarts from the log
        durable = self.durable
        if durable is not None and durable > self._last_ack:
            body = self._commit_bodies.get(durable) or {"tag": "commit"}
            if not self._send(["status", body, {"watermark": durable}], durable):
                return
        status = self._last_status
        if (
            status is not None
            and status.watermark > self._last_ack
            and self._last_ack >= self._last_tx
            # Transactions of earlier connections sit below this stream's start
            # point; they are in the change log but maybe not yet in the backup.
            and self._last_ack >= (self._change_log or "")
        ):
            self._send(["status", status.body, {"watermark": status.watermark}], status.watermark)

    def _send(self, ack: list[Any], watermark: str) -> bool:
        sink = self._sink
        assert sink is not None
        try:
            sink(ack)
        except Exception:
            # A broken sink means a dead connection: stop using it rather than
            # failing the storer that reported progress. reset() installs the next.
            self._log.warning(
                "upstream ack sink failed; dropping acks until the next stream", exc_info=True
            )
            self._sink = None
            return False
        self._last_ack = watermark
        while self._commit_bodies and next(iter(self._commit_bodies)) <= watermark:
            self._commit_bodies.popitem(last=False)
        return True

    def _remember_commit(self, commit: Commit) -> None:
        if commit.watermark <= self._last_ack:
            return  # a replayed commit that is already covered: the ack goes out now
        self._commit_bodies[commit.watermark] = commit.body
        if len(self._commit_bodies) > self._recent_limit:
            self._commit_bodies.popitem(last=False)

    def _release_held_status(self) -> None:
        if self._held_status is not None:
            self._last_status = _later(self._last_status, self._held_status)
            self._held_status = None


def _later(current: Status | None, new: Status) -> Status:
    # Status watermarks are monotonic by contract; keep the newest regardless.
    if current is None or new.watermark >= current.watermark:
        return new
    return current
