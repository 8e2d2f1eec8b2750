"""Passwords for the command-line clients: from a file or the environment, never argv
(every local user's ``ps`` shows a command line)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

__all__ = [
    "REPLICATION_PASSWORD_ENV",
    "PasswordFileError",
    "read_password_file",
    "replication_password",
]

# What serve checks on the replication endpoints; tail and replicate send it.
REPLICATION_PASSWORD_ENV: Final = "CHANGESTREAMER_REPLICATION_PASSWORD"


class PasswordFileError(ValueError):
    """``--password-file`` could not be read (one line, without the file's content)."""


def read_password_file(path: str | os.PathLike[str]) -> str:
    """The password in ``path``: its text without the trailing newline."""
    try:
        return Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise PasswordFileError(f"cannot read --password-file: {e}") from e


def replication_password(
    password_file: str | os.PathLike[str] | None, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The replication password: ``--password-file``, else the environment's."""
    if password_file is not None:
        return read_password_file(password_file)
    return environ.get(REPLICATION_PASSWORD_ENV) or None
