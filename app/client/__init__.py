"""A Python change-streamer client (protocol v6; v7 on request) and ``tail``/``status``.

Modules, one idea each:

* :mod:`~app.client.client` — :class:`ChangeStreamerClient` (subscribe, resume,
  reserve_snapshot, connect, probe_replica_version);
* :mod:`~app.client.subscription` — one ``/changes`` connection, acks, errors;
* :mod:`~app.client.resume` — reconnecting subscription with backoff;
* :mod:`~app.client.reservation` — ``/snapshot`` reservations and their followup;
* :mod:`~app.client.v7` — protocol v7: the one ``/subscribe`` socket (connect,
  reserve, then subscribe on the same socket);
* :mod:`~app.client.channel` — the websocket: envelopes, acks, liveness, closes;
* :mod:`~app.client.discovery` — the streamer's address from the change DB;
* :mod:`~app.client.errors` — the exceptions;
* :mod:`~app.client.urls` — base URI handling;
* :mod:`~app.client.render`, :mod:`~app.client.tail`, :mod:`~app.client.status` — the commands
  (:mod:`~app.client.terminal`: their tables on a terminal; their options: ``app/cli.py``).
"""

from app.client.client import ChangeStreamerClient
from app.client.discovery import discover, discovering
from app.client.errors import (
    ChangeStreamerError,
    ClientError,
    ConnectFailedError,
    ConnectionLostError,
    DiscoveryError,
    InvalidMessageError,
    NoChangeStreamerError,
    ProtocolError,
    StreamTooFarBehindError,
    UnauthorizedError,
    WatermarkTooOldError,
    WrongReplicaVersionError,
)
from app.client.reservation import ReservationFollowup, SnapshotFollowup, SnapshotStatus
from app.client.resume import ReconnectPolicy, ResumingSubscription
from app.client.status import run_status, status
from app.client.subscription import Subscription, SubscriptionContext, SubscriptionMessage
from app.client.tail import run_tail, tail
from app.client.v7 import V7Connection, V7Message, V7ReservationFollowup

__all__ = [
    "ChangeStreamerClient",
    "ChangeStreamerError",
    "ClientError",
    "ConnectFailedError",
    "ConnectionLostError",
    "DiscoveryError",
    "InvalidMessageError",
    "NoChangeStreamerError",
    "ProtocolError",
    "ReconnectPolicy",
    "ReservationFollowup",
    "ResumingSubscription",
    "SnapshotFollowup",
    "SnapshotStatus",
    "StreamTooFarBehindError",
    "Subscription",
    "SubscriptionContext",
    "SubscriptionMessage",
    "UnauthorizedError",
    "V7Connection",
    "V7Message",
    "V7ReservationFollowup",
    "WatermarkTooOldError",
    "WrongReplicaVersionError",
    "discover",
    "discovering",
    "run_status",
    "run_tail",
    "status",
    "tail",
]
