"""Record engine: every parent ref of a record, and the request outcome marker on business events.

``records`` gains a nullable ``parent_refs`` JSON list (all parent references of the
record; the existing parent columns keep indexing the first lock-relevant one).
``business_events`` gains the caller request identity (``request_rpc``, ``request_id``,
``request_digest``) with a unique key over (org, RPC, request id): the event is the outcome
marker of an RPC-driven mutation, so a retried request is answered, not applied twice.
Additive only; existing rows keep NULLs.

Revision ID: 0005
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("records") as batch:
        batch.add_column(sa.Column("parent_refs", sa.Text(), nullable=True))
    with op.batch_alter_table("business_events") as batch:
        batch.add_column(sa.Column("request_rpc", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("request_id", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("request_digest", sa.String(length=100), nullable=True))
        batch.create_unique_constraint(
            "uq_business_events_request", ["org_id", "request_rpc", "request_id"]
        )


def downgrade() -> None:
    with op.batch_alter_table("business_events") as batch:
        batch.drop_constraint("uq_business_events_request", type_="unique")
        batch.drop_column("request_digest")
        batch.drop_column("request_id")
        batch.drop_column("request_rpc")
    with op.batch_alter_table("records") as batch:
        batch.drop_column("parent_refs")
