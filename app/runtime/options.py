"""Settings → service options, shared by every upstream ``serve`` can run."""

from __future__ import annotations

import uuid

from app.backup.destinations import resolve
from app.config import Settings
from app.runtime.memory_limit import back_pressure_bytes
from app.streamer.service import StreamerOptions
from app.streamer.storer import DEFAULT_BACK_PRESSURE_BYTES

__all__ = ["streamer_options", "task_id"]


def streamer_options(settings: Settings, *, backup_path: str | None = None) -> StreamerOptions:
    """The service's options; ``backup_path``: this node's destination under the backup
    URL (``app/backup/destinations.py``), what reservations tell view-syncers."""
    return StreamerOptions(
        back_pressure_bytes=back_pressure_bytes(
            settings.back_pressure_bytes,
            settings.back_pressure_heap_proportion,
            DEFAULT_BACK_PRESSURE_BYTES,
        ),
        statement_timeout_s=settings.change_statement_timeout_ms / 1000,
        change_log_batch_size=settings.change_log_batch_size,
        timeout_proportion=(
            -1.0  # early release off, as a negative padding does in zero 1.9
            if settings.consensus_padding_s is not None and settings.consensus_padding_s < 0
            else settings.consensus_timeout_proportion
        ),
        slow_subscriber_grace_s=settings.slow_subscriber_grace_s,
        max_unconsumed_bytes=settings.subscriber_max_unacked_bytes,
        max_subscribers=settings.max_subscribers,
        max_sockets_per_address=settings.max_sockets_per_address,
        subscriber_max_lag_s=settings.subscriber_max_lag_s,
        subscriber_max_lag_bytes=settings.subscriber_max_lag_bytes,
        allowed_origins=tuple(settings.allowed_origins),
        replication_password=settings.replication_password,
        max_reservations=settings.max_reservations,
        auto_reset=settings.auto_reset,
        backup_url=(
            resolve(settings.litestream_backup_url, backup_path)
            if settings.litestream_backup_url
            else None
        ),
        reservation_max_s=settings.reservation_max_s,
        replica_file=str(settings.replica_file) if settings.upstream_db else None,
        purge_delay_s=settings.purge_delay_s,
        change_log_retention_s=settings.change_log_retention_s,
    )


def task_id(settings: Settings) -> str:
    """``ZERO_TASK_ID``, else a random one for this process."""
    return settings.task_id or f"changestreamer-{uuid.uuid4().hex[:12]}"
