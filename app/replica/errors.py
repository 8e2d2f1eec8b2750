"""The replica's exceptions: one base class, :class:`ReplicaError`, for everything the
replica code refuses (a malformed or inapplicable change, a replica file that is not
one, a replica that must be re-synced)."""

from __future__ import annotations

__all__ = ["ReplicaError", "ResyncRequiredError", "UnsupportedColumnDefaultError"]


class ReplicaError(Exception):
    """A change or a replica file the replica code cannot work with."""


class UnsupportedColumnDefaultError(ReplicaError):
    """An added column's default is not one SQLite can be given (zero backfills those)."""


class ResyncRequiredError(ReplicaError):
    """The replica cannot continue from the change-streamer; it must be synced anew."""
