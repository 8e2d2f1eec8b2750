"""A node that another one took the change log from, and its next start.

A retired node stays up, not ready, until it is stopped (``app/server/app.py``). If
its process is restarted anyway — a container that crashed, or an orchestrator that
restarts whatever exits — the restarted process would look like the newest node and
take the change log back after its start-up delay: a ping-pong between the old node
and its replacement. So retiring leaves a note beside the replica file, which a
container restart keeps (the same volume) and a new pod does not have (a new
volume). A process that starts with the note and finds the change log's owner
alive starts retired too; when the owner is gone, the note is stale and goes, and
the node starts as any node does (it may take the log over: nobody else serves it).

The note is ``<replica file>.retired``, one line of JSON: who took the log over,
and when.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Final

from app.runtime.lifecycle import NodeLifecycle
from app.storage import ChangeDb, Replication

if TYPE_CHECKING:
    from app.config import Settings

__all__ = [
    "RETIRED_SUFFIX",
    "clear",
    "note_path",
    "owner_alive",
    "read",
    "still_retired",
    "write",
]

log = logging.getLogger(__name__)

RETIRED_SUFFIX: Final = ".retired"
# How long the owner's liveness endpoint has to answer.
ALIVE_TIMEOUT_S: Final = 3.0


def note_path(replica_file: Path) -> Path:
    return replica_file.with_name(replica_file.name + RETIRED_SUFFIX)


def write(replica_file: Path, owner: str | None) -> None:
    """Leaves the note (best effort: a node that cannot write it is still retired)."""
    path = note_path(replica_file)
    note = json.dumps({"owner": owner, "retiredAt": time.time()})
    try:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(note + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot leave the retirement note %s: %s", path, e)


def read(replica_file: Path) -> str | None:
    """The owner the note names ("" when it names none), or None without a note."""
    path = note_path(replica_file)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cannot read the retirement note %s: %s", path, e)
        return None
    try:
        owner = json.loads(text).get("owner")
    except (ValueError, AttributeError):
        return ""  # a note all the same: this node did retire
    return owner if isinstance(owner, str) else ""


def clear(replica_file: Path) -> None:
    note_path(replica_file).unlink(missing_ok=True)


async def owner_alive(address: str, timeout_s: float = ALIVE_TIMEOUT_S) -> bool:
    """Whether the change-streamer at ``address`` (``replicationState.ownerAddress``)
    answers its liveness endpoint, ``/``."""
    if "://" in address:
        scheme, _, rest = address.partition("://")
        scheme = "https" if scheme in ("wss", "https") else "http"
    else:
        scheme, rest = "http", address
    url = f"{scheme}://{rest.rstrip('/')}/"

    # No proxy from the environment: the owner is a peer of this node.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def probe() -> bool:
        try:
            with opener.open(url, timeout=timeout_s) as reply:
                return bool(reply.status == 200)
        except (OSError, ValueError):
            return False

    return await asyncio.to_thread(probe)


async def still_retired(settings: Settings, db: ChangeDb) -> NodeLifecycle | None:
    """A node that starts *retired* (it left the note, and the change log's owner is
    alive), or None: no note, or a stale one (removed)."""
    noted = await asyncio.to_thread(read, settings.replica_file)
    if noted is None:
        return None
    try:
        state = await Replication(db).state()
    finally:
        await db.dispose()  # the server runs its own event loop and pools
    if (
        state is not None
        and state.owner_address
        and state.owner != settings.task_id
        and await owner_alive(state.owner_address)
    ):
        return NodeLifecycle.retired_at_start(state.owner, state.owner_address)
    log.info("this node retired before, but the change log's owner is gone: starting anew")
    await asyncio.to_thread(clear, settings.replica_file)
    return None
