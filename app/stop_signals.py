"""The errors that stop the service instead of being retried, whoever raises them.

A change source raises them (a custom source's reset request, a slot Postgres
dropped), the change DB raises them (ownership taken over, a change too large to
store), and the service and ``serve`` decide on them: stop, and with
``AutoResetSignal`` wipe the replica and sync it again when auto-reset is on.
"""

from __future__ import annotations

__all__ = ["AbortError", "AutoResetSignal"]


class AbortError(Exception):
    """Stop the service; retrying cannot help."""


class AutoResetSignal(AbortError):
    """The replica must be wiped and synced again (a new replicaVersion)."""
