"""Every ``ZERO_*`` name zero-cache 1.9.0 defines, and what this service does with it.

Zero deployments give all roles (replication-manager, view-syncers) one shared
environment, so a change-streamer sees many settings that are not its own. Each
name is in exactly one category:

* ``IMPLEMENTED`` — a :class:`~app.config.Settings` field reads it.
* ``OTHER_ROLE`` — zero-cache's replication-manager never reads it (view-syncer,
  mutators, queries, auth, CVR DB, …): accepted and named once at start-up.
* ``TUNING_IGNORED`` — zero-cache's change-streamer reads it, but here it has no
  effect, because this service does that part its own way (or not at all, where
  nothing depends on it): accepted and named once at start-up, with the reason.
* ``UNSUPPORTED`` — it would change what this role does, and that is not
  implemented: start-up is refused unless it is unset, empty or zero's default.

The source list is ``docs/zero-1.9.0-settings.tsv`` (a test keeps the two equal);
the replication-manager's reads were checked in zero-cache 1.9.0's
``server/change-streamer.js``, ``server/main.js`` and ``server/replicator.js``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Final

__all__ = [
    "CATALOG",
    "OUTSIDE_OPTIONS",
    "OWN_EXTENSIONS",
    "Category",
    "ZeroSetting",
    "refusal",
    "startup_notes",
]


class Category(Enum):
    IMPLEMENTED = "implemented"
    OTHER_ROLE = "other role"
    TUNING_IGNORED = "tuning ignored"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True, slots=True)
class ZeroSetting:
    category: Category
    # OTHER_ROLE: the role that reads it; TUNING_IGNORED / UNSUPPORTED: shown to the user.
    reason: str = ""
    # UNSUPPORTED only: values (lower case) that mean zero's default, so change nothing.
    harmless: frozenset[str] = frozenset()


def _implemented() -> ZeroSetting:
    return ZeroSetting(Category.IMPLEMENTED)


def _other(role: str) -> ZeroSetting:
    return ZeroSetting(Category.OTHER_ROLE, role)


def _ignored(reason: str) -> ZeroSetting:
    return ZeroSetting(Category.TUNING_IGNORED, reason)


def _unsupported(reason: str, *harmless: str) -> ZeroSetting:
    return ZeroSetting(Category.UNSUPPORTED, reason, frozenset(harmless))


_NO_EVENTS: Final = "this service publishes no ZeroEvents"
_NO_SHADOW_SYNC: Final = "this service runs no shadow initial syncs"
_PUSH: Final = "view-syncer: custom mutators"
_QUERIES: Final = "view-syncer: synced queries"
_CVR: Final = "view-syncer: CVR database"
_AUTH: Final = "view-syncer: JWT auth"
_IVM: Final = "view-syncer: IVM"
_SOCKETS: Final = "view-syncer: client websockets"

# In docs/zero-1.9.0-settings.tsv's order.
CATALOG: Final[Mapping[str, ZeroSetting]] = {
    "ZERO_UPSTREAM_DB": _implemented(),
    # pg or custom (app/runtime/custom.py); Settings refuses anything else.
    "ZERO_UPSTREAM_TYPE": _implemented(),
    # zero reads it only for committing mutations; here it caps the non-replication
    # upstream connections open at once (initial sync's copy workers).
    "ZERO_UPSTREAM_MAX_CONNS": _implemented(),
    "ZERO_UPSTREAM_MAX_CONNS_PER_WORKER": _other("view-syncer: mutations"),
    # Refused at start-up on Postgres before 17 (zero silently ignores it there).
    "ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER": _implemented(),
    "ZERO_UPSTREAM_PG_STREAM_INBOUND_TIMEOUT_MS": _implemented(),
    "ZERO_PUSH_URL": _other(_PUSH),
    "ZERO_PUSH_API_KEY": _other(_PUSH),
    "ZERO_PUSH_FORWARD_COOKIES": _other(_PUSH),
    "ZERO_PUSH_ALLOWED_CLIENT_HEADERS": _other(_PUSH),
    "ZERO_PUSH_ALLOWED_REQUEST_HEADERS": _other(_PUSH),
    "ZERO_MUTATE_URL": _other(_PUSH),
    "ZERO_MUTATE_API_KEY": _other(_PUSH),
    "ZERO_MUTATE_FORWARD_COOKIES": _other(_PUSH),
    "ZERO_MUTATE_ALLOWED_CLIENT_HEADERS": _other(_PUSH),
    "ZERO_MUTATE_ALLOWED_REQUEST_HEADERS": _other(_PUSH),
    "ZERO_GET_QUERIES_URL": _other(_QUERIES),
    "ZERO_GET_QUERIES_API_KEY": _other(_QUERIES),
    "ZERO_GET_QUERIES_FORWARD_COOKIES": _other(_QUERIES),
    "ZERO_GET_QUERIES_ALLOWED_CLIENT_HEADERS": _other(_QUERIES),
    "ZERO_GET_QUERIES_ALLOWED_REQUEST_HEADERS": _other(_QUERIES),
    "ZERO_QUERY_URL": _other(_QUERIES),
    "ZERO_QUERY_API_KEY": _other(_QUERIES),
    "ZERO_QUERY_FORWARD_COOKIES": _other(_QUERIES),
    "ZERO_QUERY_ALLOWED_CLIENT_HEADERS": _other(_QUERIES),
    "ZERO_QUERY_ALLOWED_REQUEST_HEADERS": _other(_QUERIES),
    "ZERO_ENABLE_CRUD_MUTATIONS": _other("view-syncer: CRUD mutations"),
    "ZERO_CVR_DB": _other(_CVR),
    "ZERO_CVR_MAX_CONNS": _other(_CVR),
    "ZERO_CVR_MAX_CONNS_PER_WORKER": _other(_CVR),
    "ZERO_CVR_GARBAGE_COLLECTION_INACTIVITY_THRESHOLD_HOURS": _other(_CVR),
    "ZERO_CVR_GARBAGE_COLLECTION_INITIAL_INTERVAL_SECONDS": _other(_CVR),
    "ZERO_CVR_GARBAGE_COLLECTION_INITIAL_BATCH_SIZE": _other(_CVR),
    "ZERO_QUERY_HYDRATION_STATS": _other(_IVM),
    # zero's change-streamer checks its replica with it.
    "ZERO_SQLITE_CORRUPTION_CHECKS": _ignored("this service runs no SQLite corruption checks"),
    "ZERO_ENABLE_QUERY_PLANNER": _other(_IVM),
    "ZERO_ENABLE_QUERY_COVERING": _other(_IVM),
    "ZERO_YIELD_THRESHOLD_MS": _other(_IVM),
    "ZERO_CHANGE_DB": _implemented(),
    # A Postgres change DB's pool; a SQLite one has one writer and its own readers.
    "ZERO_CHANGE_MAX_CONNS": _implemented(),
    "ZERO_CHANGE_STATEMENT_TIMEOUT_MS": _implemented(),
    "ZERO_CHANGE_LOG_BATCH_SIZE": _implemented(),
    "ZERO_REPLICA_FILE": _implemented(),
    # zero's replication-manager vacuums its backup replica with it.
    "ZERO_REPLICA_VACUUM_INTERVAL_HOURS": _ignored("the replica is not VACUUMed at start-up"),
    "ZERO_LOG_LEVEL": _implemented(),
    "ZERO_LOG_FORMAT": _implemented(),
    "ZERO_LOG_SLOW_ROW_THRESHOLD": _other(_IVM),
    "ZERO_LOG_SLOW_HYDRATE_THRESHOLD": _other(_IVM),
    "ZERO_LOG_IVM_SAMPLING": _other(_IVM),
    "ZERO_APP_ID": _implemented(),
    "ZERO_APP_PUBLICATIONS": _implemented(),
    # zero-cache 1.9.0 refuses any value ("no longer an option"), so this service does too.
    "ZERO_SHARD_ID": _unsupported("zero-cache refuses it too; use ZERO_APP_ID"),
    "ZERO_SHARD_NUM": _implemented(),
    "ZERO_AUTH_JWK": _other(_AUTH),
    "ZERO_AUTH_JWKS_URL": _other(_AUTH),
    "ZERO_AUTH_SECRET": _other(_AUTH),
    "ZERO_AUTH_ISSUER": _other(_AUTH),
    "ZERO_AUTH_AUDIENCE": _other(_AUTH),
    "ZERO_AUTH_REVALIDATE_INTERVAL_SECONDS": _other(_AUTH),
    "ZERO_AUTH_RETRANSFORM_INTERVAL_SECONDS": _other(_AUTH),
    "ZERO_PORT": _implemented(),
    "ZERO_KEEPALIVE_TIMEOUT_MS": _implemented(),
    "ZERO_CHANGE_STREAMER_URI": _other("view-syncer: where the change-streamer is"),
    "ZERO_CHANGE_STREAMER_MODE": _other("view-syncer: where the change-streamer is"),
    "ZERO_CHANGE_STREAMER_PORT": _implemented(),
    "ZERO_CHANGE_STREAMER_ADDRESS": _implemented(),
    # With wss, "wss://<address>" is written for view-syncers in discover mode, as zero does.
    "ZERO_CHANGE_STREAMER_PROTOCOL": _implemented(),
    "ZERO_CHANGE_STREAMER_DISCOVERY_INTERFACE_PREFERENCES": _ignored(
        "the discovery address is ZERO_CHANGE_STREAMER_ADDRESS, else the host name's IP"
    ),
    "ZERO_CHANGE_STREAMER_STARTUP_DELAY_MS": _implemented(),
    # × the memory limit, unless ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_BYTES is set.
    "ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_HEAP_PROPORTION": _implemented(),
    # A negative value turns early release off, as in 1.9; a positive one is ignored
    # (the wait is ZERO_CHANGE_STREAMER_FLOW_CONTROL_CONSENSUS_TIMEOUT_PROPORTION's).
    "ZERO_CHANGE_STREAMER_FLOW_CONTROL_CONSENSUS_PADDING_SECONDS": _implemented(),
    "ZERO_TASK_ID": _implemented(),
    "ZERO_PER_USER_MUTATION_LIMIT_MAX": _other("view-syncer: mutations"),
    "ZERO_PER_USER_MUTATION_LIMIT_WINDOW_MS": _other("view-syncer: mutations"),
    "ZERO_NUM_SYNC_WORKERS": _other("view-syncer: sync workers"),
    "ZERO_AUTO_RESET": _implemented(),
    "ZERO_REPLICATION_LAG_REPORT_INTERVAL_MS": _implemented(),
    "ZERO_ADMIN_PASSWORD": _implemented(),
    "ZERO_WEBSOCKET_COMPRESSION": _other(_SOCKETS),
    "ZERO_WEBSOCKET_COMPRESSION_OPTIONS": _other(_SOCKETS),
    "ZERO_WEBSOCKET_MAX_PAYLOAD_BYTES": _other(_SOCKETS),
    "ZERO_LITESTREAM_EXECUTABLE": _implemented(),
    "ZERO_LITESTREAM_EXECUTABLE_V5": _implemented(),
    "ZERO_LITESTREAM_RESTORE_USING_V5": _ignored("restores always use litestream v0.5"),
    "ZERO_LITESTREAM_BACKUP_USING_V5": _implemented(),
    "ZERO_LITESTREAM_CONFIG_PATH": _implemented(),
    "ZERO_LITESTREAM_VFS_EXTENSION_PATH": _implemented(),
    "ZERO_LITESTREAM_VFS_PROBE_INTERVAL_MS": _implemented(),
    "ZERO_LITESTREAM_VFS_PROBE_TIMEOUT_MS": _implemented(),
    "ZERO_LITESTREAM_VFS_LOG_FILE": _implemented(),
    "ZERO_LITESTREAM_LOG_LEVEL": _implemented(),
    "ZERO_LITESTREAM_BACKUP_URL": _implemented(),
    "ZERO_LITESTREAM_ENDPOINT": _implemented(),
    "ZERO_LITESTREAM_REGION": _implemented(),
    "ZERO_LITESTREAM_PORT": _implemented(),
    "ZERO_LITESTREAM_CHECKPOINT_THRESHOLD_MB": _implemented(),
    "ZERO_LITESTREAM_MIN_CHECKPOINT_PAGE_COUNT": _implemented(),
    "ZERO_LITESTREAM_MAX_CHECKPOINT_PAGE_COUNT": _implemented(),
    "ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES": _implemented(),
    "ZERO_LITESTREAM_SNAPSHOT_BACKUP_INTERVAL_HOURS": _implemented(),
    "ZERO_LITESTREAM_RESTORE_PARALLELISM": _implemented(),
    "ZERO_LITESTREAM_MULTIPART_CONCURRENCY": _implemented(),
    "ZERO_LITESTREAM_MULTIPART_SIZE": _implemented(),
    "ZERO_STORAGE_DBTMP_DIR": _other(_IVM),
    "ZERO_INITIAL_SYNC_TABLE_COPY_WORKERS": _implemented(),
    "ZERO_INITIAL_SYNC_PROFILE_COPY": _ignored("no CPU profile of the copy; use /profile"),
    "ZERO_INITIAL_SYNC_TEXT_COPY": _ignored("initial sync always copies in text format"),
    # zero runs shadow syncs beside its change-streamer (server/main.js).
    "ZERO_SHADOW_SYNC_ENABLED": _ignored(_NO_SHADOW_SYNC),
    "ZERO_SHADOW_SYNC_INTERVAL_HOURS": _ignored(_NO_SHADOW_SYNC),
    "ZERO_SHADOW_SYNC_SAMPLE_RATE": _ignored(_NO_SHADOW_SYNC),
    "ZERO_SHADOW_SYNC_MAX_ROWS_PER_TABLE": _ignored(_NO_SHADOW_SYNC),
    "ZERO_TARGET_CLIENT_ROW_COUNT": _other("view-syncer: deprecated"),
    "ZERO_LAZY_STARTUP": _other("single-node zero-cache"),
    # Every zero-cache role logs it at start-up.
    "ZERO_SERVER_VERSION": _ignored("it only labels zero-cache's start-up log line"),
    "ZERO_ENABLE_TELEMETRY": _other("view-syncer: telemetry"),
    # zero's change-streamer publishes replication status events with these.
    "ZERO_CLOUD_EVENT_SINK_ENV": _ignored(_NO_EVENTS),
    "ZERO_CLOUD_EVENT_EXTENSION_OVERRIDES_ENV": _ignored(_NO_EVENTS),
}

# ZERO_* names that are no zero-cache 1.9.0 option but that zero reads straight from
# the environment, or that its tools take: a shared environment may well hold them.
OUTSIDE_OPTIONS: Final[Mapping[str, ZeroSetting]] = {
    "ZERO_SCHEMA_PATH": _other("zero-cache-dev, zero-deploy-permissions, analyze-query"),
    "ZERO_IN_CONTAINER": _other("view-syncer: telemetry"),
    "ZERO_ON_CLOUD_ZERO": _other("view-syncer: telemetry"),
    "ZERO_ENABLE_STARTUP_MESSAGE": _ignored("no Cloud Zero banner here"),
    "ZERO_PG_SOCKET_INACTIVITY_TIMEOUT": _ignored(
        "an option of zero's Postgres client; this service connects with psycopg"
    ),
    "ZERO_TRANSACTION_POOL_KEEPALIVE_MS": _ignored("this service has no transaction pool"),
    "ZERO_IDLE_IN_TRANSACTION_SESSION_TIMEOUT": _ignored(
        "change DB sessions use a fixed 60 s idle-in-transaction timeout"
    ),
    # zero's replicator logs every report it records with it.
    "ZERO_LOG_ALL_REPLICATION_REPORTS_AT_DEBUG": _ignored(
        "lag reports are not logged one by one; /statz and /metrics show them"
    ),
    # zero-cache sets it for litestream; so does app/backup.
    "ZERO_LITESTREAM_SNAPSHOT_RETENTION_INTERVAL_HOURS": _ignored(
        "derived from ZERO_LITESTREAM_SNAPSHOT_BACKUP_INTERVAL_HOURS + 6 h, as in zero-cache"
    ),
}

# Settings of this service with ZERO_* names that zero-cache 1.9.0 does not define:
# newer zero versions' names, or this service's own where zero has none.
OWN_EXTENSIONS: Final[Mapping[str, str]] = {
    "ZERO_CHANGE_STREAMER_HOST": "the listen address (zero listens on all interfaces)",
    "ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_BYTES": "back pressure as a byte budget "
    "(newer zero versions)",
    "ZERO_CHANGE_STREAMER_FLOW_CONTROL_CONSENSUS_TIMEOUT_PROPORTION": "flow control "
    "(newer zero versions)",
    "ZERO_CHANGE_STREAMER_FLOW_CONTROL_SLOW_SUBSCRIBER_GRACE_PERIOD_SECONDS": "flow "
    "control (newer zero versions)",
    "ZERO_OPERATOR_PASSWORD": "read-only admin endpoints (newer zero versions)",
}


def refusal(name: str, value: str | None) -> str | None:
    """Why start-up must stop for ``name=value``, or None.

    Only an UNSUPPORTED setting with a value other than zero's default stops it.
    """
    setting = CATALOG.get(name)
    if setting is None or setting.category is not Category.UNSUPPORTED:
        return None
    if not value or value.strip().lower() in setting.harmless:
        return None
    return (
        f"{name} is a zero-cache setting this service does not implement "
        f"({setting.reason}); unset it"
    )


def startup_notes(environ: Mapping[str, str | None]) -> list[str]:
    """The start-up log lines (INFO) naming the set settings this service does not use.

    Empty values count as unset, as in zero-cache.
    """
    other: list[str] = []
    ignored: list[str] = []
    for name in sorted(environ):
        setting = CATALOG.get(name) or OUTSIDE_OPTIONS.get(name)
        if setting is None or not environ[name]:
            continue
        if setting.category is Category.OTHER_ROLE:
            other.append(name)
        elif setting.category is Category.TUNING_IGNORED:
            ignored.append(f"{name} ({setting.reason})")
    notes = []
    if other:
        notes.append(
            "settings for other zero-cache roles, not used by this service: " + ", ".join(other)
        )
    if ignored:
        notes.append("settings accepted but without effect here: " + ", ".join(ignored))
    return notes
