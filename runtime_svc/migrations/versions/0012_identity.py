"""Run identity and the principal directory (§17, issue 14 item 4).

``flow_runs`` gains three nullable columns, set once when a run is created:
``initiating_principal_id`` (the verified credential's subject — an id, never a
credential), ``execution_principal_mode`` (``initiating_principal``) and
``authorization_context_digest`` (digest of the principal's directory state when the run
was admitted). Existing rows keep ``NULL``: a pre-revision run is not reauthorized.

``flow_principals`` is the runtime's persisted principal directory: per (org, principal)
its status (``enabled``/``disabled``), the digest of its permission state and a fencing
``version``. Each durable step reauthorizes against it (``runtime_svc.identity``).

Revision ID: 0012_identity
Revises: 0011_operator_controls
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0012_identity"
down_revision = "0011_operator_controls"
branch_labels = None
depends_on = None

_OPTS: dict[str, Any] = {
    "mysql_charset": "utf8mb4",
    "mysql_collate": "utf8mb4_bin",
    "mysql_engine": "InnoDB",
}
_RUN_COLUMNS = (
    "initiating_principal_id",
    "execution_principal_mode",
    "authorization_context_digest",
)


def _utc_datetime() -> sa.types.TypeEngine[Any]:
    return sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def upgrade() -> None:
    op.add_column("flow_runs", sa.Column("initiating_principal_id", sa.String(128), nullable=True))
    op.add_column("flow_runs", sa.Column("execution_principal_mode", sa.String(32), nullable=True))
    op.add_column(
        "flow_runs", sa.Column("authorization_context_digest", sa.String(100), nullable=True)
    )
    op.create_table(
        "flow_principals",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("principal_id", sa.String(length=128), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("permission_digest", sa.String(length=100), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint("org_id", "principal_id", name=op.f("pk_flow_principals")),
        **_OPTS,
    )


def downgrade() -> None:
    op.drop_table("flow_principals")
    # Plain ALTER TABLE … DROP COLUMN (SQLite >= 3.35, MariaDB, MySQL): never a batch
    # rebuild of flow_runs, which step, checkpoint and dependency rows reference.
    for column in reversed(_RUN_COLUMNS):
        op.drop_column("flow_runs", column)
