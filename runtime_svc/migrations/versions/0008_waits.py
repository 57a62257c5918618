"""Durable waits (§10.5, §10.6, §14): reconciliation bookkeeping and signal evidence.

``flow_dependencies`` gains ``reconciliation_attempts`` (bounded probes made, §14.4) and
``wake_signal_id`` (the signal its resolution consumed, NULL for a timer or a record
condition read from the record itself). ``flow_wake_signals`` gains ``evidence_json``
(the safe producer evidence, canonical JSON, at most 16 KiB, immutable), ``next_match_at``
(a producer-side match still owed: set at insert, cleared once the fresh match ran, so a
crash between the signal commit and the match is found by the repair sweep through
``ix_flow_wake_signals_match``) and ``consumed_at``. Additive only.

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


def downgrade() -> None:
    with op.batch_alter_table("flow_wake_signals") as batch:
        batch.drop_index("ix_flow_wake_signals_match")
        batch.drop_column("consumed_at")
        batch.drop_column("next_match_at")
        batch.drop_column("evidence_json")
    with op.batch_alter_table("flow_dependencies") as batch:
        batch.drop_column("wake_signal_id")
        batch.drop_column("reconciliation_attempts")
