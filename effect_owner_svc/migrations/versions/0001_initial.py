"""Effect-owner schema: owner inbox (accept/reject fence), external commands and remote attempts.

Revision ID: 0001
Revises: (none)
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0001"
down_revision = None
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
        "owner_inbox",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("effect_handoff_key", sa.String(length=200), nullable=False),
        sa.Column("runtime_outbox_message_id", sa.String(length=64), nullable=False),
        sa.Column("payload_digest", sa.String(length=100), nullable=False),
        sa.Column("payload_schema_version", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("external_command_id", sa.String(length=64), nullable=True),
        sa.Column("decided_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint("org_id", "effect_handoff_key", name=op.f("pk_owner_inbox")),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_table(
        "external_commands",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("external_command_id", sa.String(length=64), nullable=False),
        sa.Column("effect_handoff_key", sa.String(length=200), nullable=False),
        sa.Column("effect_owner_kind", sa.String(length=64), nullable=False),
        sa.Column("payload_schema_version", sa.Integer(), nullable=False),
        sa.Column("payload", _json_text(262144), nullable=False),
        sa.Column("payload_digest", sa.String(length=100), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.Column("outcome_version", sa.BigInteger(), nullable=False),
        sa.Column("attempt_count", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", _utc_datetime(), nullable=True),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_token", sa.String(length=128), nullable=True),
        sa.Column("lease_until", _utc_datetime(), nullable=True),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.Column("updated_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id", "effect_handoff_key"],
            ["owner_inbox.org_id", "owner_inbox.effect_handoff_key"],
            name=op.f("fk_external_commands_owner_inbox"),
        ),
        sa.PrimaryKeyConstraint("org_id", "external_command_id", name=op.f("pk_external_commands")),
        sa.UniqueConstraint("org_id", "effect_handoff_key", name="uq_external_commands_handoff"),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_external_commands_due",
        "external_commands",
        ["org_id", "state", "next_attempt_at"],
        unique=False,
    )
    op.create_index(
        "ix_external_commands_lease", "external_commands", ["org_id", "lease_until"], unique=False
    )
    op.create_table(
        "remote_attempts",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("remote_attempt_id", sa.String(length=64), nullable=False),
        sa.Column("external_command_id", sa.String(length=64), nullable=False),
        sa.Column("attempt_number", sa.Integer(), nullable=False),
        sa.Column("provider_idempotency_key", sa.String(length=200), nullable=False),
        sa.Column("outcome", sa.String(length=32), nullable=False),
        sa.Column("safe_error_code", sa.String(length=64), nullable=True),
        sa.Column("response_digest", sa.String(length=100), nullable=True),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.Column("started_at", _utc_datetime(), nullable=False),
        sa.Column("finished_at", _utc_datetime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["org_id", "external_command_id"],
            ["external_commands.org_id", "external_commands.external_command_id"],
            name=op.f("fk_remote_attempts_external_commands"),
        ),
        sa.PrimaryKeyConstraint("org_id", "remote_attempt_id", name=op.f("pk_remote_attempts")),
        sa.UniqueConstraint(
            "org_id", "external_command_id", "attempt_number", name="uq_remote_attempts_number"
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )


def downgrade() -> None:
    # Dropping a table drops its indexes (and MySQL refuses to drop an index a foreign
    # key still needs), so only indexes on surviving tables are dropped explicitly.
    op.drop_table("remote_attempts")
    op.drop_table("external_commands")
    op.drop_table("owner_inbox")
