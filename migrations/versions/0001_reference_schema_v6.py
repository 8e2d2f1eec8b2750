"""The change DB at the reference's schema version 6.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from app.storage.tables import REFERENCE_SCHEMA_VERSION, JsonObject, JsonText, StringList

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _watermark() -> sa.types.TypeEngine[str]:
    return sa.Text().with_variant(sa.Text(collation="C"), "postgresql")


def upgrade() -> None:
    schema = op.get_context().config.attributes.get("schema")  # None on SQLite
    op.create_table(
        "changeLog",
        sa.Column("watermark", _watermark(), nullable=False),
        sa.Column("pos", sa.BigInteger(), nullable=False),
        sa.Column("change", JsonText(), nullable=False),
        sa.Column("precommit", _watermark(), nullable=True),
        sa.PrimaryKeyConstraint("watermark", "pos"),
        schema=schema,
        sqlite_with_rowid=False,
    )
    op.create_table(
        "replicationState",
        sa.Column("lastWatermark", _watermark(), nullable=False),
        sa.Column("owner", sa.Text(), nullable=True),
        sa.Column("ownerAddress", sa.Text(), nullable=True),
        sa.Column("lock", sa.Integer(), server_default="1", nullable=False),
        sa.CheckConstraint('"lock" = 1', name="replicationState_single_row"),
        sa.PrimaryKeyConstraint("lock"),
        schema=schema,
    )
    op.create_table(
        "replicationConfig",
        sa.Column("replicaVersion", _watermark(), nullable=False),
        sa.Column("publications", StringList(), nullable=False),
        sa.Column("resetRequired", sa.Boolean(), nullable=True),
        sa.Column("lock", sa.Integer(), server_default="1", nullable=False),
        sa.CheckConstraint('"lock" = 1', name="replicationConfig_single_row"),
        sa.PrimaryKeyConstraint("lock"),
        schema=schema,
    )
    op.create_table(
        "tableMetadata",
        sa.Column("schema", sa.Text(), nullable=False),
        sa.Column("table", sa.Text(), nullable=False),
        sa.Column("metadata", JsonObject(), nullable=False),
        sa.PrimaryKeyConstraint("schema", "table"),
        schema=schema,
    )
    op.create_table(
        "backfilling",
        sa.Column("schema", sa.Text(), nullable=False),
        sa.Column("table", sa.Text(), nullable=False),
        sa.Column("column", sa.Text(), nullable=False),
        sa.Column("backfill", JsonObject(), nullable=False),
        sa.PrimaryKeyConstraint("schema", "table", "column"),
        schema=schema,
    )
    version_history = op.create_table(
        "versionHistory",
        sa.Column("dataVersion", sa.Integer(), nullable=False),
        sa.Column("schemaVersion", sa.Integer(), nullable=False),
        sa.Column("minSafeVersion", sa.Integer(), nullable=False),
        sa.Column("lock", sa.String(1), server_default="v", nullable=False),
        sa.CheckConstraint("\"lock\" = 'v'", name="versionHistory_single_row"),
        sa.PrimaryKeyConstraint("lock"),
        schema=schema,
    )
    op.bulk_insert(
        version_history,
        [
            {
                "dataVersion": REFERENCE_SCHEMA_VERSION,
                "schemaVersion": REFERENCE_SCHEMA_VERSION,
                "minSafeVersion": 1,
                "lock": "v",
            }
        ],
    )


def downgrade() -> None:
    schema = op.get_context().config.attributes.get("schema")
    for name in (
        "versionHistory",
        "backfilling",
        "tableMetadata",
        "replicationConfig",
        "replicationState",
        "changeLog",
    ):
        op.drop_table(name, schema=schema)
