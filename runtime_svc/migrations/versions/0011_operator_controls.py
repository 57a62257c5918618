"""Operator pause of a Flow run (issue 14 item 5, ``FlowRunService.PauseRun``/``ResumeRun``).

``flow_runs`` gains ``operator_paused_at`` (nullable): the time an operator paused the
run; ``NULL`` when it is not paused. It is an overlay on the canonical §11.1 state, not a
state: a paused run keeps its ``runtime_state`` (a running step may still commit) but no
claim picks it up while the column is set (``runtime_svc.kernel.transitions_operator``).
It is deliberately *not* the existing ``paused_at``, which is the §18.2 projection's
"waiting since" of a ``Waiting`` run and is cleared by every wait resolution. Additive
only; existing rows are not paused.

Revision ID: 0011_operator_controls
Revises: 0009
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0011_operator_controls"
down_revision = "0009"
branch_labels = None
depends_on = None


def _utc_datetime() -> sa.types.TypeEngine[Any]:
    return sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def upgrade() -> None:
    with op.batch_alter_table("flow_runs") as batch:
        batch.add_column(sa.Column("operator_paused_at", _utc_datetime(), nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE … DROP COLUMN (SQLite >= 3.35, MariaDB, MySQL): never a batch
    # rebuild of flow_runs, which step, checkpoint and dependency rows reference.
    op.execute("ALTER TABLE flow_runs DROP COLUMN operator_paused_at")
