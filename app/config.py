"""Settings: one object, read from the environment and ``.env`` with Zero's names.

Every field has an explicit ``ZERO_*`` (or, for this service's own settings,
``CHANGESTREAMER_*``) alias. ``.env.example`` lists them all with their defaults.

``load_settings`` reads the environment over ``.env`` itself rather than through
pydantic-settings, because it must see every name, not only the known ones: zero
roles share one environment, so a ``ZERO_*`` name must be one zero-cache 1.9.0
defines (:mod:`app.zero_settings` says what each means here), and a typo such as
``ZERO_UPSTREAM_BD`` stops start-up instead of silently serving the demo source.
Empty values count as unset, as in zero-cache. Every failure is one line that
names the variable, so start-up ends with a readable error.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal

from dotenv import dotenv_values
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    PrivateAttr,
    ValidationError,
    field_validator,
)
from pydantic_core import PydanticCustomError

from app import speedups as speedups_module
from app.logs import redact
from app.protocol.canonical_json import loads
from app.storage.engine import Shard, parse_change_db_url
from app.storage.errors import ChangeDbConfigError
from app.zero_settings import CATALOG, OUTSIDE_OPTIONS, OWN_EXTENSIONS, refusal, startup_notes


class SettingsError(Exception):
    """A setting is invalid; the message is one line naming it."""


# The error type of a validator whose message is already the whole line.
_WHOLE_LINE: Final = "changestreamer_setting"
# The shortest default for CHANGESTREAMER_BACKUP_WEDGED_AFTER_SECONDS.
MIN_DEFAULT_WEDGED_AFTER_S: Final = 900.0


def _env(name: str) -> AliasChoices:
    return AliasChoices(name)


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=False, validate_default=True)

    app_id: str = Field("zero", validation_alias=_env("ZERO_APP_ID"))
    shard_num: int = Field(0, ge=0, validation_alias=_env("ZERO_SHARD_NUM"))
    app_publications: list[str] = Field(
        default_factory=list, validation_alias=_env("ZERO_APP_PUBLICATIONS")
    )
    replica_file: Path = Field(Path("zero.db"), validation_alias=_env("ZERO_REPLICA_FILE"))
    change_db: str | None = Field(None, validation_alias=_env("ZERO_CHANGE_DB"))
    port: int = Field(4848, ge=1, le=65535, validation_alias=_env("ZERO_PORT"))
    change_streamer_port: int | None = Field(
        None, ge=1, le=65535, validation_alias=_env("ZERO_CHANGE_STREAMER_PORT")
    )
    change_streamer_host: str = Field(
        "127.0.0.1", validation_alias=_env("ZERO_CHANGE_STREAMER_HOST")
    )
    change_streamer_address: str | None = Field(
        None, validation_alias=_env("ZERO_CHANGE_STREAMER_ADDRESS")
    )
    log_level: str = Field("info", validation_alias=_env("ZERO_LOG_LEVEL"))
    # Our lines (app/logs.py) and litestream's (app/backup).
    log_format: Literal["text", "json"] = Field("text", validation_alias=_env("ZERO_LOG_FORMAT"))
    upstream_db: str | None = Field(None, validation_alias=_env("ZERO_UPSTREAM_DB"))
    # pg: ZERO_UPSTREAM_DB is a Postgres URL; custom: a custom change source's ws:// URL
    # (app/runtime/custom.py). Without ZERO_UPSTREAM_DB, serve runs the demo source.
    upstream_type: Literal["pg", "custom"] = Field(
        "pg", validation_alias=_env("ZERO_UPSTREAM_TYPE")
    )
    task_id: str | None = Field(None, validation_alias=_env("ZERO_TASK_ID"))
    startup_delay_ms: int = Field(
        15_000, ge=0, validation_alias=_env("ZERO_CHANGE_STREAMER_STARTUP_DELAY_MS")
    )
    auto_reset: bool = Field(True, validation_alias=_env("ZERO_AUTO_RESET"))
    # Unset: ..._HEAP_PROPORTION of the memory limit if that is set, else 64 MiB
    # (app/runtime/options.py; an explicit byte budget always wins).
    back_pressure_bytes: int | None = Field(
        None,
        gt=0,
        validation_alias=_env("ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_BYTES"),
    )
    # zero: a fraction of V8's heap limit. Python has no heap limit, so here it is a
    # fraction of the process's memory limit (its cgroup's, else the machine's RAM).
    back_pressure_heap_proportion: float | None = Field(
        None,
        validation_alias=_env("ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_HEAP_PROPORTION"),
    )
    consensus_timeout_proportion: float = Field(
        2.0,
        validation_alias=_env("ZERO_CHANGE_STREAMER_FLOW_CONTROL_CONSENSUS_TIMEOUT_PROPORTION"),
    )
    # zero 1.9's fixed padding: only its sign counts here (negative: no early release,
    # as in 1.9); the wait itself is the proportion's (decision 31).
    consensus_padding_s: FiniteFloat | None = Field(
        None,
        validation_alias=_env("ZERO_CHANGE_STREAMER_FLOW_CONTROL_CONSENSUS_PADDING_SECONDS"),
    )
    slow_subscriber_grace_s: float = Field(
        30.0,
        validation_alias=_env(
            "ZERO_CHANGE_STREAMER_FLOW_CONTROL_SLOW_SUBSCRIBER_GRACE_PERIOD_SECONDS"
        ),
    )
    # Replication lag reports through the upstream's WAL (zero's default); <= 0: none.
    replication_lag_report_interval_ms: int = Field(
        30_000, validation_alias=_env("ZERO_REPLICATION_LAG_REPORT_INTERVAL_MS")
    )
    # Upstream connections besides the replication stream: initial sync's parallel
    # copy workers are capped to it (the only place this role opens many at once).
    upstream_max_conns: int = Field(20, ge=1, validation_alias=_env("ZERO_UPSTREAM_MAX_CONNS"))
    initial_sync_table_copy_workers: int = Field(
        5, ge=1, validation_alias=_env("ZERO_INITIAL_SYNC_TABLE_COPY_WORKERS")
    )
    # Tear the replication stream down after this long without an inbound message
    # (default: 2 x the server's wal_sender_timeout).
    upstream_pg_stream_inbound_timeout_ms: int | None = Field(
        None, gt=0, validation_alias=_env("ZERO_UPSTREAM_PG_STREAM_INBOUND_TIMEOUT_MS")
    )
    # Slots created with FAILOVER (Postgres 17+; refused on older servers at start-up).
    upstream_pg_replication_slot_failover: bool = Field(
        False, validation_alias=_env("ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER")
    )
    # A Postgres change DB: pool size, and statement_timeout of its sessions (also the
    # storer's wedge watchdog, zero's meaning of the setting).
    change_max_conns: int = Field(5, ge=1, validation_alias=_env("ZERO_CHANGE_MAX_CONNS"))
    change_statement_timeout_ms: int = Field(
        20_000, gt=0, validation_alias=_env("ZERO_CHANGE_STATEMENT_TIMEOUT_MS")
    )
    # Change-log rows per group commit: a group stops taking whole transactions once it
    # holds this many (the storer's group_max_rows; zero: rows per multi-row INSERT).
    change_log_batch_size: int = Field(
        10_000, ge=1, validation_alias=_env("ZERO_CHANGE_LOG_BATCH_SIZE")
    )
    # wss: the discovery address written to ownerAddress is "wss://<address>".
    change_streamer_protocol: Literal["ws", "wss"] = Field(
        "ws", validation_alias=_env("ZERO_CHANGE_STREAMER_PROTOCOL")
    )
    # Per subscriber connection: bytes sent and not yet acknowledged before it is
    # dropped (flow control normally keeps this far lower: it bounds a stuck one).
    subscriber_max_unacked_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        validation_alias=_env("CHANGESTREAMER_SUBSCRIBER_MAX_UNACKED_BYTES"),
    )
    # ... and bytes written but not yet taken by the client's socket before sending
    # waits (the socket's write-buffer high-water mark; asyncio's default).
    subscriber_max_queued_bytes: int = Field(
        64 * 1024,
        gt=0,
        validation_alias=_env("CHANGESTREAMER_SUBSCRIBER_MAX_QUEUED_BYTES"),
    )
    # At most this many subscribers at once (more are refused with a 1002 close that
    # says so; clients retry).
    max_subscribers: int = Field(
        1000, gt=0, validation_alias=_env("CHANGESTREAMER_MAX_SUBSCRIBERS")
    )
    # Replication sockets one client address may hold at once (more get 503): one
    # address cannot take the subscriber limit from everyone else. View-syncers
    # behind one address (a NAT, a proxy) need one or two each.
    max_sockets_per_address: int = Field(
        100, gt=0, validation_alias=_env("CHANGESTREAMER_MAX_SOCKETS_PER_ADDRESS")
    )
    # A subscriber connected for longer than this that is further behind the change
    # log's head than this, or than the bytes below, no longer holds the purge floor:
    # it is dropped (it may resume, or learn that its watermark is too old).
    subscriber_max_lag_s: FiniteFloat = Field(
        3600.0, gt=0, validation_alias=_env("CHANGESTREAMER_SUBSCRIBER_MAX_LAG_SECONDS")
    )
    subscriber_max_lag_bytes: int = Field(
        4 * 1024**3, gt=0, validation_alias=_env("CHANGESTREAMER_SUBSCRIBER_MAX_LAG_BYTES")
    )
    # Connections whose request has not fully arrived: at most this many at once
    # (more get 503), each for at most this long (then 408).
    max_pending_handshakes: int = Field(
        256, gt=0, validation_alias=_env("CHANGESTREAMER_MAX_PENDING_HANDSHAKES")
    )
    handshake_timeout_s: FiniteFloat = Field(
        10, gt=0, validation_alias=_env("CHANGESTREAMER_HANDSHAKE_TIMEOUT_SECONDS")
    )
    # On SIGTERM, requests still running after this long are cancelled (uvicorn's
    # graceful shutdown waits for them without a bound otherwise: a 60 s /profz
    # held the exit for a minute). Streams end at once either way; then the
    # storer drains.
    shutdown_timeout_s: int = Field(  # whole seconds: what uvicorn takes
        10, gt=0, validation_alias=_env("CHANGESTREAMER_SHUTDOWN_TIMEOUT_SECONDS")
    )
    # Websocket handshakes (new streams) proceed at most this many a second, bursts of
    # one second's worth; the rest wait their turn (at most the pending bound of them,
    # each at most the handshake timeout, else 503), so churn cannot starve the
    # subscribers already streaming (app/server/admission.py).
    max_handshakes_per_s: FiniteFloat = Field(
        50, gt=0, validation_alias=_env("CHANGESTREAMER_MAX_HANDSHAKES_PER_SECOND")
    )
    # Reverse proxies whose X-Forwarded-For and X-Forwarded-Proto are believed
    # (uvicorn's forwarded_allow_ips; "*" for any). Empty, the default: no header is
    # believed, and the admin back-off and the logs see the TCP peer. (uvicorn alone
    # believes 127.0.0.1's headers, so any local client could choose the address its
    # wrong passwords count against, or lock out another one.)
    trusted_proxies: list[str] = Field(
        default_factory=list, validation_alias=_env("CHANGESTREAMER_TRUSTED_PROXIES")
    )
    # Origins whose websocket upgrades the replication endpoints accept (comma list;
    # browsers send an Origin, view-syncers none). Empty: every Origin gets 403.
    allowed_origins: list[str] = Field(
        default_factory=list, validation_alias=_env("CHANGESTREAMER_ALLOWED_ORIGINS")
    )
    # Host names the admin pages answer while they are open without a password
    # (development mode): besides localhost, the loopback addresses and this node's
    # own; a DNS-rebinding page sends its own name.
    allowed_hosts: list[str] = Field(
        default_factory=list, validation_alias=_env("CHANGESTREAMER_ALLOWED_HOSTS")
    )
    # If set, replication upgrades need it as the HTTP Basic password (any user
    # name; zero-cache sends it from ZERO_CHANGE_STREAMER_URI's user info), else 401.
    replication_password: str | None = Field(
        None, validation_alias=_env("CHANGESTREAMER_REPLICATION_PASSWORD")
    )
    # Snapshot reservations open at once, all tasks together (more are refused).
    max_reservations: int = Field(
        64, gt=0, validation_alias=_env("CHANGESTREAMER_MAX_RESERVATIONS")
    )
    admin_password: str | None = Field(None, validation_alias=_env("ZERO_ADMIN_PASSWORD"))
    operator_password: str | None = Field(None, validation_alias=_env("ZERO_OPERATOR_PASSWORD"))
    node_env: str | None = Field(None, validation_alias=_env("NODE_ENV"))
    keepalive_timeout_ms: int | None = Field(
        None, ge=0, validation_alias=_env("ZERO_KEEPALIVE_TIMEOUT_MS")
    )

    # Backups (litestream), with zero-cache's names and defaults unless noted.
    litestream_executable: str | None = Field(
        None, validation_alias=_env("ZERO_LITESTREAM_EXECUTABLE")
    )
    litestream_executable_v5: str | None = Field(
        None, validation_alias=_env("ZERO_LITESTREAM_EXECUTABLE_V5")
    )
    litestream_backup_using_v5: bool = Field(
        False, validation_alias=_env("ZERO_LITESTREAM_BACKUP_USING_V5")
    )
    # zero's defaults are paths inside its own package and image; here unset means
    # the built-in template and no VFS extension.
    litestream_config_path: str | None = Field(
        None, validation_alias=_env("ZERO_LITESTREAM_CONFIG_PATH")
    )
    litestream_vfs_extension_path: str | None = Field(
        None, validation_alias=_env("ZERO_LITESTREAM_VFS_EXTENSION_PATH")
    )
    # zero's default, 30000, paces its on-demand probes; ours polls while the backup
    # is behind the replica, so it is shorter.
    litestream_vfs_probe_interval_ms: int = Field(
        1000, gt=0, validation_alias=_env("ZERO_LITESTREAM_VFS_PROBE_INTERVAL_MS")
    )
    litestream_vfs_probe_timeout_ms: int = Field(
        30_000, gt=0, validation_alias=_env("ZERO_LITESTREAM_VFS_PROBE_TIMEOUT_MS")
    )
    litestream_vfs_log_file: str | None = Field(
        None, validation_alias=_env("ZERO_LITESTREAM_VFS_LOG_FILE")
    )
    litestream_log_level: Literal["debug", "info", "warn", "error"] = Field(
        "warn", validation_alias=_env("ZERO_LITESTREAM_LOG_LEVEL")
    )
    litestream_backup_url: str | None = Field(
        None, validation_alias=_env("ZERO_LITESTREAM_BACKUP_URL")
    )
    litestream_endpoint: str | None = Field(None, validation_alias=_env("ZERO_LITESTREAM_ENDPOINT"))
    litestream_region: str | None = Field(None, validation_alias=_env("ZERO_LITESTREAM_REGION"))
    litestream_port: int | None = Field(
        None, ge=1, le=65535, validation_alias=_env("ZERO_LITESTREAM_PORT")
    )
    litestream_checkpoint_threshold_mb: FiniteFloat = Field(
        40, gt=0, validation_alias=_env("ZERO_LITESTREAM_CHECKPOINT_THRESHOLD_MB")
    )
    litestream_min_checkpoint_page_count: int | None = Field(
        None, ge=0, validation_alias=_env("ZERO_LITESTREAM_MIN_CHECKPOINT_PAGE_COUNT")
    )
    litestream_max_checkpoint_page_count: int | None = Field(
        None, ge=0, validation_alias=_env("ZERO_LITESTREAM_MAX_CHECKPOINT_PAGE_COUNT")
    )
    litestream_incremental_backup_interval_minutes: FiniteFloat = Field(
        15, gt=0, validation_alias=_env("ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES")
    )
    litestream_snapshot_backup_interval_hours: FiniteFloat = Field(
        12, gt=0, validation_alias=_env("ZERO_LITESTREAM_SNAPSHOT_BACKUP_INTERVAL_HOURS")
    )
    litestream_restore_parallelism: int = Field(
        48, gt=0, validation_alias=_env("ZERO_LITESTREAM_RESTORE_PARALLELISM")
    )
    litestream_multipart_concurrency: int = Field(
        48, gt=0, validation_alias=_env("ZERO_LITESTREAM_MULTIPART_CONCURRENCY")
    )
    litestream_multipart_size: int = Field(
        16 * 1024 * 1024, gt=0, validation_alias=_env("ZERO_LITESTREAM_MULTIPART_SIZE")
    )
    # No backup progress for this long while the replica moved on: the backup is wedged.
    # Unset: backup_wedged_after_seconds (it must outlast the backup interval).
    backup_wedged_after_s: FiniteFloat | None = Field(
        None, gt=0, validation_alias=_env("CHANGESTREAMER_BACKUP_WEDGED_AFTER_SECONDS")
    )
    # A snapshot reservation open longer than this is ended (it holds back purging).
    reservation_max_s: FiniteFloat = Field(
        14_400, gt=0, validation_alias=_env("CHANGESTREAMER_RESERVATION_MAX_SECONDS")
    )
    # Keep at least this much recent change log whatever the backups say (0: off): a
    # subscriber that is down a few minutes, or starts from a copy of the replica file
    # taken a few minutes ago, can still catch up.
    change_log_retention_s: FiniteFloat = Field(
        300, ge=0, validation_alias=_env("CHANGESTREAMER_CHANGE_LOG_RETENTION_SECONDS")
    )
    # How long a backed-up watermark waits before the change log is purged to it: time
    # for subscribers that just lost their connection to come back and show their
    # position (zero: 30 s, 3 × its clients' longest retry delay). Grown at run time
    # to the longest snapshot reservation seen.
    purge_delay_s: FiniteFloat = Field(
        30, ge=0, validation_alias=_env("CHANGESTREAMER_PURGE_DELAY_SECONDS")
    )
    # Without a backup URL: how often the local replica's watermark is offered for purging.
    replica_poll_interval_s: FiniteFloat = Field(
        10, gt=0, validation_alias=_env("CHANGESTREAMER_REPLICA_POLL_INTERVAL_SECONDS")
    )

    # With a Postgres upstream: keep ZERO_REPLICA_FILE current with an in-process backup
    # replicator (the file backups copy, and `changestreamer replicate` starts from).
    # zero-cache does this only when litestream backups are configured; off, the file
    # stays the initial snapshot and the service does about half the work per change.
    follow_replica: bool = Field(True, validation_alias=_env("CHANGESTREAMER_FOLLOW_REPLICA"))
    # Where SQLite group commits run: "process" (a writer process of their own, off
    # the event loop's GIL) or "thread" (aiosqlite's thread, in the service).
    sqlite_writer: Literal["process", "thread"] = Field(
        "process", validation_alias=_env("CHANGESTREAMER_SQLITE_WRITER")
    )
    demo_rate_per_s: float = Field(
        10.0, gt=0, validation_alias=_env("CHANGESTREAMER_DEMO_TRANSACTIONS_PER_SECOND")
    )
    # The C helpers (app/speedups.py): 1 uses those built, 0 their pure-Python twins.
    # app/speedups.py reads it from the process environment as the program starts;
    # here it is only checked (and a .env line that would change it is refused).
    speedups: bool = Field(True, validation_alias=_env(speedups_module.ENV))

    _startup_notes: tuple[str, ...] = PrivateAttr(default=())

    @property
    def backup_interval_s(self) -> float:
        """How often litestream uploads (ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES)."""
        return 60 * self.litestream_incremental_backup_interval_minutes

    @property
    def backup_wedged_after_seconds(self) -> float:
        """When a backup that makes no progress is wedged: as set, or twice the
        backup interval (litestream uploads once per interval, so the backup moves
        only that often), and never under 15 minutes."""
        if self.backup_wedged_after_s is not None:
            return self.backup_wedged_after_s
        return max(MIN_DEFAULT_WEDGED_AFTER_S, 2 * self.backup_interval_s)

    @field_validator(
        "app_publications", "trusted_proxies", "allowed_origins", "allowed_hosts", mode="before"
    )
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        # Zero accepts a JSON array or a comma-separated list.
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return loads(text)  # ValueError, never RecursionError, for deep nesting
            return [p.strip() for p in text.split(",") if p.strip()]
        return value

    @field_validator("allowed_origins")
    @classmethod
    def _check_origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s]+/?|null", origin):
                raise ValueError(
                    f"{origin!r} is not an origin (scheme://host[:port], as browsers send it)"
                )
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _check_hosts(cls, value: list[str]) -> list[str]:
        for host in value:
            if not re.fullmatch(r"[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:]+", host):
                raise ValueError(f"{host!r} is not a host name or address (no port, no scheme)")
        return [host.lower() for host in value]

    @field_validator("replication_password", mode="before")
    @classmethod
    def _empty_password_is_none(cls, value: Any) -> Any:
        # As with the admin password: an empty value (an unset shell variable) is none.
        return None if value == "" else value

    @field_validator("speedups", mode="before")
    @classmethod
    def _check_speedups(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return speedups_module.requested({speedups_module.ENV: value})
            except speedups_module.SpeedupsSettingError as e:
                raise PydanticCustomError(_WHOLE_LINE, str(e)) from None
        return value

    @field_validator("upstream_type", mode="before")
    @classmethod
    def _check_upstream_type(cls, value: Any) -> Any:
        if value not in ("pg", "custom"):
            raise PydanticCustomError(
                _WHOLE_LINE,
                "ZERO_UPSTREAM_TYPE must be pg or custom (got {got})",
                {"got": repr(value)},
            )
        return value

    @field_validator("back_pressure_heap_proportion", mode="before")
    @classmethod
    def _check_heap_proportion(cls, value: Any) -> Any:
        if value is None:
            return None
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not (math.isfinite(number) and 0 < number <= 1):
            raise PydanticCustomError(
                _WHOLE_LINE,
                "ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_HEAP_PROPORTION must be a fraction "
                "above 0 and at most 1 (got {got})",
                {"got": repr(value)},
            )
        return number

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str) -> str:
        level = value.lower()
        if level == "warn":
            level = "warning"
        if level not in ("debug", "info", "warning", "error"):
            raise ValueError("must be one of debug, info, warn, error")
        return level

    @field_validator("litestream_backup_url")
    @classmethod
    def _check_backup_url(cls, value: str | None) -> str | None:
        if not value:
            return None
        if not value.startswith(("file://", "s3://")):
            raise PydanticCustomError(
                _WHOLE_LINE,
                "ZERO_LITESTREAM_BACKUP_URL must be a file:// or s3:// URL (got {got})",
                {"got": repr(redact(value))},
            )
        return value

    @property
    def shard(self) -> Shard:
        return Shard(self.app_id, self.shard_num)

    @property
    def listen_port(self) -> int:
        """The change-streamer's port: ``ZERO_CHANGE_STREAMER_PORT``, else ``ZERO_PORT + 1``."""
        return self.change_streamer_port or self.port + 1

    @property
    def litestream_port_resolved(self) -> int:
        """litestream's metrics port: ``ZERO_LITESTREAM_PORT``, else ``ZERO_PORT + 2``."""
        return self.litestream_port or self.port + 2

    @property
    def development(self) -> bool:
        """``NODE_ENV=development``, as in Zero: relaxes the admin password rule."""
        return self.node_env == "development"

    @property
    def demo_state_file(self) -> Path:
        """Where the demo source keeps its watermark counter (beside the change DB)."""
        return self.replica_file.with_name(f"{self.shard.name}-demo.json")

    @property
    def change_db_url(self) -> str:
        """``ZERO_CHANGE_DB``, else a SQLite file named after the shard beside the replica."""
        if self.change_db:
            return self.change_db
        return str(self.replica_file.with_name(f"{self.shard.name}-cdc.db"))

    @property
    def startup_notes(self) -> tuple[str, ...]:
        """Lines to log at INFO on start: the settings that were set but are not used here.

        Made by :func:`app.zero_settings.startup_notes` from what ``load_settings`` read
        (environment and ``.env``).
        """
        return self._startup_notes


