"""Per-key run concurrency slots (§16, issue 14 item 3: ``runtime_svc.admission.slots``).

A new table ``flow_run_slots``: a run of a Flow whose runtime policy sets
``admission.flows.<api>.max_concurrent_runs = N`` holds one slot ``0 .. N-1`` of its key
while it is not terminal. The primary key ``(org_id, slot_key, slot_no)`` bounds the
holders by N; the unique ``(org_id, slot_key, flow_run_id)`` keeps a run to one slot.
Additive only: no existing table changes.

Revision ID: 0013_admission
Revises: 0011_operator_controls
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0013_admission"
down_revision = "0012_identity"
branch_labels = None
depends_on = None


def _utc_datetime() -> sa.types.TypeEngine[Any]:
    return sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "flow_run_slots",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("slot_key", sa.String(length=200), nullable=False),
        sa.Column("slot_no", sa.Integer(), nullable=False),
        sa.Column("flow_run_id", sa.String(length=64), nullable=False),
        sa.Column("acquired_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint("org_id", "slot_key", "slot_no", name=op.f("pk_flow_run_slots")),
        sa.UniqueConstraint("org_id", "slot_key", "flow_run_id", name="uq_flow_run_slots_run"),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )


def downgrade() -> None:
    op.drop_table("flow_run_slots")
