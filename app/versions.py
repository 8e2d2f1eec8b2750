"""The replication protocol versions this service speaks: ``/replication/v{N}/…``
for N from ``MIN_PROTOCOL_VERSION`` to ``MAX_PROTOCOL_VERSION`` (wire.md).

Stdlib only (nothing at all): ``changestreamer --version`` reads it without loading
the server.
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_PROTOCOL_VERSION", "MIN_PROTOCOL_VERSION", "PROBE_REPLICA_VERSION"]

MIN_PROTOCOL_VERSION: Final = 1
MAX_PROTOCOL_VERSION: Final = 7
# No replica's version: a client subscribes with it to learn the current one from the
# refusal (app.client's probe); the server refuses it without a warning.
PROBE_REPLICA_VERSION: Final = "00"
