"""Migration contract (§20): legacy interpreter owner, pre-bridge interview shape, the
deployment control record, the writer fleet registry, org-backfill receipts, cohort
flags and shadow comparisons. See docs/adr/0001-legacy-bridge-schema.md.

``flow_runs``:

* ``plan_id`` becomes nullable — a ``LegacyInterpreter``-owned run has no compiled plan.
  On SQLite this uses the procedure SQLite documents for removing a ``NOT NULL``
  constraint (``PRAGMA writable_schema`` edit of the stored DDL plus a
  ``schema_version`` bump): a table rebuild would have to drop ``flow_runs`` while
  step/checkpoint rows reference it, which SQLite's foreign keys refuse inside the
  migration transaction. MySQL-family servers use ``ALTER TABLE … MODIFY``.
* ``legacy_context``, ``legacy_claimed_by``, ``legacy_claim_until`` (nullable): the
  legacy-owned field set; index ``ix_flow_runs_legacy_due`` serves the §20.3 (6) due list.

New tables (see :mod:`runtime_svc.schema_bridge`). The control record is seeded for a
**clean install or an upgrade of a V2 deployment**: generation 1, origin
``clean_install`` — no pre-bridge FlowInterview writer can exist for a schema this
project created. An adopter moving an element-walking interpreter deployment resets it
with ``flowctl deploy bridge begin`` while no V2-owned run exists.

Revision ID: 0009
Revises: 0010_telemetry
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0009"
down_revision = "0010_telemetry"
branch_labels = None
depends_on = None

_OPTS: dict[str, Any] = {
    "mysql_charset": "utf8mb4",
    "mysql_collate": "utf8mb4_bin",
    "mysql_engine": "InnoDB",
}
_PLAN_ID_NOT_NULL = "plan_id VARCHAR(64) NOT NULL"
_PLAN_ID_NULL = "plan_id VARCHAR(64)"


def _utc_datetime() -> sa.types.TypeEngine[Any]:
    return sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _json_text(max_bytes: int) -> sa.types.TypeEngine[Any]:
    if max_bytes <= 65_535:
        return sa.Text()
    return sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")


def _sqlite_set_plan_id_ddl(old: str, new: str) -> None:
    conn = op.get_bind()
    sql = conn.exec_driver_sql(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'flow_runs'"
    ).scalar_one()
    if old not in sql:
        raise RuntimeError(f"flow_runs DDL does not contain {old!r}; refusing to edit it")
    version = int(conn.exec_driver_sql("PRAGMA schema_version").scalar_one())
    conn.exec_driver_sql("PRAGMA writable_schema = ON")
    conn.exec_driver_sql(
        "UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = 'flow_runs'",
        (sql.replace(old, new, 1),),
    )
    conn.exec_driver_sql(f"PRAGMA schema_version = {version + 1}")
    conn.exec_driver_sql("PRAGMA writable_schema = OFF")


def _set_plan_id_nullable(nullable: bool) -> None:
    if op.get_bind().dialect.name == "sqlite":
        if nullable:
            _sqlite_set_plan_id_ddl(_PLAN_ID_NOT_NULL, _PLAN_ID_NULL)
        else:
            _sqlite_set_plan_id_ddl(_PLAN_ID_NULL, _PLAN_ID_NOT_NULL)
        return
    op.alter_column("flow_runs", "plan_id", existing_type=sa.String(length=64), nullable=nullable)


def upgrade() -> None:
    _set_plan_id_nullable(True)
    op.add_column("flow_runs", sa.Column("legacy_context", _json_text(1048576), nullable=True))
    op.add_column("flow_runs", sa.Column("legacy_claimed_by", sa.String(length=128), nullable=True))
    op.add_column("flow_runs", sa.Column("legacy_claim_until", _utc_datetime(), nullable=True))
    op.create_index(
        "ix_flow_runs_legacy_due",
        "flow_runs",
        [
            "org_id",
            "execution_owner",
            "ownership_epoch",
            "interview_status",
            "run_after",
            "flow_run_id",
        ],
        unique=False,
    )
    op.create_table(
        "flow_interviews",
        sa.Column("interview_id", sa.String(length=64), nullable=False),
        sa.Column("flow_api_name", sa.String(length=64), nullable=False),
        sa.Column("flow_version_number", sa.BigInteger(), nullable=False),
        sa.Column("interview_status", sa.String(length=32), nullable=False),
        sa.Column("current_element", sa.String(length=128), nullable=True),
        sa.Column("paused_at", _utc_datetime(), nullable=True),
        sa.Column("resume_at", _utc_datetime(), nullable=True),
        sa.Column("context_payload", _json_text(1048576), nullable=False),
        sa.Column("is_deleted", sa.Boolean(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.Column("updated_at", _utc_datetime(), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=True),
        sa.Column(
            "execution_owner",
            sa.String(length=32),
            server_default="LegacyInterpreter",
            nullable=False,
        ),
        sa.Column("ownership_epoch", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("state_version", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("delete_requested_at", _utc_datetime(), nullable=True),
        sa.Column("adopted_at", _utc_datetime(), nullable=True),
        sa.PrimaryKeyConstraint("interview_id", name=op.f("pk_flow_interviews")),
        **_OPTS,
    )
    op.create_index(
        "ix_flow_interviews_org", "flow_interviews", ["org_id", "interview_id"], unique=False
    )
    control = op.create_table(
        "flow_deployment_control",
        sa.Column("control_key", sa.String(length=64), nullable=False),
        sa.Column("write_protocol_generation", sa.BigInteger(), nullable=False),
        sa.Column("phase", sa.String(length=32), nullable=False),
        sa.Column("origin", sa.String(length=32), nullable=False),
        sa.Column("default_new_run_owner", sa.String(length=32), nullable=False),
        sa.Column("v2_admission_enabled", sa.Boolean(), nullable=False),
        sa.Column("isolated_single_org", sa.Boolean(), nullable=False),
        sa.Column("deployment_org_id", sa.String(length=64), nullable=True),
        sa.Column("quarantine_reason", sa.String(length=128), nullable=True),
        sa.Column("drain_started_at", _utc_datetime(), nullable=True),
        sa.Column("drained_at", _utc_datetime(), nullable=True),
        sa.Column("drain_evidence", _json_text(65536), nullable=True),
        sa.Column("org_backfill_receipt_id", sa.String(length=64), nullable=True),
        sa.Column("org_schema_verified_at", _utc_datetime(), nullable=True),
        sa.Column("write_protocol_enabled_at", _utc_datetime(), nullable=True),
        sa.Column("admission_changed_at", _utc_datetime(), nullable=True),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.Column("updated_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint("control_key", name=op.f("pk_flow_deployment_control")),
        **_OPTS,
    )
    op.create_table(
        "flow_interview_writers",
        sa.Column("process_id", sa.String(length=64), nullable=False),
        sa.Column("binary_version", sa.String(length=64), nullable=False),
        sa.Column("write_protocol_generation", sa.BigInteger(), nullable=False),
        sa.Column("compiler_version", sa.String(length=64), nullable=False),
        sa.Column("host", sa.String(length=128), nullable=False),
        sa.Column("started_at", _utc_datetime(), nullable=False),
        sa.Column("heartbeat_at", _utc_datetime(), nullable=False),
        sa.Column("lease_until", _utc_datetime(), nullable=False),
        sa.Column("stopped_at", _utc_datetime(), nullable=True),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("process_id", name=op.f("pk_flow_interview_writers")),
        **_OPTS,
    )
    op.create_index(
        "ix_flow_interview_writers_live",
        "flow_interview_writers",
        ["write_protocol_generation", "lease_until"],
        unique=False,
    )
    op.create_table(
        "flow_interview_org_backfill_receipts",
        sa.Column("receipt_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("outcome", sa.String(length=32), nullable=False),
        sa.Column("authority_digest", sa.String(length=100), nullable=True),
        sa.Column("org_id", sa.String(length=64), nullable=True),
        sa.Column("scanned_count", sa.BigInteger(), nullable=False),
        sa.Column("stamped_count", sa.BigInteger(), nullable=False),
        sa.Column("already_matching_count", sa.BigInteger(), nullable=False),
        sa.Column("null_count", sa.BigInteger(), nullable=False),
        sa.Column("mismatch_count", sa.BigInteger(), nullable=False),
        sa.Column("adopted_count", sa.BigInteger(), nullable=False),
        sa.Column("schema_generation", sa.String(length=64), nullable=False),
        sa.Column("details", _json_text(16384), nullable=False),
        sa.Column("completed_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint("receipt_id", name=op.f("pk_flow_interview_org_backfill_receipts")),
        **_OPTS,
    )
    op.create_table(
        "flow_migration_cohorts",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("flow_version_id", sa.String(length=64), nullable=False),
        sa.Column("execution_profile", sa.String(length=32), nullable=False),
        sa.Column("cohort", sa.String(length=32), nullable=False),
        sa.Column("new_run_owner", sa.String(length=32), nullable=False),
        sa.Column("evidence_comparison_id", sa.String(length=64), nullable=True),
        sa.Column("enabled_at", _utc_datetime(), nullable=True),
        sa.Column("disabled_at", _utc_datetime(), nullable=True),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.Column("updated_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint(
            "org_id",
            "flow_version_id",
            "execution_profile",
            name=op.f("pk_flow_migration_cohorts"),
        ),
        **_OPTS,
    )
    op.create_table(
        "flow_shadow_comparisons",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("comparison_id", sa.String(length=64), nullable=False),
        sa.Column("flow_version_id", sa.String(length=64), nullable=False),
        sa.Column("plan_digest", sa.String(length=100), nullable=True),
        sa.Column("scenario_digest", sa.String(length=100), nullable=False),
        sa.Column("outcome", sa.String(length=32), nullable=False),
        sa.Column("blocking", sa.Boolean(), nullable=False),
        sa.Column("divergences", _json_text(65536), nullable=False),
        sa.Column("compared_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint("org_id", "comparison_id", name=op.f("pk_flow_shadow_comparisons")),
        **_OPTS,
    )
    op.create_index(
        "ix_flow_shadow_comparisons_version",
        "flow_shadow_comparisons",
        ["org_id", "flow_version_id", "compared_at"],
        unique=False,
    )
    now = datetime.now(UTC)
    if op.get_bind().dialect.name == "sqlite":
        now = now.replace(tzinfo=None)  # UtcDateTime stores naive UTC
    op.bulk_insert(
        control,
        [
            {
                "control_key": "flow_interview_write_protocol",
                "write_protocol_generation": 1,
                "phase": "write_protocol_enabled",
                "origin": "clean_install",
                "default_new_run_owner": "FlowRuntimeV2",
                "v2_admission_enabled": True,
                "isolated_single_org": False,
                "state_version": 0,
                "write_protocol_enabled_at": now,
                "created_at": now,
                "updated_at": now,
            }
        ],
    )


def downgrade() -> None:
    conn = op.get_bind()
    legacy = conn.exec_driver_sql(
        "SELECT COUNT(*) FROM flow_runs WHERE plan_id IS NULL"
    ).scalar_one()
    if legacy:
        raise RuntimeError(
            f"{legacy} LegacyInterpreter-owned run(s) have no plan_id; "
            "drain or purge them before downgrading below 0009"
        )
    op.drop_index("ix_flow_shadow_comparisons_version", table_name="flow_shadow_comparisons")
    op.drop_table("flow_shadow_comparisons")
    op.drop_table("flow_migration_cohorts")
    op.drop_table("flow_interview_org_backfill_receipts")
    op.drop_index("ix_flow_interview_writers_live", table_name="flow_interview_writers")
    op.drop_table("flow_interview_writers")
    op.drop_table("flow_deployment_control")
    op.drop_index("ix_flow_interviews_org", table_name="flow_interviews")
    op.drop_table("flow_interviews")
    op.drop_index("ix_flow_runs_legacy_due", table_name="flow_runs")
    for column in ("legacy_claim_until", "legacy_claimed_by", "legacy_context"):
        # Plain ALTER TABLE … DROP COLUMN (SQLite >= 3.35): no rebuild of a table that
        # step and checkpoint rows reference.
        op.execute(f"ALTER TABLE flow_runs DROP COLUMN {column}")
    _set_plan_id_nullable(False)
