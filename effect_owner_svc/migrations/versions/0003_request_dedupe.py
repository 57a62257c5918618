"""Request deduplication of the owner's mutating RPCs (issue 10, item 2).

``owner_requests`` is the generic ledger of ``services.request_dedupe``: (complete trusted
scope, RPC, request id) -> the request body's digest and the original response (base64;
NULL while only reserved), ``completed`` telling a reserved or provisional row from a
final one.

Revision ID: 0003_request_dedupe
Revises: 0002
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0003_request_dedupe"
down_revision = "0002"
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
        "owner_requests",
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
        sa.PrimaryKeyConstraint(*_SCOPE, "rpc_name", "request_id", name=op.f("pk_owner_requests")),
        **_TABLE_OPTIONS,
    )
    op.create_index(
        "ix_owner_requests_created", "owner_requests", ["org_id", "created_at"], unique=False
    )


def downgrade() -> None:
    op.drop_table("owner_requests")
