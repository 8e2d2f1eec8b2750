"""The errors that setting up and checking a Postgres upstream raise on purpose.

Each class names one kind of failure so callers can decide without parsing text:
a misconfigured server or shard config is fatal until someone fixes it, an
unsupported table or schema change needs a resync, and ``AutoResetRequired`` is
the streamer's auto-reset signal (a new replica has to be synced).
"""

from __future__ import annotations

from typing import Any

from app.stop_signals import AutoResetSignal


class ShardSetupError(Exception):
    """Base class: the upstream cannot be used for replication as it is."""


class UpstreamConfigError(ShardSetupError):
    """The server itself is unsuitable (``wal_level``, version)."""


class ShardConfigError(ShardSetupError):
    """The app ID, shard number or publication names are invalid or unknown."""


class UnsupportedTableSchemaError(ShardSetupError):
    """A published table cannot be replicated (names, replica identity, reserved column)."""


class PublicationError(ShardSetupError):
    """A publication does not publish every operation, or publishes a table twice differently."""


class SlotCreationError(ShardSetupError):
    """``CREATE_REPLICATION_SLOT`` failed or timed out."""


class AutoResetRequired(AutoResetSignal):
    """The replica's slot or replicas row is gone or unusable: sync a new replica."""


class DdlError(Exception):
    """A DDL event cannot be replicated; the stream must emit reset-required.

    ``description`` is the cause alone; the message adds the reference's prefix.
    ``event`` is the DDL event that failed (for ``errorDetails``), if known.
    """

    def __init__(self, description: str, event: dict[str, Any] | None = None) -> None:
        super().__init__(f"Replication halted. Resync the replica to recover: {description}")
        self.description = description
        self.event = event
