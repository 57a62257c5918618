"""Request deduplication keyed by the complete trusted scope (issue 10, items 2 and 6).

``runtime_requests`` is the generic ledger of ``services.request_dedupe`` for every
mutating runtime RPC: the four work-scope columns, RPC and request id lead the key, the
body digest and the original response (base64; NULL while only reserved) are the value,
``completed`` tells a reserved or provisional row from a final one.

``business_events`` loses its org-wide unique key over ``(org_id, request_rpc,
request_id)``: the columns stay as evidence of which request wrote an event, but request
identity is now scoped by the complete work scope (two installations of one org may reuse
a request id), which the ledger enforces.

Revision ID: 0007_hardening
Revises: 0008_waits (main applied the waits revision first)
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0007_hardening"
down_revision = "0008_waits"
branch_labels = None
depends_on = None

_TABLE_OPTIONS: dict[str, Any] = {
    "mysql_charset": "utf8mb4",
    "mysql_collate": "utf8mb4_bin",
    "mysql_engine": "InnoDB",
}
_SCOPE = (
    "org_id",
    "app_installation_id",
    "runtime_capability_id",
    "runtime_work_binding_digest",
)


def upgrade() -> None:
    op.create_table(
        "runtime_requests",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("rpc_name", sa.String(length=64), nullable=False),
        sa.Column("request_id", sa.String(length=200), nullable=False),
        sa.Column("request_digest", sa.String(length=100), nullable=False),
        sa.Column(
            "response_payload",
            sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb"),
            nullable=True,
        ),
        sa.Column("completed", sa.Boolean(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint(
            *_SCOPE, "rpc_name", "request_id", name=op.f("pk_runtime_requests")
        ),
        **_TABLE_OPTIONS,
    )
    op.create_index(
        "ix_runtime_requests_created", "runtime_requests", ["org_id", "created_at"], unique=False
    )
    with op.batch_alter_table("business_events") as batch:
        batch.drop_constraint("uq_business_events_request", type_="unique")


def downgrade() -> None:
    with op.batch_alter_table("business_events") as batch:
        batch.create_unique_constraint(
            "uq_business_events_request", ["org_id", "request_rpc", "request_id"]
        )
    op.drop_table("runtime_requests")
