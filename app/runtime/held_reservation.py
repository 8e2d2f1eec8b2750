"""A snapshot reservation on the current owner, held across event loops during a takeover.

A replacement node restores the backup *before* its server (and event loop) runs,
then takes the change log over. The old owner must not purge what the restored
replica still has to catch up on until then: while a reservation is open it
purges nothing. So the reservation lives in a thread with a loop of its own,
from before the restore until ``release`` — called once this node owns the
change log (the old owner then stops and closes the socket anyway).

An owner that cannot be reached is the usual case (it is gone) and only noted; an
owner that refuses the replication password is a misconfiguration, and a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Final

from app.timeouts import within

__all__ = ["HeldReservation"]

log = logging.getLogger(__name__)

RESERVE_TIMEOUT_S: Final = 10.0
RELEASE_POLL_S: Final = 0.1
JOIN_TIMEOUT_S: Final = 10.0


class HeldReservation:
    def __init__(self, address: str, task_id: str, *, password: str | None = None) -> None:
        self.address = address
        self._task_id = task_id
        self._password = password
        self._reserved = threading.Event()
        self._done = threading.Event()
        self._release = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="held-reservation", daemon=True)

    def start(self) -> bool:
        """Reserves on the owner; True once it confirmed (False: unreachable, refused)."""
        self._thread.start()
        while not (self._reserved.is_set() or self._done.is_set()):
            self._done.wait(RELEASE_POLL_S)
        return self._reserved.is_set()

    def release(self) -> None:
        """Ends the reservation (idempotent); waits a bounded time for the thread."""
        self._release.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed
                loop.call_soon_threadsafe(wake.set)
        if self._thread.is_alive():
            self._thread.join(JOIN_TIMEOUT_S)

    @property
    def held(self) -> bool:
        return self._reserved.is_set() and not self._done.is_set()

    def _main(self) -> None:
        from app.client import UnauthorizedError
        from app.client.credentials import REPLICATION_PASSWORD_ENV

        try:
            asyncio.run(self._hold())
        except UnauthorizedError as e:  # a misconfiguration, not an owner that is gone
            if e.status == 401:
                log.warning(
                    "no snapshot reservation on the current owner %s: it refused this node's "
                    "replication password (HTTP 401); the nodes must share one %s",
                    self.address,
                    REPLICATION_PASSWORD_ENV,
                )
            else:
                log.warning(
                    "no snapshot reservation on the current owner %s: access refused (HTTP %d)",
                    self.address,
                    e.status,
                )
        except Exception as e:  # an old owner that is gone is the usual case
            log.info("no snapshot reservation on the current owner %s: %s", self.address, e)
        finally:
            self._done.set()

    async def _hold(self) -> None:
        from app.client import ChangeStreamerClient
        from app.client.discovery import address_to_url

        client = ChangeStreamerClient(
            address_to_url(self.address), open_timeout_s=5.0, password=self._password
        )
        _status, followup = await within(client.reserve_snapshot(self._task_id), RESERVE_TIMEOUT_S)
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        self._reserved.set()
        try:
            if not self._release.is_set():  # a release before _wake existed is seen here
                waits = {
                    asyncio.ensure_future(self._wake.wait()),
                    asyncio.ensure_future(followup.closed.wait()),
                }
                try:
                    await asyncio.wait(waits, return_when="FIRST_COMPLETED")
                finally:
                    for w in waits:
                        w.cancel()
        finally:
            with contextlib.suppress(Exception):
                await followup.cancel()
