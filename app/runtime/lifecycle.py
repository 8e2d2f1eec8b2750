"""The node's lifecycle: one state machine from start to stop (docs/architecture.md,
decision 52).

::

    restoring ─► following ─► gated ─► delayed ─► owner ─► retiring ─► retired
                                                     │
       any state with a service ──► stopping (asked to stop) or failed (an error)

* **restoring**: ``serve`` restores the replica from the backup or syncs it; the
  server does not listen yet.
* **following**: the service exists and its replica follows the change log (the
  replica follower), and the backup monitor has not read the replica's position yet.
* **gated**: with backups configured, waiting for this node's own backup to cover
  the replica's position as the monitor read it at start (the coverage gate).
* **delayed**: ``/ready`` answers 200 — before the takeover, on purpose, as zero
  does: the routing layer must know this node by the time the old owner lets go —
  and the takeover waits for ``startup_delay_s`` or for the first *accepted* serving
  subscriber (right replica version, serving mode), which proves that the load
  balancer routes to this node.
* **owner**: this node took the change log over: it stores, acks and purges.
* **retiring**: another node took the change log over; this one stops its stream,
  closes its subscribers and ends its children (litestream, the replica follower)
  before it says it retired.
* **retired**: serves nothing and stays up until it is stopped (an orchestrator that
  restarts whatever exits would bring the old node back as the newest). A node that
  restarts with the retirement note beside its replica starts here
  (``app/runtime/retirement.py``).
* **stopping** / **failed**: asked to stop, or the streamer stopped with an error;
  the server is then told to stop (``on_exit``).

``/ready`` is this module's ``readiness``: ready in *delayed* and *owner* while no
health check reports a problem (the change log cannot be written, the replica
follower crash-loops, the backup is wedged or litestream is down); otherwise 503 with
a reason that starts with the state. It says the state, never the new owner's
address (that is for ``/statz``'s ``node`` group, behind a password).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

from app.storage import OwnershipLostError
from app.timeouts import within

if TYPE_CHECKING:
    from app.streamer.service import ChangeStreamerService

__all__ = ["HealthCheck", "NodeLifecycle", "NodeState"]

log = logging.getLogger("app.node")

# Transitions /statz shows (the newest).
HISTORY: Final = 32
# How long a retiring node gives its children (the replica follower) to end.
CHILDREN_TIMEOUT_S: Final = 30.0
# How long reading the new owner's address may take when retiring (best effort).
OWNER_LOOKUP_TIMEOUT_S: Final = 5.0

# A problem a part of the node reports, or None: checked on every /ready.
HealthCheck = Callable[[], str | None]


class NodeState(enum.StrEnum):
    RESTORING = "restoring"
    FOLLOWING = "following"
    GATED = "gated"
    DELAYED = "delayed"
    OWNER = "owner"
    RETIRING = "retiring"
    RETIRED = "retired"
    STOPPING = "stopping"
    FAILED = "failed"


# The states in which /ready may answer 200 (when no health check objects).
_SERVING: Final = frozenset({NodeState.DELAYED, NodeState.OWNER})
# The states in which replication upgrades are refused (503: clients try elsewhere).
_CLOSED: Final = frozenset(
    {NodeState.RETIRING, NodeState.RETIRED, NodeState.STOPPING, NodeState.FAILED}
)
_DETAIL: Final = {
    NodeState.RESTORING: "the replica is being restored or synced",
    NodeState.FOLLOWING: "the backup monitor is reading the replica's position",
    NodeState.RETIRING: "another node took the change log over",
    NodeState.RETIRED: "another node owns the change log",
    NodeState.STOPPING: "this node is shutting down",
    NodeState.FAILED: "the change streamer stopped with an error",
}


class NodeLifecycle:
    """The node's state, the takeover's order, ``/ready`` and the retirement."""

    def __init__(
        self,
        *,
        startup_delay_s: float = 15.0,
        on_exit: Callable[[], None] | None = None,
        on_retired: Callable[[OwnershipLostError], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        state: NodeState = NodeState.RESTORING,
    ) -> None:
        """``on_exit``: the server should stop (the streamer stopped, not retired);
        ``on_retired``: another node took the change log over (leave the note)."""
        self.startup_delay_s = startup_delay_s
        self._on_exit = on_exit
        self._on_retired = on_retired
        self._clock = clock
        self._state = state
        self._since = clock()
        self._history: deque[tuple[str, float]] = deque([(state.value, time.time())], HISTORY)
        self._service: ChangeStreamerService | None = None
        self._checks: list[HealthCheck] = []
        self._children: list[Callable[[], Awaitable[None]]] = []
        self._stop_asked = False
        # Who owns the change log when this node retired (for /statz, not /ready).
        self.owner: str | None = None
        self.owner_address: str | None = None
        self.takeover_cause: str | None = None  # the delay, or a subscriber

    @classmethod
    def retired_at_start(cls, owner: str | None, owner_address: str | None) -> NodeLifecycle:
        """A node that retired before and whose successor is alive (no service)."""
        lifecycle = cls(state=NodeState.RETIRED)
        lifecycle.owner, lifecycle.owner_address = owner, owner_address
        return lifecycle

    # -- the state --------------------------------------------------------------

    @property
    def state(self) -> NodeState:
        return self._state

    @property
    def attached(self) -> bool:
        """Whether a service was attached (``attach``)."""
        return self._service is not None

    def enter(self, state: NodeState, detail: str = "") -> None:
        """Moves to ``state`` (logged once per change)."""
        if state is self._state:
            return
        log.info(
            "node: %s → %s%s", self._state.value, state.value, f" ({detail})" if detail else ""
        )
        self._state = state
        self._since = self._clock()
        self._history.append((state.value, time.time()))

    def attach(
        self,
        service: ChangeStreamerService,
        *,
        checks: tuple[HealthCheck, ...] = (),
        children: tuple[Callable[[], Awaitable[None]], ...] = (),
    ) -> None:
        """The service exists and its replica follows the log: *following*.

        ``checks`` join the service's own (the change log's writes, the backups);
        ``children`` are awaited when the node retires (they end with the service).
        """
        self._service = service
        self._checks = [service.storer.write_problem, service.backups.problem, *checks]
        self._children = list(children)
        self.enter(NodeState.FOLLOWING)

    def add_check(self, check: HealthCheck) -> None:
        self._checks.append(check)

    # -- what the server asks ---------------------------------------------------

    def problems(self) -> list[str]:
        """What the health checks report now."""
        found: list[str] = []
        for check in self._checks:
            try:
                problem = check()
            except Exception as e:  # a broken check is a problem of its own
                problem = f"a health check failed: {e}"
            if problem:
                found.append(problem)
        return found

    def readiness(self) -> tuple[bool, str]:
        """``/ready``: (True, "") or (False, "<state>: <why>")."""
        state = self._state
        problems = self.problems() if state not in _CLOSED else []
        if state in _SERVING and not problems:
            return True, ""
        detail = self._detail()
        if problems:
            detail = "; ".join(([detail] if detail else []) + problems)
        return False, f"{state.value}: {detail}" if detail else state.value

    def _detail(self) -> str:
        if self._state is NodeState.GATED and self._service is not None:
            target = self._service.backups.coverage_target
            if target is None:
                return "waiting for the first backup of the replica"
            return f"waiting for a backup that covers the replica at {target}"
        return _DETAIL.get(self._state, "")

    def refusal(self) -> str | None:
        """Why replication upgrades are refused now (503), or None."""
        if self._state in _CLOSED:
            return f"this change-streamer is {self._state.value}"
        return None

    def stats(self) -> dict[str, Any]:
        """``/statz``'s ``node`` group."""
        ready, reason = self.readiness()
        return {
            "state": self._state.value,
            "seconds": round(self._clock() - self._since, 3),
            "ready": ready,
            "reason": reason or None,
            "problems": self.problems(),
            "startupDelaySeconds": self.startup_delay_s,
            "takeoverCause": self.takeover_cause,
            "owner": self.owner,
            "ownerAddress": self.owner_address,
            "transitions": [{"state": state, "at": round(at, 3)} for state, at in self._history],
        }

    # -- the run ----------------------------------------------------------------

    async def run(self) -> None:
        """Gate → delay → owner, until the service stops (or this node retires)."""
        service = self._service
        if service is None:
            return  # a node that starts retired has nothing to run
        try:
            if await self._gated(service) and await self._delayed(service):
                await self._own(service)
        finally:
            if not self._stop_asked and self._state is not NodeState.RETIRED:
                # The streamer stopped on its own (an error, a reset, the change log's
                # tables gone): without it the process serves nothing useful.
                if self._state not in (NodeState.FAILED, NodeState.STOPPING):
                    self.enter(NodeState.STOPPING, "the change streamer stopped")
                if self._on_exit is not None:
                    self._on_exit()

    async def _gated(self, service: ChangeStreamerService) -> bool:
        """Waits for the coverage gate (False: the service stopped first)."""
        backups = service.backups
        if not backups.covered() and await _first(backups.wait_target(), service.stopped.wait()):
            self.enter(NodeState.GATED, self._detail())
            await _first(backups.wait_covered(), service.stopped.wait())
        return not service.stopped.is_set()

    async def _delayed(self, service: ChangeStreamerService) -> bool:
        """Ready; waits for the start-up delay or an accepted serving subscriber."""
        self.enter(NodeState.DELAYED, f"taking the change log over in {self.startup_delay_s:g} s")
        with contextlib.suppress(TimeoutError):
            await within(
                _first(service.serving_started.wait(), service.stopped.wait()),
                self.startup_delay_s,
            )
        if service.stopped.is_set():
            return False
        self.takeover_cause = (
            "a serving subscriber" if service.serving_started.is_set() else "the start-up delay"
        )
        return True

    async def _own(self, service: ChangeStreamerService) -> None:
        async def owning() -> None:
            await service.owning.wait()
            self.enter(NodeState.OWNER, f"after {self.takeover_cause}")

        watcher = asyncio.create_task(owning(), name="node-owner")
        try:
            await service.run()
        except OwnershipLostError as e:
            await self._retire(service, e)
        except Exception as e:
            log.exception("the change streamer stopped with an error")
            self.enter(NodeState.FAILED, str(e))
            raise
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _retire(self, service: ChangeStreamerService, lost: OwnershipLostError) -> None:
        """Stops everything that served, then says so (module docstring)."""
        self.owner = lost.owner
        self.enter(NodeState.RETIRING, str(lost))
        log.warning("%s; this node serves nothing more and waits to be stopped", lost)
        await service.stop()  # idempotent: subscribers closed, backups (litestream) ended
        for closed in self._children:  # the replica follower: nothing needs it now
            with contextlib.suppress(TimeoutError):
                await within(closed(), CHILDREN_TIMEOUT_S)
        with contextlib.suppress(Exception):
            state = await within(service.replication.state(), OWNER_LOOKUP_TIMEOUT_S)
            if state is not None and state.owner == lost.owner:
                self.owner_address = state.owner_address
        if self._on_retired is not None:
            self._on_retired(lost)
        self.enter(NodeState.RETIRED)

    async def stop(self) -> None:
        """The server shuts down: *stopping* (a retired node stays retired)."""
        self._stop_asked = True
        if self._state not in (NodeState.RETIRED, NodeState.FAILED):
            self.enter(NodeState.STOPPING)
        if self._service is not None:
            await self._service.stop()


async def _first(wanted: Awaitable[Any], stopped: Awaitable[Any]) -> bool:
    """Waits for either; True if ``wanted`` came first (or both)."""
    want = asyncio.ensure_future(wanted)
    stop = asyncio.ensure_future(stopped)
    try:
        await asyncio.wait({want, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        want.cancel()
        stop.cancel()
    return want.done() and not want.cancelled()
