"""Retention hold on the run root (§10.1 DeleteFlowInterview step 7).

``flow_runs`` gains ``legal_hold`` (boolean, default false): while it is true, the internal
physical-retention operation (:mod:`runtime_svc.kernel.store_retention`) refuses to purge
the run and its lineage, whatever its state and age. It is a retention fact, not a
visibility field (``is_deleted`` stays the only visibility fact, §10.1/§22.2). Additive
only; existing rows get false.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("flow_runs") as batch:
        batch.add_column(
            sa.Column("legal_hold", sa.Boolean(), server_default=sa.text("0"), nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("flow_runs") as batch:
        batch.drop_column("legal_hold")
