"""Which shard of which app a change DB holds (stdlib only: the replica follower's
child process names its tables from it without loading the engines)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from app.storage.errors import ChangeDbConfigError

__all__ = ["APPLICATION_NAME", "Shard"]

# Every change-DB session on Postgres carries it, like the reference's, so
# operators (and the reset path) can find them.
APPLICATION_NAME: Final = "zero-change-streamer"

_APP_ID = re.compile(r"^[a-z0-9_]+$")


@dataclass(frozen=True, slots=True)
class Shard:
    """Identifies one shard of one app; the change DB holds one log per shard."""

    app_id: str = "zero"
    shard_num: int = 0

    def __post_init__(self) -> None:
        if not _APP_ID.match(self.app_id):
            raise ChangeDbConfigError(
                f"app ID {self.app_id!r} is invalid: use only lower-case letters, digits and '_'"
            )
        if self.shard_num < 0:
            raise ChangeDbConfigError(f"shard number {self.shard_num} is negative")

    @property
    def name(self) -> str:
        return f"{self.app_id}_{self.shard_num}"

    @property
    def cdc_schema(self) -> str:
        """The Postgres schema of the change log, as the reference names it."""
        return f"{self.name}/cdc"