def _names(settings_cls: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set()
    for field in settings_cls.model_fields.values():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names.update(choice for choice in alias.choices if isinstance(choice, str))
        elif isinstance(alias, str):
            names.add(alias)
    return frozenset(names)


# The environment variables Settings reads.
SETTING_NAMES: Final = _names(Settings)
# Every name accepted in the environment (the catalog's categories decide what it does).
KNOWN_NAMES: Final = frozenset(
    SETTING_NAMES | CATALOG.keys() | OUTSIDE_OPTIONS.keys() | OWN_EXTENSIONS.keys()
)
# The test suite's and scripts' own variables (CHANGESTREAMER_TEST_PG_URL, …): no settings,
# but they reach `changestreamer serve` through inherited environments.
_NOT_SETTINGS_PREFIX: Final = "CHANGESTREAMER_TEST_"


def read_environment(
    environ: Mapping[str, str] | None = None, env_file: str | Path | None = ".env"
) -> dict[str, str | None]:
    """The variables settings come from: ``env_file`` (if it exists), then ``environ``
    (default ``os.environ``) over it. A ``.env`` line without ``=`` has the value None."""
    merged: dict[str, str | None] = {}
    if env_file is not None and Path(env_file).is_file():
        merged.update(dotenv_values(env_file, encoding="utf-8"))
    merged.update(os.environ if environ is None else environ)
    return merged


def load_settings(
    *,
    environ: Mapping[str, str] | None = None,
    env_file: str | Path | None = ".env",
    **overrides: Any,
) -> Settings:
    """Reads the settings, or raises ``SettingsError`` with one line for the first problem.

    ``environ`` and ``env_file`` are where settings come from (see ``read_environment``);
    ``overrides`` (by variable name, e.g. ``ZERO_APP_ID="x"``) win over both.
    """
    env = read_environment(environ, env_file)
    _check_names(env)
    values: dict[str, Any] = {k: v for k, v in env.items() if k in SETTING_NAMES and v}
    values.update(overrides)
    try:
        settings = Settings(**values)
        _ = settings.shard  # validates the app ID
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == _WHOLE_LINE:
            raise SettingsError(first["msg"]) from None
        where = ".".join(str(p) for p in first["loc"]) or "settings"
        raise SettingsError(
            f"invalid setting {where}: {first['msg']} (got {first.get('input')!r})"
        ) from None
    except (ValueError, ChangeDbConfigError) as e:
        raise SettingsError(f"invalid setting: {e}") from None
    if environ is None and settings.speedups != speedups_module.ENABLED:
        raise SettingsError(
            f"{speedups_module.ENV} is read from the process environment as the program "
            f"starts, so a {env_file} line cannot change it: set it in the environment"
        )
    settings._startup_notes = tuple(startup_notes(env))
    return settings


def check_change_db_directory(settings: Settings) -> None:
    """Refuses a SQLite change DB whose directory does not exist.

    Nothing should create it silently: a missing directory is usually a typo or an
    unmounted volume, and a change log there would vanish with the container.
    """
    try:
        url = parse_change_db_url(settings.change_db_url)
    except ChangeDbConfigError:
        return  # opening the change DB says what is wrong with the URL
    if url.get_backend_name() != "sqlite" or not url.database:
        return
    directory = Path(url.database).parent.absolute()
    if directory.is_dir():
        return
    if settings.change_db:
        raise SettingsError(f"ZERO_CHANGE_DB: directory {directory} does not exist")
    raise SettingsError(
        f"ZERO_REPLICA_FILE: directory {directory} does not exist "
        "(the default SQLite change DB goes beside the replica)"
    )


def _check_names(env: Mapping[str, str | None]) -> None:
    for name in sorted(env):
        prefix = name.upper()
        if prefix.startswith(_NOT_SETTINGS_PREFIX):
            continue
        if prefix.startswith(("ZERO_", "CHANGESTREAMER_")) and name not in KNOWN_NAMES:
            raise SettingsError(_unknown(name))
    for name in sorted(env):
        problem = refusal(name, env[name])
        if problem is not None:
            raise SettingsError(problem)


def _unknown(name: str) -> str:
    # Compared without the prefix, which every name shares and which would make any
    # ZERO_ name "close" to many; upper-cased, so zero_port finds ZERO_PORT.
    stems = {_stem(known): known for known in sorted(KNOWN_NAMES)}
    close = difflib.get_close_matches(_stem(name.upper()), stems, n=1, cutoff=0.6)
    if close:
        return f"unknown setting {name} (did you mean {stems[close[0]]}?)"
    if name.upper().startswith("ZERO_"):
        return f"unknown setting {name}: not a zero-cache 1.9.0 setting"
    return f"unknown setting {name}: not a changestreamer setting"


def _stem(name: str) -> str:
    for prefix in ("ZERO_", "CHANGESTREAMER_"):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name
