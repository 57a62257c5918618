"""Catalog API: rejected generations, complete entry payloads, per-installation metadata
views, runtime release publications and request deduplication (§8.2-§8.4).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0003"
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


# Column types are spelled out here, not imported from the application, so this revision
# keeps producing the same DDL whatever later code does.
def _utc_datetime() -> sa.types.TypeEngine[Any]:
    return sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _json_text(max_bytes: int) -> sa.types.TypeEngine[Any]:
    if max_bytes <= 65_535:
        return sa.Text()
    return sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")


def _scope_columns() -> list[sa.Column[Any]]:
    return [
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
    ]


def upgrade() -> None:
    op.add_column(
        "capability_catalog_generations",
        sa.Column("rejection_payload", _json_text(65536), nullable=True),
    )
    op.add_column(
        "capability_catalog_entries",
        sa.Column("entry_payload", _json_text(131072), nullable=True),
    )
    op.create_table(
        "metadata_view_installations",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_metadata_view_digest", sa.String(length=100), nullable=False),
        sa.Column("schema_generation", sa.BigInteger(), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id", "runtime_metadata_view_digest"],
            ["metadata_views.org_id", "metadata_views.runtime_metadata_view_digest"],
            name=op.f("fk_metadata_view_installations_metadata_views"),
        ),
        sa.PrimaryKeyConstraint(
            "org_id",
            "app_installation_id",
            "runtime_metadata_view_digest",
            name=op.f("pk_metadata_view_installations"),
        ),
        **_TABLE_OPTIONS,
    )
    op.create_index(
        "ix_metadata_view_installations_view",
        "metadata_view_installations",
        ["org_id", "runtime_metadata_view_digest"],
        unique=False,
    )
    op.create_table(
        "runtime_releases",
        *_scope_columns(),
        sa.Column("runtime_release_id", sa.String(length=64), nullable=False),
        sa.Column("supported_capability_version", sa.BigInteger(), nullable=False),
        sa.Column("published_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            list(_SCOPE),
            [f"runtime_work_bindings.{c}" for c in _SCOPE],
            name=op.f("fk_runtime_releases_runtime_work_bindings"),
        ),
        sa.PrimaryKeyConstraint(*_SCOPE, "runtime_release_id", name=op.f("pk_runtime_releases")),
        **_TABLE_OPTIONS,
    )
    op.create_table(
        "catalog_requests",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("rpc_name", sa.String(length=32), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("request_digest", sa.String(length=100), nullable=False),
        sa.Column("response_payload", _json_text(1048576), nullable=True),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint(
            "org_id", "rpc_name", "request_id", name=op.f("pk_catalog_requests")
        ),
        **_TABLE_OPTIONS,
    )
    op.create_index(
        "ix_catalog_requests_created",
        "catalog_requests",
        ["org_id", "created_at"],
        unique=False,
    )


def downgrade() -> None:
    # Dropping a table drops its indexes; SQLite cannot drop a column outside batch mode.
    op.drop_table("catalog_requests")
    op.drop_table("runtime_releases")
    op.drop_table("metadata_view_installations")
    with op.batch_alter_table("capability_catalog_entries") as batch:
        batch.drop_column("entry_payload")
    with op.batch_alter_table("capability_catalog_generations") as batch:
        batch.drop_column("rejection_payload")
