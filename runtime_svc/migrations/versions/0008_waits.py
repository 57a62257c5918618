"""Durable waits (§10.5, §10.6, §14): reconciliation bookkeeping and signal evidence.

``flow_dependencies`` gains ``reconciliation_attempts`` (bounded probes made, §14.4) and
``wake_signal_id`` (the signal its resolution consumed, NULL for a timer or a record
condition read from the record itself). ``flow_wake_signals`` gains ``evidence_json``
(the safe producer evidence, canonical JSON, at most 16 KiB, immutable), ``next_match_at``
(a producer-side match still owed: set at insert, cleared once the fresh match ran, so a
crash between the signal commit and the match is found by the repair sweep through
``ix_flow_wake_signals_match``) and ``consumed_at``. ``flow_runs`` gains
``ix_flow_runs_state_id`` (org, state, run id): the repair sweep walks ``Waiting`` roots
in id order with a bounded keyset cursor. New table ``flow_record_watches``: the objects
a plan waits on with a record-condition wait (the record engine signals changes of those
objects only). Additive only.

Revision ID: 0008_waits
Revises: 0006
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0008_waits"
down_revision = "0006"
branch_labels = None
depends_on = None


# Column types spelled out (as in 0001), so this revision's DDL never follows later code.
def _utc_datetime() -> sa.types.TypeEngine[Any]:
    return sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "flow_record_watches",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("object_name", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("refreshed_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint(
            "org_id",
            "object_name",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            name=op.f("pk_flow_record_watches"),
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    with op.batch_alter_table("flow_dependencies") as batch:
        batch.add_column(
            sa.Column(
                "reconciliation_attempts",
                sa.Integer(),
                server_default=sa.text("0"),
                nullable=False,
            )
        )
        batch.add_column(sa.Column("wake_signal_id", sa.String(length=64), nullable=True))
    with op.batch_alter_table("flow_wake_signals") as batch:
        batch.add_column(sa.Column("evidence_json", sa.Text(), nullable=True))
        batch.add_column(sa.Column("next_match_at", _utc_datetime(), nullable=True))
        batch.add_column(sa.Column("consumed_at", _utc_datetime(), nullable=True))
        batch.create_index("ix_flow_wake_signals_match", ["org_id", "next_match_at"])
    op.create_index(
        "ix_flow_runs_state_id", "flow_runs", ["org_id", "runtime_state", "flow_run_id"]
    )


def downgrade() -> None:
    op.drop_table("flow_record_watches")
    op.drop_index("ix_flow_runs_state_id", table_name="flow_runs")
    with op.batch_alter_table("flow_wake_signals") as batch:
        batch.drop_index("ix_flow_wake_signals_match")
        batch.drop_column("consumed_at")
        batch.drop_column("next_match_at")
        batch.drop_column("evidence_json")
    with op.batch_alter_table("flow_dependencies") as batch:
        batch.drop_column("wake_signal_id")
        batch.drop_column("reconciliation_attempts")
