"""Effects (§10.7, §15): inbox quarantine marker, command lineage/outcome columns, ListCommands index, request dedupe ledger.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


# Column types are spelled out here, not imported from the application, so this revision
# keeps producing the same DDL whatever later code does.
def _utc_datetime() -> sa.types.TypeEngine[Any]:
    return sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _long_text() -> sa.types.TypeEngine[Any]:
    return sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")


_INBOX_COLUMNS = ("quarantine_count", "quarantine_reason", "quarantined_at")
_COMMAND_COLUMNS = (
    "runtime_outbox_message_id",
    "flow_run_id",
    "step_execution_id",
    "submission_attempt_id",
    "deadline",
    "failure_policy",
    "provider_idempotency_key",
    "safe_error_code",
    "result_digest",
    "reconcile_attempts",
)


def upgrade() -> None:
    with op.batch_alter_table("owner_inbox") as batch:
        batch.add_column(
            sa.Column("quarantine_count", sa.Integer(), server_default=sa.text("0"), nullable=False)
        )
        batch.add_column(sa.Column("quarantine_reason", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("quarantined_at", _utc_datetime(), nullable=True))
    with op.batch_alter_table("external_commands") as batch:
        batch.add_column(
            sa.Column("runtime_outbox_message_id", sa.String(length=64), nullable=True)
        )
        batch.add_column(sa.Column("flow_run_id", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("step_execution_id", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("submission_attempt_id", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("deadline", _utc_datetime(), nullable=True))
        batch.add_column(sa.Column("failure_policy", sa.String(length=32), nullable=True))
        batch.add_column(
            sa.Column("provider_idempotency_key", sa.String(length=200), nullable=True)
        )
        batch.add_column(sa.Column("safe_error_code", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("result_digest", sa.String(length=100), nullable=True))
        batch.add_column(
            sa.Column(
                "reconcile_attempts", sa.Integer(), server_default=sa.text("0"), nullable=False
            )
        )
    op.create_index(
        "ix_external_commands_scope_created",
        "external_commands",
        [
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "created_at",
            "external_command_id",
        ],
        unique=False,
    )
    op.create_table(
        "owner_requests",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("rpc_name", sa.String(length=64), nullable=False),
        sa.Column("request_id", sa.String(length=200), nullable=False),
        sa.Column("request_digest", sa.String(length=100), nullable=False),
        sa.Column("response_payload", _long_text(), nullable=True),
        sa.Column("completed", sa.Boolean(), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "rpc_name",
            "request_id",
            name=op.f("pk_owner_requests"),
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_owner_requests_created", "owner_requests", ["org_id", "created_at"], unique=False
    )


def downgrade() -> None:
    op.drop_table("owner_requests")
    op.drop_index("ix_external_commands_scope_created", table_name="external_commands")
    with op.batch_alter_table("external_commands") as batch:
        for name in reversed(_COMMAND_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("owner_inbox") as batch:
        for name in reversed(_INBOX_COLUMNS):
            batch.drop_column(name)
