"""Activation bindings per Flow (§7.4): at most one ACTIVE activation per Flow API name and
installation/capability, whatever the version or binding digest; Flow-version labels.

``plan_activations`` gains ``flow_api_name`` (back-filled from ``flow_versions.flow_id``),
its "one active row" unique key moves from (work scope, flow version) to (org, Flow API
name, installation, capability), and a (org, flow version, active slot) index serves
deactivation by version. ``flow_versions`` gains a nullable display ``label``.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("flow_versions") as batch:
        batch.add_column(sa.Column("label", sa.String(length=255), nullable=True))

    with op.batch_alter_table("plan_activations") as batch:
        batch.add_column(sa.Column("flow_api_name", sa.String(length=64), nullable=True))
    op.execute(
        "UPDATE plan_activations SET flow_api_name = ("
        "SELECT fv.flow_id FROM flow_versions fv "
        "WHERE fv.org_id = plan_activations.org_id "
        "AND fv.flow_version_id = plan_activations.flow_version_id)"
    )
    with op.batch_alter_table("plan_activations") as batch:
        batch.alter_column("flow_api_name", existing_type=sa.String(length=64), nullable=False)
        batch.drop_constraint("uq_plan_activations_active", type_="unique")
        batch.create_unique_constraint(
            "uq_plan_activations_flow_active",
            [
                "org_id",
                "flow_api_name",
                "app_installation_id",
                "runtime_capability_id",
                "active_slot",
            ],
        )
        batch.create_index(
            "ix_plan_activations_version", ["org_id", "flow_version_id", "active_slot"]
        )


def downgrade() -> None:
    with op.batch_alter_table("plan_activations") as batch:
        batch.drop_index("ix_plan_activations_version")
        batch.drop_constraint("uq_plan_activations_flow_active", type_="unique")
        batch.create_unique_constraint(
            "uq_plan_activations_active",
            [
                "org_id",
                "app_installation_id",
                "runtime_capability_id",
                "runtime_work_binding_digest",
                "flow_version_id",
                "active_slot",
            ],
        )
        batch.drop_column("flow_api_name")
    with op.batch_alter_table("flow_versions") as batch:
        batch.drop_column("label")
