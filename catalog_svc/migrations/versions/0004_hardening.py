"""Request deduplication keyed by the complete trusted scope (issue 10, item 2), and a
fence version on metadata-view publications (item 5).

``catalog_requests`` becomes the generic ledger of ``services.request_dedupe``: the four
work-scope columns lead the key (two installations of one org may reuse a request id),
``completed`` tells a reserved or provisional row from a final one, request ids may be 200
characters and responses up to 12 MiB. Existing rows are carried over under the org with
empty scope components; a row without a stored response becomes a reservation, so its
retry re-executes exactly as before.

``metadata_view_installations`` gains ``state_version`` (default 0): reference and binding
registrations advance it by a conditional UPDATE and a withdrawal deletes only at the
version it checked, so the two conflict on the row instead of relying on a locked read.

Revision ID: 0004_hardening
Revises: 0003
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0004_hardening"
down_revision = "0003"
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
_OLD = "catalog_requests_0003"


# Column types are spelled out here, not imported from the application, so this revision
# keeps producing the same DDL whatever later code does.
def _utc_datetime() -> sa.types.TypeEngine[Any]:
    return sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _create_ledger() -> None:
    op.create_table(
        "catalog_requests",
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
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint(
            *_SCOPE, "rpc_name", "request_id", name=op.f("pk_catalog_requests")
        ),
        **_TABLE_OPTIONS,
    )
    op.create_index(
        "ix_catalog_requests_created", "catalog_requests", ["org_id", "created_at"], unique=False
    )


def upgrade() -> None:
    op.drop_index("ix_catalog_requests_created", table_name="catalog_requests")
    op.rename_table("catalog_requests", _OLD)
    _create_ledger()
    op.execute(
        "INSERT INTO catalog_requests (org_id, app_installation_id, runtime_capability_id, "
        "runtime_work_binding_digest, rpc_name, request_id, request_digest, response_payload, "
        "completed, created_at) "
        "SELECT org_id, '', '', '', rpc_name, request_id, request_digest, response_payload, "
        "CASE WHEN response_payload IS NULL THEN 0 ELSE 1 END, created_at "
        "FROM catalog_requests_0003"
    )
    op.drop_table(_OLD)
    with op.batch_alter_table("metadata_view_installations") as batch:
        batch.add_column(
            sa.Column("state_version", sa.BigInteger(), server_default=sa.text("0"), nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("metadata_view_installations") as batch:
        batch.drop_column("state_version")
    # Dedupe rows are transient (the request-retention window): the 0003 table comes back
    # empty rather than folding scoped rows onto colliding org-only keys.
    op.drop_table("catalog_requests")
    op.create_table(
        "catalog_requests",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("rpc_name", sa.String(length=32), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("request_digest", sa.String(length=100), nullable=False),
        sa.Column(
            "response_payload",
            sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb"),
            nullable=True,
        ),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint(
            "org_id", "rpc_name", "request_id", name=op.f("pk_catalog_requests")
        ),
        **_TABLE_OPTIONS,
    )
    op.create_index(
        "ix_catalog_requests_created", "catalog_requests", ["org_id", "created_at"], unique=False
    )
