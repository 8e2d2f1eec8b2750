"""Snapshot reservations: change-log coverage for view-syncers restoring a backup.

A view-syncer that is about to restore the replica backup opens a reservation
(``/snapshot``, wire.md §3) and keeps it open until it subscribes. The reservation
is *confirmed* once a backup watermark W is known and the change log still reaches
back to W: the client then gets one ``status`` message with ``minWatermark = W``
and W is held out of purges (``reserved_watermarks`` feeds the purge floor), so the
client can catch up from any backup at or after W (core.md §5.8 [new]).

``SnapshotReservations`` owns the reservations (at most one per task: the newest
wins), their confirmation task and their durations. A ``Reservation`` is what the
transport streams to the client: an async iterator of JSON message strings that
ends when the reservation is cancelled or completed.

A reservation that stays open longer than ``max_open_s`` (a restore that hangs,
a client that never subscribes) is cancelled with a warning: it would otherwise
hold purging back for ever. The status carries ``replicaSize`` (bytes of this
service's replica, for the client's restore progress) when it is known.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Final, Literal, NamedTuple, Protocol

from app.logs import log_extra
from app.protocol.canonical_json import dumps
from app.streamer.timers import TimerHandle, Timers

__all__ = [
    "BackupsNotConfiguredError",
    "ChangeLogStateLike",
    "OpenReservation",
    "Reservation",
    "ReservationOutcome",
    "SnapshotReservations",
    "TooManyReservations",
]

ReservationOutcome = Literal["open", "completed", "cancelled"]

# A reservation carries exactly one status message; room for one more keeps a
# programming error visible (an assertion) instead of growing without bound.
_MAX_QUEUED: Final = 2
# A restore of a large replica can take hours; longer than this is a stuck client.
DEFAULT_MAX_OPEN_S: Final = 4 * 3600.0
# Reservations open at once, all tasks together: one per restoring view-syncer, so
# far more than a deployment has; anyone who can reach the port can open them.
DEFAULT_MAX_RESERVATIONS: Final = 64


class OpenReservation(NamedTuple):
    """An open reservation as /statz and /dashboard show it."""

    task_id: str
    open_s: float  # since it was opened
    watermark: str | None  # the reserved watermark, once confirmed


class ChangeLogStateLike(Protocol):
    """What confirmation needs from the change log (``storage.ChangeLogState``)."""

    @property
    def replica_version(self) -> str: ...

    @property
    def min_watermark(self) -> str: ...


class TooManyReservations(RuntimeError):
    """The limit of open reservations is reached; the message says so."""


class BackupsNotConfiguredError(RuntimeError):
    """Reservations need a backup to restore from."""

    def __init__(self) -> None:
        super().__init__("backups are not configured")


class Reservation:
    """One client's reservation, as the transport sees it.

    Iterate it for the messages to send; the iteration ends (cleanly) when the
    reservation is completed by the task's subscription or cancelled. ``cancel``
    is what the transport calls when the client goes away.
    """

    def __init__(
        self, task_id: str, opened_at: float, on_end: Callable[[Reservation], None]
    ) -> None:
        self.task_id = task_id
        self.opened_at = opened_at
        self.reserved_watermark: str | None = None  # set when confirmed
        self.outcome: ReservationOutcome = "open"
        self.expiry: TimerHandle | None = None
        self._on_end = on_end
        self._queue: deque[str] = deque()
        self._wakeup = asyncio.Event()
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def closed(self) -> asyncio.Future[None]:
        """Resolves when the reservation has ended (completed or cancelled)."""
        return self._closed

    @property
    def is_open(self) -> bool:
        return self.outcome == "open"

    def cancel(self) -> None:
        """Ends the reservation without completing it (client gone or superseded)."""
        self._end("cancelled")

    def __aiter__(self) -> Reservation:
        return self

    async def __anext__(self) -> str:
        while True:
            if not self.is_open:
                # Undelivered messages are dropped: a closed reservation protects
                # nothing, so its status must not be acted on any more.
                raise StopAsyncIteration
            if self._queue:
                return self._queue.popleft()
            self._wakeup.clear()
            await self._wakeup.wait()

    def _push(self, message: str) -> None:
        assert len(self._queue) < _MAX_QUEUED, "a reservation carries a single status"
        self._queue.append(message)
        self._wakeup.set()

    def _end(self, outcome: ReservationOutcome) -> None:
        if not self.is_open:
            return
        self.outcome = outcome
        self._queue.clear()
        self._wakeup.set()
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None
        if not self._closed.done():  # an impatient waiter may have cancelled it
            self._closed.set_result(None)
        self._on_end(self)


class SnapshotReservations:
    """The open snapshot reservations of one service.

    ``backup_url`` None means no backups are configured: ``open`` then refuses.
    ``change_log_state`` reads the replica version and the change log's oldest
    watermark (``Replication.change_log_state``).
    """

    def __init__(
        self,
        change_log_state: Callable[[], Awaitable[ChangeLogStateLike]],
        backup_url: str | None,
        timers: Timers,
        *,
        replica_size: Callable[[], int | None] = lambda: None,
        max_open_s: float = DEFAULT_MAX_OPEN_S,
        max_open: int = DEFAULT_MAX_RESERVATIONS,
        logger: logging.Logger | None = None,
    ) -> None:
        self._change_log_state = change_log_state
        self._max_open = max_open
        self._replica_size = replica_size
        self._max_open_s = max_open_s
        self._backup_url = backup_url
        self._timers = timers
        self._log = logger or logging.getLogger(__name__)
        self._by_task: dict[str, Reservation] = {}
        self._backup: str | None = None
        # Reservations being confirmed at this watermark: held out of purges while
        # the change log is read, so no purge can pass W between the read and the
        # confirmation.
        self._confirming: dict[Reservation, str] = {}
        self._confirm_requested = False
        self._confirm_task: asyncio.Task[None] | None = None
        self._delay_logged_at: str | None = None
        self._longest_completed_s = 0.0
        self._stopped = False

    # -- the service's side -------------------------------------------------------

    def open(self, task_id: str) -> Reservation:
        """Reserves the change log for ``task_id``; replaces its previous reservation."""
        if self._backup_url is None:
            raise BackupsNotConfiguredError()
        if self._stopped:
            raise RuntimeError("snapshot reservations are stopped")
        previous = self._by_task.get(task_id)
        if previous is None and len(self._by_task) >= self._max_open:
            self._log.warning(
                "refused a snapshot reservation for task %s: %d are open (the limit)",
                task_id,
                len(self._by_task),
            )
            raise TooManyReservations(
                f"this change-streamer holds at most {self._max_open} snapshot "
                "reservations; retry later"
            )
        now = self._timers.monotonic()
        # A replacement keeps the replaced one's start: replacing a task's reservation
        # again and again (anyone can) must not hold purging back beyond the cap.
        opened_at = previous.opened_at if previous is not None else now
        reservation = Reservation(task_id, opened_at, self._forget)
        self._by_task[task_id] = reservation
        reservation.expiry = self._timers.call_later(
            max(0.0, opened_at + self._max_open_s - now), lambda: self._expire(reservation)
        )
        if previous is not None:
            previous.cancel()
            self._log.info(
                "snapshot reservation of task %s replaced (open for %.1f s)",
                task_id,
                now - opened_at,
            )
        else:
            self._log.info("snapshot reservation opened for task %s", task_id)
        if self._backup is not None:
            self._request_confirmation()
        return reservation

    def close_for_task(self, task_id: str) -> None:
        """``task_id`` subscribed: its reservation has served its purpose."""
        reservation = self._by_task.get(task_id)
        if reservation is None:
            return
        elapsed = self._timers.monotonic() - reservation.opened_at
        reservation._end("completed")
        # Recorded once, only for reservations that were used: this is how long a
        # restore can take, which 1.9-style cleanup delays must cover.
        self._longest_completed_s = max(self._longest_completed_s, elapsed)
        self._log.info("snapshot reservation of task %s completed after %.1f s", task_id, elapsed)

    def track_backup_watermark(self, watermark: str) -> None:
        """A backup now reaches ``watermark``: confirm what is waiting for one."""
        if self._backup is None or watermark > self._backup:
            self._backup = watermark
        if self._pending():
            self._request_confirmation()

    def _expire(self, reservation: Reservation) -> None:
        reservation.expiry = None
        if reservation.is_open:
            self._log.warning(
                "snapshot reservation of task %s open for %.0f s (the limit, "
                "CHANGESTREAMER_RESERVATION_MAX_SECONDS): ending it",
                reservation.task_id,
                self._max_open_s,
                extra=log_extra({"task": reservation.task_id}),  # a timer's line
            )
            reservation.cancel()

    @property
    def open_tasks(self) -> list[str]:
        """Tasks holding an open reservation."""
        return list(self._by_task)

    def is_open(self, task_id: str) -> bool:
        """Whether ``task_id`` holds an open reservation (for /statz and tests)."""
        return task_id in self._by_task

    def open_reservations(self) -> list[OpenReservation]:
        """The open reservations, oldest first."""
        now = self._timers.monotonic()
        found = [
            OpenReservation(r.task_id, max(0.0, now - r.opened_at), r.reserved_watermark)
            for r in self._by_task.values()
        ]
        return sorted(found, key=lambda r: -r.open_s)

    def reserved_watermarks(self) -> list[str]:
        """Watermarks the purge floor must respect (confirmed or being confirmed)."""
        held = [r.reserved_watermark for r in self._by_task.values() if r.reserved_watermark]
        return [*held, *self._confirming.values()]

    @property
    def longest_completed_s(self) -> float:
        """The longest time from open to the task's subscription so far (seconds)."""
        return self._longest_completed_s

    async def stop(self) -> None:
        """Cancels every reservation (their sockets close) and the confirmation task."""
        self._stopped = True
        for reservation in list(self._by_task.values()):
            reservation.cancel()
        task, self._confirm_task = self._confirm_task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})

    async def idle(self) -> None:
        """Waits until no confirmation is running (for orderly shutdown and tests)."""
        while self._confirm_task is not None and not self._confirm_task.done():
            await asyncio.wait({self._confirm_task})

    # -- confirmation --------------------------------------------------------------

    def _pending(self) -> list[Reservation]:
        return [
            r
            for r in self._by_task.values()
            if r.reserved_watermark is None and r not in self._confirming
        ]

    def _request_confirmation(self) -> None:
        if self._stopped:
            return
        self._confirm_requested = True
        if self._confirm_task is None or self._confirm_task.done():
            self._confirm_task = asyncio.get_running_loop().create_task(
                self._confirm_loop(), name="snapshot reservation confirmation"
            )

    async def _confirm_loop(self) -> None:
        # Requests that arrive while a confirmation runs are coalesced into one
        # more pass, so one task serves any number of opens and backups.
        while self._confirm_requested and not self._stopped:
            self._confirm_requested = False
            try:
                await self._confirm_pending()
            except Exception:
                self._log.exception(
                    "cannot confirm snapshot reservations; retrying at the next backup"
                )
            finally:
                self._confirming.clear()

    async def _confirm_pending(self) -> None:
        backup = self._backup
        pending = self._pending()
        if backup is None or not pending:
            return
        for reservation in pending:
            self._confirming[reservation] = backup
        state = await self._change_log_state()
        if state.min_watermark > backup:
            # The log no longer reaches back to this backup: a client restoring it
            # could not catch up. A later backup will be newer than the log's start.
            if self._delay_logged_at != backup:
                self._delay_logged_at = backup
                self._log.error(
                    "cannot confirm snapshot reservations: the change log starts at %s, "
                    "after the backup at %s; waiting for a newer backup",
                    state.min_watermark,
                    backup,
                )
            return
        status: dict[str, object] = {
            "tag": "status",
            "backupURL": self._backup_url,
            "replicaVersion": state.replica_version,
            "minWatermark": backup,
        }
        size = self._replica_size()
        if size is not None:
            status["replicaSize"] = size
        message = dumps(["status", status])
        for reservation in pending:
            if reservation.is_open and reservation.reserved_watermark is None:
                reservation.reserved_watermark = backup
                reservation._push(message)
                self._log.info(
                    "snapshot reservation of task %s confirmed at %s",
                    reservation.task_id,
                    backup,
                    extra=log_extra({"task": reservation.task_id}),  # the confirmer's task
                )

    def _forget(self, reservation: Reservation) -> None:
        # Only the current reservation of a task may remove the task's entry: a
        # superseded one being cancelled must leave its replacement alone.
        if self._by_task.get(reservation.task_id) is reservation:
            del self._by_task[reservation.task_id]
            if reservation.outcome == "cancelled":
                self._log.info(
                    "snapshot reservation of task %s closed before its subscription",
                    reservation.task_id,
                    extra=log_extra({"task": reservation.task_id}),
                )
        self._confirming.pop(reservation, None)
