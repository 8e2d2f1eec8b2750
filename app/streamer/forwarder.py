"""Live fan-out of changes to subscribers, with flow control and laggard eviction.

Subscribers that arrive while a transaction is being forwarded wait in
``queued`` and become ``active`` at the next commit or rollback: they receive
whole transactions only, and the storer catches them up to exactly that point
(spec/core.md §3.4).

A progress tick (1 s) samples each subscriber's consumption rate. With the
consensus timeout on, a subscriber that missed the last release deadline and
is slower than the slowest on-time subscriber is *lagging*; lagging without a
break for the grace period gets it disconnected with ``StreamTooFarBehind``
(spec/core.md §4.6), so one slow replica cannot keep costing everyone else.

A subscriber counts for flow control only once it has acknowledged something (its
status message comes first): until then a checkpoint does not wait for it, and one
that acknowledges nothing within ``FIRST_ACK_TIMEOUT_S`` is dropped, so a crowd of
clients that connect and never read cannot take everyone's pace.

A subscriber can also hold the stream without ever being judged a laggard: when
it does not ack or does not read, and either it is the only one or the stuck ones
are so many that no majority consumes the checkpoint (so no consensus timer is
ever armed), the main loop waits on it for good. So the tick also drops, with
``StreamTooFarBehind``, every subscriber the waited-on checkpoint still waits for
once that checkpoint is older than the grace period: whatever the reason, it has
not consumed 64 KiB of changes in that time while the stream waited.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from app.protocol.errors import STREAM_TOO_FAR_BEHIND_SINCE, ErrorType
from app.streamer.broadcast import Broadcast, ReleaseMode
from app.streamer.histogram import LATENCY_BOUNDS_S, Histogram
from app.streamer.subscriber import Change, Subscriber
from app.streamer.timers import TimerHandle, Timers

log = logging.getLogger(__name__)

PROGRESS_TICK_S = 1.0
RATE_SAMPLES = 10
# A subscriber that has acknowledged nothing (not even its status message) this
# long after it was sent its first message is dropped; until its first ack it does
# not hold flow control. The clock starts at that message, not at joining: waiting
# for the log to become durable or for a catch-up turn is the service's delay.
FIRST_ACK_TIMEOUT_S = 10.0


@dataclass(slots=True)
class _Rate:
    # When its first message was sent (to a tick), or the join while none was.
    first_sent: float = 0.0
    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=RATE_SAMPLES))

    def add(self, now: float, processed: int) -> None:
        self.samples.append((now, processed))

    def per_second(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None


@dataclass(slots=True)
class FlowControlStats:
    """Released checkpoints by release mode and by how long the loop waited for
    them (zero's ``flow_control.waits`` and ``flow_control.wait_duration``)."""

    durations: dict[str, Histogram] = field(
        default_factory=lambda: {
            "all-subscribers": Histogram(LATENCY_BOUNDS_S),
            "consensus-timeout": Histogram(LATENCY_BOUNDS_S),
        }
    )

    @property
    def waits(self) -> dict[str, int]:
        return {mode: h.count for mode, h in self.durations.items()}

    @property
    def wait_seconds(self) -> float:
        return sum(h.sum for h in self.durations.values())


class Forwarder:
    def __init__(
        self,
        *,
        timers: Timers,
        timeout_proportion: float | None = 2.0,
        grace_period_s: float = 30.0,
    ) -> None:
        self._timers = timers
        # A negative proportion disables early release (always wait for everyone).
        self._proportion = timeout_proportion if (timeout_proportion or 0) >= 0 else None
        self._grace_s = grace_period_s
        self.active: set[Subscriber] = set()
        self.queued: set[Subscriber] = set()
        self.in_transaction = False
        self.current: Broadcast | None = None  # the checkpoint being waited on
        self._in_flight: Broadcast | None = None  # the newest checkpoint
        self.stats = FlowControlStats()
        self._rates: dict[Subscriber, _Rate] = {}
        self._tick: TimerHandle | None = None

    @property
    def rate_samples(self) -> int:
        """Subscribers whose ack rate is tracked (one per subscriber, until removed)."""
        return len(self._rates)

    # -- membership ---------------------------------------------------------

    def add(self, sub: Subscriber) -> None:
        (self.queued if self.in_transaction else self.active).add(sub)
        self._rates[sub] = _Rate(first_sent=self._timers.monotonic())

    def remove(self, sub: Subscriber) -> None:
        self.active.discard(sub)
        self.queued.discard(sub)
        self._rates.pop(sub, None)
        sub.close()

    def acks(self) -> list[str]:
        """The acked watermark of every subscriber (active or queued)."""
        return [s.acked for s in (*self.active, *self.queued)]

    def named_acks(self) -> list[tuple[str, str]]:
        """``(subscriber id, acked watermark)`` of every subscriber, for the purge floor."""
        return [(s.id, s.acked) for s in (*self.active, *self.queued)]

    def joined(self) -> list[tuple[Subscriber, float]]:
        """Every subscriber with when it joined (monotonic)."""
        return [(s, self._rates[s].first_sent) for s in (*self.active, *self.queued)]

    # -- forwarding ---------------------------------------------------------

    def forward(
        self, changes: list[Change], *, checkpoint: bool = False
    ) -> asyncio.Future[ReleaseMode] | None:
        """Sends ``changes`` (in stream order) to every active subscriber, a batch per
        subscriber, without waiting: all of it has been handed out when this returns.

        Subscribers queued mid-transaction join right after the batch's next commit
        or rollback. With ``checkpoint`` the last change is a flow-control
        checkpoint (a tracked broadcast), and the returned future is the release of
        the checkpoint *before* it (None if there is none to wait for): pipelined
        one deep, since waiting on the newest would drain the subscribers' pipelines
        at every 64 KiB and leave the main loop idle for a round trip each time
        (decision 31 in docs/architecture.md). A subscriber that does not ack still
        stops the main loop within two checkpoints' worth of changes.
        """
        sent: list[tuple[Subscriber, asyncio.Future[Any] | None]] = []
        start, end = 0, len(changes)
        while start < end:
            stop = end if not self.queued else _after_boundary(changes, start, end)
            part = changes if stop - start == end else changes[start:stop]
            track = checkpoint and stop == end
            # A snapshot: a send can close a subscriber (its channel overflowed),
            # which removes it from the set being iterated.
            for sub in tuple(self.active):
                result = sub.send(part, track=track)
                # Not before its first ack: a client that connects and never reads
                # (a flood, a crowd of reconnects) must not hold everyone's pace.
                if track and sub.processed:
                    sent.append((sub, result))
            self._update_state(part)
            start = stop
        if not checkpoint:
            return None
        newest = Broadcast(
            sent,
            timers=self._timers,
            timeout_proportion=self._proportion,
            watermark=changes[-1].watermark if changes else "",
        )
        waited, self._in_flight = self._in_flight, newest
        if waited is None:
            return None
        self.current = waited
        waited.done.add_done_callback(partial(self._released, waited, self._timers.monotonic()))
        return waited.done

    def _released(
        self, broadcast: Broadcast, since: float, done: asyncio.Future[ReleaseMode]
    ) -> None:
        if self.current is broadcast:
            self.current = None
        if not done.cancelled():
            self.stats.durations[done.result()].observe(self._timers.monotonic() - since)

    def release_current(self) -> None:
        """Lets the waiting and the in-flight checkpoint go (the upstream stream
        ended): the next stream starts with no checkpoint to wait on."""
        for broadcast in (self.current, self._in_flight):
            if broadcast is not None:
                broadcast.cancel()
        self._in_flight = None

    def send_status(self) -> None:
        # A snapshot: a send can close a subscriber (its channel overflowed), which
        # removes it from the set being iterated.
        for sub in tuple(self.active):
            sub.send_status()

    def _update_state(self, changes: list[Change]) -> None:
        """The transaction state after ``changes``: from their last boundary."""
        for change in reversed(changes):
            tag = change.tag
            if tag == "begin":
                self.in_transaction = True
                return
            if tag == "commit" or tag == "rollback":
                self.in_transaction = False
                if self.queued:
                    self.active |= self.queued
                    self.queued.clear()
                return

    # -- progress and laggards ----------------------------------------------

    def start_progress_monitor(self) -> None:
        if self._tick is None:
            self._tick = self._timers.call_later(PROGRESS_TICK_S, self._on_tick)

    def stop_progress_monitor(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None

    def _on_tick(self) -> None:
        self._tick = self._timers.call_later(PROGRESS_TICK_S, self._on_tick)
        now = self._timers.monotonic()
        for sub in [*self.active, *self.queued]:
            if sub.closed:
                self.remove(sub)
                continue
            rate = self._rates[sub]
            rate.add(now, sub.processed)
            if not sub.started:
                rate.first_sent = now  # nothing sent yet: nothing to ack
            elif not sub.processed and now - rate.first_sent >= FIRST_ACK_TIMEOUT_S:
                log.info(
                    "dropping subscriber %s: nothing acknowledged in %.0f s",
                    sub.id,
                    FIRST_ACK_TIMEOUT_S,
                    extra=sub.log_extra,
                )
                self.remove(sub)
        if self.current is not None and self.current.completed < self.current.majority:
            info = self.current.describe()
            if info["elapsedMs"] >= 1000:
                log.info("flow control waiting for a majority of subscribers: %s", info)
        self._check_laggards(now)
        self._check_stuck()

    def rate(self, sub: Subscriber) -> float | None:
        rate = self._rates.get(sub)
        return None if rate is None else rate.per_second()

    def _check_laggards(self, now: float) -> None:
        if self._grace_s <= 0 or self._proportion is None:
            return
        on_time = [
            r for s in self.active if not s.missed_last_timeout and (r := self.rate(s)) is not None
        ]
        if not on_time:
            return  # no baseline: nobody is judged
        baseline = min(on_time)
        for sub in list(self.active):
            if sub.mode == "backup" or not sub.missed_last_timeout:
                sub.lagging_since = None
                continue
            rate = self.rate(sub)
            if rate is None or rate >= baseline:
                sub.lagging_since = None  # catching up
                continue
            if sub.lagging_since is None:
                sub.lagging_since = now
            elif now - sub.lagging_since >= self._grace_s:
                lagged_ms = round((now - sub.lagging_since) * 1000)
                self.drop(sub, f"lagging for over {round(self._grace_s * 1000)}ms ({lagged_ms}ms)")

    def _check_stuck(self) -> None:
        """Drops whoever the waited-on checkpoint has waited for over the grace period."""
        current = self.current
        if self._grace_s <= 0 or current is None or current.age_s < self._grace_s:
            return
        held_ms = round(current.age_s * 1000)
        for sub in current.pending:
            self.drop(
                sub,
                f"held up flow control for over {round(self._grace_s * 1000)}ms "
                f"({held_ms}ms without consuming a checkpoint)",
            )

    def drop(self, sub: Subscriber, reason: str) -> None:
        """Disconnects ``sub`` with StreamTooFarBehind; no checkpoint waits for it.

        Protocol v6 has no such error type (zero 1.9 has error types 1 and 2): a v6
        client is closed without an error message, which it answers by reconnecting
        and resuming, as a v7 client does with the error."""
        log.warning("disconnecting subscriber %s: %s", sub.id, reason, extra=sub.log_extra)
        self.active.discard(sub)
        self.queued.discard(sub)
        self._rates.pop(sub, None)
        for broadcast in (self.current, self._in_flight):
            if broadcast is not None:
                broadcast.forget(sub)
        if sub.protocol_version >= STREAM_TOO_FAR_BEHIND_SINCE:
            sub.close(ErrorType.STREAM_TOO_FAR_BEHIND, reason)
        else:
            sub.close(None, reason)

    def close_all(self) -> None:
        for sub in [*self.active, *self.queued]:
            sub.close()
        self.active.clear()
        self.queued.clear()
        self._rates.clear()


def _after_boundary(changes: list[Change], start: int, end: int) -> int:
    """The index after the first commit or rollback in ``changes[start:end]`` (else end)."""
    for i in range(start, end):
        tag = changes[i].tag
        if tag == "commit" or tag == "rollback":
            return i + 1
    return end
