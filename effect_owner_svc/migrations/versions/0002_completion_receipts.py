"""Completion path (§15.2): completion receipts and the owner's producer outbox.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


# Column types are spelled out here, not imported from the application, so this revision
# keeps producing the same DDL whatever later code does.
def _utc_datetime() -> sa.types.TypeEngine[Any]:
    return sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _json_text(max_bytes: int) -> sa.types.TypeEngine[Any]:
    if max_bytes <= 65_535:
        return sa.Text()
    return sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "owner_outbox",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("owner_outbox_message_id", sa.String(length=64), nullable=False),
        sa.Column("message_family", sa.String(length=64), nullable=False),
        sa.Column("message_key", sa.String(length=200), nullable=False),
        sa.Column("payload", _json_text(65536), nullable=False),
        sa.Column("payload_digest", sa.String(length=100), nullable=False),
        sa.Column("delivery_state", sa.String(length=32), nullable=False),
        sa.Column("delivery_attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", _utc_datetime(), nullable=False),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_token", sa.String(length=128), nullable=True),
        sa.Column("lease_until", _utc_datetime(), nullable=True),
        sa.Column("last_error_code", sa.String(length=32), nullable=True),
        sa.Column("delivered_at", _utc_datetime(), nullable=True),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.Column("updated_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint("org_id", "owner_outbox_message_id", name=op.f("pk_owner_outbox")),
        sa.UniqueConstraint("org_id", "message_family", "message_key", name="uq_owner_outbox_key"),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_owner_outbox_due",
        "owner_outbox",
        ["org_id", "delivery_state", "next_attempt_at"],
        unique=False,
    )
    op.create_table(
        "completion_receipts",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("external_command_id", sa.String(length=64), nullable=False),
        sa.Column("outcome_version", sa.BigInteger(), nullable=False),
        sa.Column("effect_handoff_key", sa.String(length=200), nullable=False),
        sa.Column("outcome", sa.String(length=32), nullable=False),
        sa.Column("outcome_payload", _json_text(65536), nullable=True),
        sa.Column("outcome_digest", sa.String(length=100), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id", "external_command_id"],
            ["external_commands.org_id", "external_commands.external_command_id"],
            name=op.f("fk_completion_receipts_external_commands"),
        ),
        sa.PrimaryKeyConstraint(
            "org_id", "external_command_id", "outcome_version", name=op.f("pk_completion_receipts")
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_completion_receipts_handoff",
        "completion_receipts",
        ["org_id", "effect_handoff_key"],
        unique=False,
    )


def downgrade() -> None:
    # Dropping a table drops its indexes (and MySQL refuses to drop an index a foreign
    # key still needs), so only indexes on surviving tables are dropped explicitly.
    op.drop_table("completion_receipts")
    op.drop_table("owner_outbox")
