"""The change DB: tables, engines, migrations and the repositories over them.

Typical use::

    db = create_change_db(parse_change_db_url(url), Shard("zero", 0))
    await migrate(db)
    log, replication = ChangeLog(db), Replication(db)
"""

from app.storage.changelog import ChangeLog, ChangeRow, StoredRow, WriteTransaction
from app.storage.engine import (
    ChangeDb,
    ChangeDbOptions,
    Shard,
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
from app.storage.migrate import migrate
from app.storage.replication import (
    ChangeLogState,
    Replication,
    ReplicationConfig,
    ReplicationState,
    StartParameters,
    SubscriptionState,
)

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
