"""The change DB: tables, engines, migrations and the repositories over them.

Typical use::

    db = create_change_db(parse_change_db_url(url), Shard("zero", 0))
    await migrate(db)
    log, replication = ChangeLog(db), Replication(db)

The names below load their module on first use (PEP 562), so a child process that
imports one submodule (``shard``, ``log_reader``) does not load SQLAlchemy with the
engines.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.storage.changelog import ChangeLog, ChangeRow, WriteTransaction
    from app.storage.engine import (
        ChangeDb,
        ChangeDbOptions,
        create_change_db,
        parse_change_db_url,
    )
    from app.storage.errors import (
        ChangeDbConfigError,
        ChangeDbSetupError,
        DuplicateChangeError,
        OwnershipLostError,
        PurgeLockedError,
        StorageError,
    )
    from app.storage.log_reader import StoredRow
    from app.storage.migrate import migrate
    from app.storage.replication import (
        ChangeLogState,
        Replication,
        ReplicationConfig,
        ReplicationState,
        StartParameters,
        SubscriptionState,
    )
    from app.storage.shard import Shard

_MODULES = {
    "ChangeDb": "app.storage.engine",
    "ChangeDbConfigError": "app.storage.errors",
    "ChangeDbOptions": "app.storage.engine",
    "ChangeDbSetupError": "app.storage.errors",
    "ChangeLog": "app.storage.changelog",
    "ChangeLogState": "app.storage.replication",
    "ChangeRow": "app.storage.changelog",
    "DuplicateChangeError": "app.storage.errors",
    "OwnershipLostError": "app.storage.errors",
    "PurgeLockedError": "app.storage.errors",
    "Replication": "app.storage.replication",
    "ReplicationConfig": "app.storage.replication",
    "ReplicationState": "app.storage.replication",
    "Shard": "app.storage.shard",
    "StartParameters": "app.storage.replication",
    "StorageError": "app.storage.errors",
    "StoredRow": "app.storage.log_reader",
    "SubscriptionState": "app.storage.replication",
    "WriteTransaction": "app.storage.changelog",
    "create_change_db": "app.storage.engine",
    "migrate": "app.storage.migrate",
    "parse_change_db_url": "app.storage.engine",
}

__all__ = [
    "ChangeDb",
    "ChangeDbConfigError",
    "ChangeDbOptions",
    "ChangeDbSetupError",
    "ChangeLog",
    "ChangeLogState",
    "ChangeRow",
    "DuplicateChangeError",
    "OwnershipLostError",
    "PurgeLockedError",
    "Replication",
    "ReplicationConfig",
    "ReplicationState",
    "Shard",
    "StartParameters",
    "StorageError",
    "StoredRow",
    "SubscriptionState",
    "WriteTransaction",
    "create_change_db",
    "migrate",
    "parse_change_db_url",
]


if not TYPE_CHECKING:  # mypy sees the imports above, so a misspelt name stays an error

    def __getattr__(name: str) -> Any:
        module = _MODULES.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
