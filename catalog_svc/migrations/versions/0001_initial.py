"""Catalog schema: metadata views, runtime work bindings, capability catalog generations and entries.

Revision ID: 0001
Revises: (none)
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0001"
down_revision = None
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
        "metadata_views",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_metadata_view_digest", sa.String(length=100), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("view_schema_version", sa.Integer(), nullable=False),
        sa.Column("view_payload", _json_text(8388608), nullable=False),
        sa.Column("trigger_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint(
            "org_id", "runtime_metadata_view_digest", name=op.f("pk_metadata_views")
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_metadata_views_installation",
        "metadata_views",
        ["org_id", "app_installation_id", "created_at"],
        unique=False,
    )
    op.create_table(
        "runtime_work_bindings",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("catalog_revision", sa.BigInteger(), nullable=False),
        sa.Column("schema_generation", sa.BigInteger(), nullable=False),
        sa.Column("engine_generation", sa.BigInteger(), nullable=False),
        sa.Column("catalog_snapshot_digest", sa.String(length=100), nullable=False),
        sa.Column("runtime_metadata_view_digest", sa.String(length=100), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id", "runtime_metadata_view_digest"],
            ["metadata_views.org_id", "metadata_views.runtime_metadata_view_digest"],
            name=op.f("fk_runtime_work_bindings_metadata_views"),
        ),
        sa.PrimaryKeyConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            name=op.f("pk_runtime_work_bindings"),
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_runtime_work_bindings_view",
        "runtime_work_bindings",
        ["org_id", "runtime_metadata_view_digest"],
        unique=False,
    )
    op.create_table(
        "capability_catalog_generations",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("catalog_generation_id", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.Column("contract_version", sa.Integer(), nullable=False),
        sa.Column("catalog_digest", sa.String(length=100), nullable=True),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.Column("sealed_at", _utc_datetime(), nullable=True),
        sa.ForeignKeyConstraint(
            [
                "org_id",
                "app_installation_id",
                "runtime_capability_id",
                "runtime_work_binding_digest",
            ],
            [
                "runtime_work_bindings.org_id",
                "runtime_work_bindings.app_installation_id",
                "runtime_work_bindings.runtime_capability_id",
                "runtime_work_bindings.runtime_work_binding_digest",
            ],
            name=op.f("fk_capability_catalog_generations_runtime_work_bindings"),
        ),
        sa.PrimaryKeyConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "catalog_generation_id",
            name=op.f("pk_capability_catalog_generations"),
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_table(
        "capability_catalog_entries",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("catalog_generation_id", sa.String(length=64), nullable=False),
        sa.Column("action_type", sa.String(length=128), nullable=False),
        sa.Column("owner_registration_id", sa.String(length=128), nullable=False),
        sa.Column("handler_ref", sa.String(length=200), nullable=False),
        sa.Column("handler_impl_version", sa.String(length=64), nullable=False),
        sa.Column("capability_descriptor", _json_text(32768), nullable=False),
        sa.Column("capability_descriptor_digest", sa.String(length=100), nullable=False),
        sa.Column("binding_fingerprint", sa.String(length=100), nullable=False),
        sa.Column("entry_digest", sa.String(length=100), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
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
            name=op.f("fk_capability_catalog_entries_capability_catalog_generations"),
        ),
        sa.PrimaryKeyConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "catalog_generation_id",
            "action_type",
            name=op.f("pk_capability_catalog_entries"),
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )


def downgrade() -> None:
    # Dropping a table drops its indexes (and MySQL refuses to drop an index a foreign
    # key still needs), so only indexes on surviving tables are dropped explicitly.
    op.drop_table("capability_catalog_entries")
    op.drop_table("capability_catalog_generations")
    op.drop_table("runtime_work_bindings")
    op.drop_table("metadata_views")
