"""Settings: one object, read from the environment and ``.env`` with Zero's names.

Every field has an explicit ``ZERO_*`` alias (Zero's names are flat, so
pydantic's nested splitting cannot derive them). ``.env.example`` lists them all
with their defaults. ``load_settings`` turns any validation failure into one
line that names the variable, so start-up ends with a readable error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.storage.engine import Shard
from app.storage.errors import ChangeDbConfigError


class SettingsError(Exception):
    """A setting is invalid; the message is one line naming it."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_file=".env", env_file_encoding="utf-8", extra="ignore", populate_by_name=False
    )

    app_id: str = Field("zero", validation_alias=AliasChoices("ZERO_APP_ID"))
    shard_num: int = Field(0, ge=0, validation_alias=AliasChoices("ZERO_SHARD_NUM"))
    app_publications: Annotated[list[str], NoDecode] = Field(
        default_factory=list, validation_alias=AliasChoices("ZERO_APP_PUBLICATIONS")
    )
    replica_file: Path = Field(Path("zero.db"), validation_alias=AliasChoices("ZERO_REPLICA_FILE"))
    change_db: str | None = Field(None, validation_alias=AliasChoices("ZERO_CHANGE_DB"))
    port: int = Field(4848, ge=1, le=65535, validation_alias=AliasChoices("ZERO_PORT"))
    change_streamer_port: int | None = Field(
        None, ge=1, le=65535, validation_alias=AliasChoices("ZERO_CHANGE_STREAMER_PORT")
    )
    change_streamer_host: str = Field(
        "127.0.0.1", validation_alias=AliasChoices("ZERO_CHANGE_STREAMER_HOST")
    )
    change_streamer_address: str | None = Field(
        None, validation_alias=AliasChoices("ZERO_CHANGE_STREAMER_ADDRESS")
    )
    log_level: str = Field("info", validation_alias=AliasChoices("ZERO_LOG_LEVEL"))
    upstream_db: str | None = Field(None, validation_alias=AliasChoices("ZERO_UPSTREAM_DB"))
    task_id: str | None = Field(None, validation_alias=AliasChoices("ZERO_TASK_ID"))
    startup_delay_ms: int = Field(
        15_000, ge=0, validation_alias=AliasChoices("ZERO_CHANGE_STREAMER_STARTUP_DELAY_MS")
    )
    auto_reset: bool = Field(True, validation_alias=AliasChoices("ZERO_AUTO_RESET"))
    back_pressure_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        validation_alias=AliasChoices("ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_BYTES"),
    )
    consensus_timeout_proportion: float = Field(
        2.0,
        validation_alias=AliasChoices(
            "ZERO_CHANGE_STREAMER_FLOW_CONTROL_CONSENSUS_TIMEOUT_PROPORTION"
        ),
    )
    slow_subscriber_grace_s: float = Field(
        30.0,
        validation_alias=AliasChoices(
            "ZERO_CHANGE_STREAMER_FLOW_CONTROL_SLOW_SUBSCRIBER_GRACE_PERIOD_SECONDS"
        ),
    )
    admin_password: str | None = Field(None, validation_alias=AliasChoices("ZERO_ADMIN_PASSWORD"))
    operator_password: str | None = Field(
        None, validation_alias=AliasChoices("ZERO_OPERATOR_PASSWORD")
    )
    node_env: str | None = Field(None, validation_alias=AliasChoices("NODE_ENV"))
    keepalive_timeout_ms: int | None = Field(
        None, ge=0, validation_alias=AliasChoices("ZERO_KEEPALIVE_TIMEOUT_MS")
    )
    # With a Postgres upstream: keep ZERO_REPLICA_FILE current with an in-process backup
    # replicator (the file backups copy, and `changestreamer replicate` starts from).
    # zero-cache does this only when litestream backups are configured; off, the file
    # stays the initial snapshot and the service does about half the work per change.
    follow_replica: bool = Field(
        True, validation_alias=AliasChoices("CHANGESTREAMER_FOLLOW_REPLICA")
    )
    # Where SQLite group commits run: "process" (a writer process of their own, off
    # the event loop's GIL) or "thread" (aiosqlite's thread, in the service).
    sqlite_writer: Literal["process", "thread"] = Field(
        "process", validation_alias=AliasChoices("CHANGESTREAMER_SQLITE_WRITER")
    )
    demo_rate_per_s: float = Field(
        10.0, gt=0, validation_alias=AliasChoices("CHANGESTREAMER_DEMO_TRANSACTIONS_PER_SECOND")
    )

    @field_validator("app_publications", mode="before")
    @classmethod
    def _split_publications(cls, value: Any) -> Any:
        # Zero accepts a JSON array or a comma-separated list.
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [p.strip() for p in text.split(",") if p.strip()]
        return value

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str) -> str:
        level = value.lower()
        if level == "warn":
            level = "warning"
        if level not in ("debug", "info", "warning", "error"):
            raise ValueError("must be one of debug, info, warn, error")
        return level

    @property
    def shard(self) -> Shard:
        return Shard(self.app_id, self.shard_num)

    @property
    def listen_port(self) -> int:
        """The change-streamer's port: ``ZERO_CHANGE_STREAMER_PORT``, else ``ZERO_PORT + 1``."""
        return self.change_streamer_port or self.port + 1

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


def load_settings(**overrides: Any) -> Settings:
    """Reads the settings, or raises ``SettingsError`` with one line per the first problem."""
    try:
        settings = Settings(**overrides)
        _ = settings.shard  # validates the app ID
        return settings
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "settings"
        raise SettingsError(
            f"invalid setting {where}: {first['msg']} (got {first.get('input')!r})"
        ) from None
    except (ValueError, ChangeDbConfigError) as e:
        raise SettingsError(f"invalid setting: {e}") from None
