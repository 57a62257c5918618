"""The record a run is about, for per-record run concurrency limits (issue 14 item 3).

``flow_runs.subject_record_key`` (``<object>:<record_id>``, nullable): set by the
after-save trigger to the saved record; ``admission.records.<Object>.max_concurrent_runs``
in the runtime policy bounds the live runs per record through the same durable slots as
the per-Flow limit (``runtime_svc.admission.slots``). Additive only: runs created before
the revision have no subject and no record limit applies to them.

Revision ID: 0014_run_subject
Revises: 0013_admission
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_run_subject"
down_revision = "0013_admission"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "flow_runs", sa.Column("subject_record_key", sa.String(length=200), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("flow_runs", "subject_record_key")
