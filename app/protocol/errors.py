"""In-band subscription errors: ``["error", {"type": N, "message": "..."}]``.

Subscribers treat any error message as terminal (a 1.9.0 view-syncer shuts down
and restores its replica from backup), so the server sends one only for the two
conditions below (and, in newer upstream, a chronic laggard).  ``UNKNOWN`` exists in
the protocol but is never sent: 1.9.0 tests the code for truthiness, and an
internal failure must close the stream without an error frame so clients retry.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final

from app.protocol.canonical_json import dumps

__all__ = [
    "STREAM_TOO_FAR_BEHIND_SINCE",
    "ErrorType",
    "error_message_json",
    "watermark_too_old_json",
    "wrong_replica_version_json",
]


class ErrorType(IntEnum):
    UNKNOWN = 0
    WRONG_REPLICA_VERSION = 1
    WATERMARK_TOO_OLD = 2
    STREAM_TOO_FAR_BEHIND = 3

    @property
    def readable_name(self) -> str:
        """Name as zero's replicator prints it (``"WatermarkTooOld: <message>"``)."""
        return _READABLE_NAMES[self]


# Protocol v6 (zero 1.9) knows error types 1 and 2; StreamTooFarBehind came with v7.
STREAM_TOO_FAR_BEHIND_SINCE: Final = 7

_READABLE_NAMES = {
    ErrorType.UNKNOWN: "Unknown",
    ErrorType.WRONG_REPLICA_VERSION: "WrongReplicaVersion",
    ErrorType.WATERMARK_TOO_OLD: "WatermarkTooOld",
    ErrorType.STREAM_TOO_FAR_BEHIND: "StreamTooFarBehind",
}


def error_message_json(error_type: ErrorType, message: str) -> str:
    """The canonical JSON of an error message for a subscriber."""
    return dumps(["error", {"type": int(error_type), "message": message}])


def wrong_replica_version_json(current: str, requested: str) -> str:
    return error_message_json(
        ErrorType.WRONG_REPLICA_VERSION,
        f"current replica version is {current} (requested {requested})",
    )


def watermark_too_old_json(earliest: str, requested: str) -> str:
    return error_message_json(
        ErrorType.WATERMARK_TOO_OLD,
        f"earliest supported watermark is {earliest} (requested {requested})",
    )
