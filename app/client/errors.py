"""Exceptions raised by the change-streamer client.

Everything derives from :class:`ClientError`. Four families matter to callers:

* :class:`ChangeStreamerError` — the server sent an in-band ``["error", …]``
  message (wire.md §2.3). Terminal: zero's replicator shuts down and restores
  from backup instead of retrying, and so does :mod:`app.client.resume`.
* :class:`ProtocolError` — the server closed with 1002: the request itself was
  rejected (bad path or version, missing parameter, no backups configured).
* :class:`ConnectionLostError` — the connection failed or broke (no close
  frame, an unexpected close code, liveness timeout, an unparsable frame, or
  the connection could not be opened at all). Retrying is the normal reaction.
* :class:`UnauthorizedError` — the upgrade was refused with HTTP 401 (the
  replication password is missing or wrong) or 403 (access refused). Terminal:
  retrying gets the same answer, so nothing in the client retries it; the
  operator has to change a setting.
"""

from __future__ import annotations

from typing import Any

from app.client.credentials import REPLICATION_PASSWORD_ENV
from app.protocol.errors import ErrorType
from app.protocol.subscription_messages import DownstreamError

__all__ = [
    "ChangeStreamerError",
    "ClientError",
    "ConnectFailedError",
    "ConnectionLostError",
    "DiscoveryError",
    "InvalidMessageError",
    "NoChangeStreamerError",
    "ProtocolError",
    "StreamTooFarBehindError",
    "UnauthorizedError",
    "WatermarkTooOldError",
    "WrongReplicaVersionError",
    "error_from_message",
]


class ClientError(Exception):
    """Base of every error raised by :mod:`app.client`."""


class ChangeStreamerError(ClientError):
    """An in-band ``error`` message; ``str()`` is ``"<ReadableName>: <message>"``.

    ``error_type`` is an :class:`ErrorType` when the code is known, else the raw
    integer (a newer server may send codes this client does not know).
    """

    def __init__(self, error_type: ErrorType | int, message: str, body: dict[str, Any]) -> None:
        self.error_type = error_type
        self.message = message
        self.body = body
        name = (
            error_type.readable_name if isinstance(error_type, ErrorType) else f"Error{error_type}"
        )
        super().__init__(f"{name}: {message}")


class WrongReplicaVersionError(ChangeStreamerError):
    """The subscriber's replica was made from another replica version (type 1)."""


class WatermarkTooOldError(ChangeStreamerError):
    """The change log no longer reaches back to the subscriber's watermark (type 2)."""


class StreamTooFarBehindError(ChangeStreamerError):
    """The server dropped the subscriber for lagging too long (type 3)."""


_BY_TYPE: dict[ErrorType, type[ChangeStreamerError]] = {
    ErrorType.WRONG_REPLICA_VERSION: WrongReplicaVersionError,
    ErrorType.WATERMARK_TOO_OLD: WatermarkTooOldError,
    ErrorType.STREAM_TOO_FAR_BEHIND: StreamTooFarBehindError,
}


def error_from_message(error: DownstreamError) -> ChangeStreamerError:
    """The typed exception for a parsed ``error`` message."""
    known = error.error_type
    if known is None:
        return ChangeStreamerError(error.type, error.message, error.body)
    cls = _BY_TYPE.get(known, ChangeStreamerError)
    return cls(known, error.message, error.body)


class ProtocolError(ClientError):
    """The server closed the socket with 1002; ``reason`` is its text verbatim."""

    code = 1002

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason or "protocol error (1002) without a reason")


class ConnectionLostError(ClientError):
    """The connection ended abnormally; ``code``/``reason`` of the close if one came."""

    def __init__(self, message: str, *, code: int | None = None, reason: str = "") -> None:
        self.code = code
        self.reason = reason
        super().__init__(message)


class ConnectFailedError(ConnectionLostError):
    """The websocket could not be opened (refused, timed out, handshake rejected)."""


class UnauthorizedError(ClientError):
    """The server refused the websocket upgrade with ``status`` 401 or 403.

    ``url`` is the endpoint without user info, so the message (one line: the URL,
    the status, what to do) never shows the password.
    """

    def __init__(self, url: str, status: int) -> None:
        self.url = url
        self.status = status
        if status == 401:
            advice = (
                "the replication password is missing or wrong; "
                f"set {REPLICATION_PASSWORD_ENV} or pass --password-file"
            )
        else:
            advice = (
                "access refused; check the change-streamer's CHANGESTREAMER_ALLOWED_ORIGINS "
                "and any proxy in between"
            )
        super().__init__(f"{url} answered HTTP {status}: {advice}")


class InvalidMessageError(ConnectionLostError):
    """The server sent a frame this client cannot parse; the socket was closed.

    zero's client reacts to this the same way as to a dropped connection (close
    and retry), hence the base class.
    """


class DiscoveryError(ClientError):
    """The change DB could not tell where the change-streamer runs."""


class NoChangeStreamerError(DiscoveryError):
    """``replicationState.ownerAddress`` is empty: no change-streamer owns the log."""
