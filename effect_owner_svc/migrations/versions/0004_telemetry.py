"""Telemetry (§19): the W3C trace context of an accepted command and of an owner-outbox
message (a completion receipt on its way to the runtime).

``external_commands.trace_context`` and ``owner_outbox.trace_context`` hold a small JSON
map (``traceparent``, ``tracestate``; at most 1 KiB) so the provider call, the receipt
and its delivery continue the Flow run's trace (``services.telemetry``). Diagnostics
only: never compared on a duplicate acceptance or enqueue, never part of a digest; NULL
for rows written before this revision or with tracing off. Additive only.

Revision ID: 0004_telemetry
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_telemetry"
down_revision = "0003"
branch_labels = None
depends_on = None

_TABLES = ("external_commands", "owner_outbox")


def upgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("trace_context", sa.Text(), nullable=True))


def downgrade() -> None:
    for table in reversed(_TABLES):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("trace_context")
