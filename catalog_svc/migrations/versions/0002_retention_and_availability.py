"""Catalog retention and availability: retention references and per-binary handler availability (§8.4).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


# Column types are spelled out here, not imported from the application, so this revision
# keeps producing the same DDL whatever later code does.
def _utc_datetime() -> sa.types.TypeEngine[Any]:
    return sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _json_text(max_bytes: int) -> sa.types.TypeEngine[Any]:
    if max_bytes <= 65_535:
        return sa.Text()
    return sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "catalog_references",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("referent_kind", sa.String(length=32), nullable=False),
        sa.Column("referent_id", sa.String(length=100), nullable=False),
        sa.Column("holder_kind", sa.String(length=32), nullable=False),
        sa.Column("holder_id", sa.String(length=128), nullable=False),
        sa.Column("expires_at", _utc_datetime(), nullable=True),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "referent_kind",
            "referent_id",
            "holder_kind",
            "holder_id",
            name=op.f("pk_catalog_references"),
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_catalog_references_expiry", "catalog_references", ["org_id", "expires_at"], unique=False
    )
    op.create_index(
        "ix_catalog_references_holder",
        "catalog_references",
        ["org_id", "holder_kind", "holder_id"],
        unique=False,
    )
    op.create_index(
        "ix_catalog_references_referent",
        "catalog_references",
        ["org_id", "referent_kind", "referent_id"],
        unique=False,
    )
    op.create_table(
        "handler_availability",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("catalog_generation_id", sa.String(length=64), nullable=False),
        sa.Column("action_type", sa.String(length=128), nullable=False),
        sa.Column("runtime_binary_id", sa.String(length=64), nullable=False),
        sa.Column("handler_ref", sa.String(length=200), nullable=False),
        sa.Column("entry_digest", sa.String(length=100), nullable=False),
        sa.Column("binding_fingerprint", sa.String(length=100), nullable=False),
        sa.Column("published_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            [
                "org_id",
                "app_installation_id",
                "runtime_capability_id",
                "runtime_work_binding_digest",
                "catalog_generation_id",
            ],
            [
                "capability_catalog_generations.org_id",
                "capability_catalog_generations.app_installation_id",
                "capability_catalog_generations.runtime_capability_id",
                "capability_catalog_generations.runtime_work_binding_digest",
                "capability_catalog_generations.catalog_generation_id",
            ],
            name=op.f("fk_handler_availability_capability_catalog_generations"),
        ),
        sa.PrimaryKeyConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "catalog_generation_id",
            "action_type",
            "runtime_binary_id",
            name=op.f("pk_handler_availability"),
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_handler_availability_binary",
        "handler_availability",
        ["org_id", "runtime_binary_id"],
        unique=False,
    )


def downgrade() -> None:
    # Dropping a table drops its indexes (and MySQL refuses to drop an index a foreign
    # key still needs), so only indexes on surviving tables are dropped explicitly.
    op.drop_table("handler_availability")
    op.drop_table("catalog_references")
