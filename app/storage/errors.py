"""Errors raised by the change DB layer.

``ChangeDbSetupError`` and ``ChangeDbConfigError`` end start-up with one line that
names the problem. ``OwnershipLostError`` and ``ChangeTooLargeError`` are stop
signals (``app.stop_signals``): the service stops instead of retrying.
"""

from __future__ import annotations

from app.stop_signals import AbortError


class StorageError(Exception):
    """Base class of every error this package raises on purpose."""


class ChangeDbConfigError(StorageError):
    """The change DB settings are invalid (URL, app ID, shard number)."""


class ChangeDbSetupError(StorageError):
    """The change DB cannot be used: unreachable, corrupt, foreign or too new."""


class ChangeTooLargeError(AbortError):
    """A change is larger than the change DB stores in one value (SQLite: 10^9
    bytes, its compiled-in maximum; Postgres: a COPY line of 1 GiB). Retrying
    would read it again from the upstream and fail again, so the service stops
    with this message instead. (A zero-cache replica, SQLite too, could not hold
    such a value either.)"""


class OwnershipLostError(AbortError):
    """Another change-streamer has assumed ownership of the change log."""

    def __init__(self, owner: str | None, message: str | None = None) -> None:
        super().__init__(message or f"changeLog ownership has been assumed by {owner}")
        self.owner = owner  # the task that owns it now


class PurgeLockedError(StorageError):
    """A purge found the change log locked by a replica restore; try later."""


class DuplicateChangeError(StorageError):
    """A row with the same ``(watermark, pos)`` is already stored.

    A source re-sent a stored transaction; nothing of the write is kept.
    """

    @classmethod
    def from_driver(cls, message: str) -> DuplicateChangeError:
        """From the driver's unique-violation message."""
        detail = " ".join(message.split())
        return cls(f"a change is already stored at the same (watermark, pos): {detail}")
