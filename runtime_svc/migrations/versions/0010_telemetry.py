"""Telemetry (§19): the W3C trace context of a run, of a Runtime outbox message and of a
wake signal, and the index behind the oldest-pending-dependency gauge.

``flow_runs.trace_context``, ``runtime_outbox.trace_context`` and
``flow_wake_signals.trace_context`` hold a small JSON map (``traceparent``,
``tracestate``; at most 1 KiB) that carries a run's trace across its asynchronous hops
(``services.telemetry``). Diagnostics only: never in a checkpoint, an evidence document,
a digest or a dedupe comparison; NULL for rows written before this revision or with
tracing off. ``ix_flow_dependencies_age`` (org, state, created_at) makes the oldest
pending dependency of an org one index seek. Additive only.

Revision ID: 0010_telemetry
Revises: 0007_hardening
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_telemetry"
down_revision = "0007_hardening"
branch_labels = None
depends_on = None

_TABLES = ("flow_runs", "runtime_outbox", "flow_wake_signals")


def upgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("trace_context", sa.Text(), nullable=True))
    op.create_index(
        "ix_flow_dependencies_age", "flow_dependencies", ["org_id", "state", "created_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_flow_dependencies_age", table_name="flow_dependencies")
    for table in reversed(_TABLES):
        # Plain ALTER TABLE … DROP COLUMN (SQLite >= 3.35, MariaDB, MySQL): never a batch
        # rebuild of flow_runs, which step, checkpoint and dependency rows reference.
        op.execute(f"ALTER TABLE {table} DROP COLUMN trace_context")
