"""Effect handoff (§10.7, §10.8): the canonical Runtime outbox and Flow effect links; run-history index on flow_runs.

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
        "runtime_outbox",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("runtime_outbox_message_id", sa.String(length=64), nullable=False),
        sa.Column("message_family", sa.String(length=64), nullable=False),
        sa.Column("effect_handoff_key", sa.String(length=200), nullable=False),
        sa.Column("effect_owner_kind", sa.String(length=64), nullable=False),
        sa.Column("payload_schema_version", sa.Integer(), nullable=False),
        sa.Column("payload_digest", sa.String(length=100), nullable=False),
        sa.Column("payload", _json_text(262144), nullable=False),
        sa.Column("flow_run_id", sa.String(length=64), nullable=True),
        sa.Column("step_execution_id", sa.String(length=64), nullable=True),
        sa.Column("submission_attempt_id", sa.String(length=64), nullable=True),
        sa.Column("deadline", _utc_datetime(), nullable=True),
        sa.Column("failure_policy", sa.String(length=32), nullable=True),
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
        sa.PrimaryKeyConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "runtime_outbox_message_id",
            name=op.f("pk_runtime_outbox"),
        ),
        sa.UniqueConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "message_family",
            "effect_handoff_key",
            name="uq_runtime_outbox_key",
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_runtime_outbox_due",
        "runtime_outbox",
        ["org_id", "delivery_state", "next_attempt_at"],
        unique=False,
    )
    op.create_index(
        "ix_flow_runs_history",
        "flow_runs",
        ["org_id", "flow_version_id", "created_at", "flow_run_id"],
        unique=False,
    )
    op.create_table(
        "flow_effect_links",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("effect_link_id", sa.String(length=64), nullable=False),
        sa.Column("flow_run_id", sa.String(length=64), nullable=False),
        sa.Column("step_execution_id", sa.String(length=64), nullable=False),
        sa.Column("effect_owner_kind", sa.String(length=64), nullable=False),
        sa.Column("runtime_outbox_message_id", sa.String(length=64), nullable=False),
        sa.Column("effect_handoff_key", sa.String(length=200), nullable=False),
        sa.Column("submission_attempt_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id", "flow_run_id"],
            ["flow_runs.org_id", "flow_runs.flow_run_id"],
            name=op.f("fk_flow_effect_links_flow_runs"),
        ),
        sa.PrimaryKeyConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "effect_link_id",
            name=op.f("pk_flow_effect_links"),
        ),
        sa.UniqueConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "effect_handoff_key",
            name="uq_flow_effect_links_handoff",
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_flow_effect_links_run", "flow_effect_links", ["org_id", "flow_run_id"], unique=False
    )


def downgrade() -> None:
    # Dropping a table drops its indexes (and MySQL refuses to drop an index a foreign
    # key still needs), so only indexes on surviving tables are dropped explicitly.
    op.drop_table("flow_effect_links")
    op.drop_index("ix_flow_runs_history", table_name="flow_runs")
    op.drop_table("runtime_outbox")
