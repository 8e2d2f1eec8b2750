"""What ``serve``, ``migrate`` and ``restore`` do first: read the settings, start the log."""

from __future__ import annotations

import logging

from app.commands import CommandError
from app.config import Settings, SettingsError, check_change_db_directory, load_settings
from app.logs import configure_logging

__all__ = ["read_settings", "start_logging"]

log = logging.getLogger("changestreamer")


def read_settings(*, change_db: bool) -> Settings:
    """The settings; with ``change_db``, the change DB's directory must exist too.

    Refused with one line and exit status 2.
    """
    try:
        settings = load_settings()
        if change_db:
            check_change_db_directory(settings)
    except SettingsError as e:
        raise CommandError(str(e), 2) from None
    return settings


def start_logging(settings: Settings) -> None:
    """The log as the settings ask (``app/logs.py``), then the settings' start-up notes."""
    configure_logging(settings.log_level, settings.log_format)
    # Alembic narrates every step at INFO; migrate_change_db's one line says the outcome.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    for note in settings.startup_notes:
        log.info("%s", note)
