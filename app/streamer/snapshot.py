"""One reading of the service's state: what ``/statz``, ``/metrics``, the dashboard
and the OTLP export show of it.

``take_snapshot`` walks the service's parts (forwarder, subscribers, storer,
backups, purger, reservations, loop lag) once, synchronously, on the event loop
that owns them, and copies what it reads into frozen values; pages and exporters
read those, never the parts, so each value is read in one place and means the
same everywhere. What costs a query (the change log's rows and size, the
replication rows, the change source's own stats and metrics) is not in it: the
pages await those themselves, bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from app.streamer.backup_watch import BackupWatch
from app.streamer.forwarder import Forwarder
from app.streamer.histogram import Histogram, HistogramReading
from app.streamer.loop_lag import LoopLag
from app.streamer.purge import Purger
from app.streamer.reservations import OpenReservation, SnapshotReservations
from app.streamer.storer import Storer
from app.streamer.subscriber import Mode, Subscriber

__all__ = [
    "BackupSnapshot",
    "LoopLagSnapshot",
    "PurgeSnapshot",
    "ReservationsSnapshot",
    "ServiceSnapshot",
    "SubscriberSnapshot",
    "take_snapshot",
]


@dataclass(frozen=True, slots=True)
class SubscriberSnapshot:
    id: str
    task_id: str | None
    mode: Mode
    state: Literal["active", "queued"]  # queued: until the current transaction ends
    protocol_version: int
    watermark: str
    acked: str
    catching_up: bool
    catchup_from: str  # the range the catch-up reads (``to``: None until it starts)
    catchup_to: str | None
    backlog_messages: int  # live messages buffered while it catches up
    buffered_bytes: int
    pending_messages: int  # sent, not yet acked
    unacked_commits: int  # transactions sent, not acked
    ack_lag_s: float  # how long the oldest durable commit it has not acked has been durable
    missed_releases: int
    lagging: bool


@dataclass(frozen=True, slots=True)
class LoopLagSnapshot:
    """How late the event loop ran what was due: now, and the worst of 10 s and 60 s."""

    latest_s: float
    max_10s_s: float
    max_60s_s: float


@dataclass(frozen=True, slots=True)
class BackupSnapshot:
    url: str | None  # as configured, credentials included: pages redact it
    watermark: str | None
    coverage_target: str | None
    covered: bool
    problem: str | None
    lag_s: float | None  # how long the oldest commit no backup holds has been durable
    monitor: dict[str, object] | None  # what the running backups say (None: none)


@dataclass(frozen=True, slots=True)
class PurgeSnapshot:
    floor: str | None
    floor_holder: str | None
    purged_below: str | None
    passes: int
    rows_deleted: int


@dataclass(frozen=True, slots=True)
class ReservationsSnapshot:
    open_tasks: tuple[str, ...]
    longest_completed_s: float
    held: tuple[OpenReservation, ...]  # oldest first


@dataclass(frozen=True, slots=True)
class ServiceSnapshot:
    running: bool
    task_id: str
    replica_version: str
    upstream_type: str
    transactions: int
    changes: int
    durable_watermark: str
    storer_queued_bytes: int  # waiting to be written to the change log
    last_commit_age_s: float | None  # since the newest commit became durable
    lag_report: dict[str, Any] | None  # the newest, as subscribers receive it
    loop_lag: LoopLagSnapshot
    subscribers: tuple[SubscriberSnapshot, ...]  # the active ones first
    flow_control_waits: dict[str, HistogramReading]  # by release mode, in seconds
    commit_forward_s: HistogramReading  # upstream commit → forwarded
    group_commit_rows: HistogramReading
    catchup_s: HistogramReading  # catch-up asked for → read to its end
    backup: BackupSnapshot
    purge: PurgeSnapshot
    reservations: ReservationsSnapshot

    @property
    def active_subscribers(self) -> int:
        return sum(1 for s in self.subscribers if s.state == "active")

    @property
    def queued_subscribers(self) -> int:
        return sum(1 for s in self.subscribers if s.state == "queued")


class SnapshotSource(Protocol):
    """The parts of ``ChangeStreamerService`` a snapshot reads (a protocol: the
    service builds its snapshot with this module, which cannot import it back)."""

    @property
    def running(self) -> bool: ...
    @property
    def task_id(self) -> str: ...
    @property
    def replica_version(self) -> str: ...
    @property
    def upstream_type(self) -> str: ...
    @property
    def transactions(self) -> int: ...
    @property
    def changes(self) -> int: ...
    @property
    def latest_lag_report(self) -> dict[str, Any] | None: ...
    @property
    def commit_forward_seconds(self) -> Histogram: ...
    @property
    def loop_lag(self) -> LoopLag: ...
    @property
    def forwarder(self) -> Forwarder: ...
    @property
    def storer(self) -> Storer: ...
    @property
    def backups(self) -> BackupWatch: ...
    @property
    def purger(self) -> Purger: ...
    @property
    def reservations(self) -> SnapshotReservations: ...


def take_snapshot(service: SnapshotSource) -> ServiceSnapshot:
    """``service``'s state now (on its event loop: its parts are not thread-safe)."""
    forwarder, storer, backups = service.forwarder, service.storer, service.backups
    purger, reservations, loop_lag = service.purger, service.reservations, service.loop_lag
    subscribers = (
        *(_subscriber(sub, "active", backups) for sub in forwarder.active),
        *(_subscriber(sub, "queued", backups) for sub in forwarder.queued),
    )
    return ServiceSnapshot(
        running=service.running,
        task_id=service.task_id,
        replica_version=service.replica_version,
        upstream_type=service.upstream_type,
        transactions=service.transactions,
        changes=service.changes,
        durable_watermark=storer.durable,
        storer_queued_bytes=storer.queued_bytes,
        last_commit_age_s=backups.last_commit_age_s(),
        lag_report=service.latest_lag_report,
        loop_lag=LoopLagSnapshot(loop_lag.latest_s, loop_lag.max_s(10.0), loop_lag.max_s()),
        subscribers=subscribers,
        flow_control_waits={
            mode: HistogramReading.of(h) for mode, h in forwarder.stats.durations.items()
        },
        commit_forward_s=HistogramReading.of(service.commit_forward_seconds),
        group_commit_rows=HistogramReading.of(storer.group_commit_rows),
        catchup_s=HistogramReading.of(storer.catchups.seconds),
        backup=BackupSnapshot(
            url=backups.backup_url,
            watermark=backups.watermark,
            coverage_target=backups.coverage_target,
            covered=backups.covered(),
            problem=backups.problem(),
            lag_s=backups.lag_s(),
            monitor=backups.stats(),
        ),
        purge=PurgeSnapshot(
            floor=purger.floor,
            floor_holder=purger.floor_holder,
            purged_below=purger.purged_watermark or None,
            passes=purger.passes,
            rows_deleted=purger.deleted,
        ),
        reservations=ReservationsSnapshot(
            open_tasks=tuple(reservations.open_tasks),
            longest_completed_s=reservations.longest_completed_s,
            held=tuple(reservations.open_reservations()),
        ),
    )


def _subscriber(
    sub: Subscriber, state: Literal["active", "queued"], backups: BackupWatch
) -> SubscriberSnapshot:
    return SubscriberSnapshot(
        id=sub.id,
        task_id=sub.task_id,
        mode=sub.mode,
        state=state,
        protocol_version=sub.protocol_version,
        watermark=sub.watermark,
        acked=sub.acked,
        catching_up=sub.backlogged,
        catchup_from=sub.catchup_from,
        catchup_to=sub.catchup_to,
        backlog_messages=sub.backlog_size,
        buffered_bytes=sub.buffered_bytes,
        pending_messages=sub.downstream.pending,
        unacked_commits=sub.unacked_commits,
        ack_lag_s=backups.durable_wait_s(sub.acked),
        missed_releases=sub.missed_releases,
        lagging=sub.lagging_since is not None,
    )
