"""A Python client of the change-streamer (protocol v6), plus the ``tail``/``status`` commands.

Modules, one idea each:

* :mod:`~app.client.client` — :class:`ChangeStreamerClient` (subscribe, resume,
  reserve_snapshot, probe_replica_version);
* :mod:`~app.client.subscription` — one ``/changes`` connection, acks, errors;
* :mod:`~app.client.resume` — reconnecting subscription with backoff;
* :mod:`~app.client.reservation` — ``/snapshot`` reservations and their followup;
* :mod:`~app.client.channel` — the websocket: envelopes, acks, liveness, closes;
* :mod:`~app.client.discovery` — the streamer's address from the change DB;
* :mod:`~app.client.errors` — the exceptions;
* :mod:`~app.client.urls` — base URI handling;
* :mod:`~app.client.render`, :mod:`~app.client.tail`, :mod:`~app.client.status` — the commands.
"""

from app.client.client import ChangeStreamerClient
from app.client.discovery import discover
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
    WatermarkTooOldError,
    WrongReplicaVersionError,
)
from app.client.reservation import ReservationFollowup, SnapshotStatus
from app.client.resume import ReconnectPolicy, ResumingSubscription
from app.client.status import add_status_arguments, run_status, status
from app.client.subscription import Subscription, SubscriptionContext, SubscriptionMessage
from app.client.tail import add_tail_arguments, run_tail, tail

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
    "SnapshotStatus",
    "StreamTooFarBehindError",
    "Subscription",
    "SubscriptionContext",
    "SubscriptionMessage",
    "WatermarkTooOldError",
    "WrongReplicaVersionError",
    "add_status_arguments",
    "add_tail_arguments",
    "discover",
    "run_status",
    "run_tail",
    "status",
    "tail",
]
