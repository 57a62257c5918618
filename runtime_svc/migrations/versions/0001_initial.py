"""Runtime schema: flow versions, policies, plans and activations, Flow runs and their lifecycle rows, wake signals, and the record engine.

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
        "audit_records",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("audit_record_id", sa.String(length=64), nullable=False),
        sa.Column("actor_kind", sa.String(length=32), nullable=False),
        sa.Column("actor_id", sa.String(length=128), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("object_name", sa.String(length=64), nullable=True),
        sa.Column("record_id", sa.String(length=64), nullable=True),
        sa.Column("flow_run_id", sa.String(length=64), nullable=True),
        sa.Column("step_execution_id", sa.String(length=64), nullable=True),
        sa.Column("attempt_id", sa.String(length=64), nullable=True),
        sa.Column("details", _json_text(16384), nullable=False),
        sa.Column("occurred_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint("org_id", "audit_record_id", name=op.f("pk_audit_records")),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_audit_records_record",
        "audit_records",
        ["org_id", "object_name", "record_id", "occurred_at"],
        unique=False,
    )
    op.create_index(
        "ix_audit_records_run",
        "audit_records",
        ["org_id", "flow_run_id", "occurred_at"],
        unique=False,
    )
    op.create_table(
        "flow_versions",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("flow_version_id", sa.String(length=64), nullable=False),
        sa.Column("flow_id", sa.String(length=64), nullable=False),
        sa.Column("version_number", sa.BigInteger(), nullable=False),
        sa.Column("source_payload", _json_text(2097152), nullable=False),
        sa.Column("metadata_digest", sa.String(length=100), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint("org_id", "flow_version_id", name=op.f("pk_flow_versions")),
        sa.UniqueConstraint("org_id", "flow_id", "version_number", name="uq_flow_versions_number"),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_table(
        "flow_wake_signals",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("wake_signal_id", sa.String(length=64), nullable=False),
        sa.Column("producer_kind", sa.String(length=64), nullable=False),
        sa.Column("producer_key", sa.String(length=200), nullable=False),
        sa.Column("wake_token", sa.String(length=128), nullable=False),
        sa.Column("wake_version", sa.BigInteger(), nullable=True),
        sa.Column("evidence_digest", sa.String(length=100), nullable=False),
        sa.Column("evidence_reference", sa.String(length=200), nullable=True),
        sa.Column("received_at", _utc_datetime(), nullable=False),
        sa.Column("expires_at", _utc_datetime(), nullable=False),
        sa.Column("resolution_state", sa.String(length=32), nullable=False),
        sa.Column("dependency_id", sa.String(length=64), nullable=True),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "wake_signal_id",
            name=op.f("pk_flow_wake_signals"),
        ),
        sa.UniqueConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "producer_kind",
            "producer_key",
            "wake_token",
            name="uq_flow_wake_signals_token",
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_flow_wake_signals_expiry",
        "flow_wake_signals",
        ["org_id", "resolution_state", "expires_at"],
        unique=False,
    )
    op.create_table(
        "records",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("object_name", sa.String(length=64), nullable=False),
        sa.Column("record_id", sa.String(length=64), nullable=False),
        sa.Column("record_version", sa.BigInteger(), nullable=False),
        sa.Column("fields", _json_text(262144), nullable=False),
        sa.Column("parent_object_name", sa.String(length=64), nullable=True),
        sa.Column("parent_record_id", sa.String(length=64), nullable=True),
        sa.Column("is_deleted", sa.Boolean(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.Column("updated_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint("org_id", "object_name", "record_id", name=op.f("pk_records")),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_records_parent",
        "records",
        ["org_id", "parent_object_name", "parent_record_id"],
        unique=False,
    )
    op.create_table(
        "runtime_policies",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("policy_version", sa.BigInteger(), nullable=False),
        sa.Column("policy_payload", _json_text(65536), nullable=False),
        sa.Column("policy_digest", sa.String(length=100), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.PrimaryKeyConstraint("org_id", "policy_version", name=op.f("pk_runtime_policies")),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_table(
        "business_events",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("event_id", sa.String(length=64), nullable=False),
        sa.Column("object_name", sa.String(length=64), nullable=False),
        sa.Column("record_id", sa.String(length=64), nullable=False),
        sa.Column("history_sequence", sa.BigInteger(), nullable=False),
        sa.Column("event_type", sa.String(length=64), nullable=False),
        sa.Column("payload", _json_text(65536), nullable=False),
        sa.Column("flow_run_id", sa.String(length=64), nullable=True),
        sa.Column("step_execution_id", sa.String(length=64), nullable=True),
        sa.Column("attempt_id", sa.String(length=64), nullable=True),
        sa.Column("occurred_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id", "object_name", "record_id"],
            ["records.org_id", "records.object_name", "records.record_id"],
            name=op.f("fk_business_events_records"),
        ),
        sa.PrimaryKeyConstraint("org_id", "event_id", name=op.f("pk_business_events")),
        sa.UniqueConstraint(
            "org_id",
            "object_name",
            "record_id",
            "history_sequence",
            name="uq_business_events_sequence",
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_business_events_run", "business_events", ["org_id", "flow_run_id"], unique=False
    )
    op.create_table(
        "execution_plans",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("plan_id", sa.String(length=64), nullable=False),
        sa.Column("flow_version_id", sa.String(length=64), nullable=False),
        sa.Column("metadata_digest", sa.String(length=100), nullable=False),
        sa.Column("compiler_version", sa.String(length=64), nullable=False),
        sa.Column("catalog_generation_id", sa.String(length=64), nullable=False),
        sa.Column("catalog_digest", sa.String(length=100), nullable=False),
        sa.Column("catalog_revision", sa.BigInteger(), nullable=False),
        sa.Column("schema_generation", sa.BigInteger(), nullable=False),
        sa.Column("engine_generation", sa.BigInteger(), nullable=False),
        sa.Column("catalog_snapshot_digest", sa.String(length=100), nullable=False),
        sa.Column("runtime_metadata_view_digest", sa.String(length=100), nullable=False),
        sa.Column("trigger_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("policy_version", sa.BigInteger(), nullable=False),
        sa.Column("execution_profile", sa.String(length=32), nullable=False),
        sa.Column("plan_digest", sa.String(length=100), nullable=False),
        sa.Column("plan_payload", _json_text(4194304), nullable=False),
        sa.Column("bound_summary", _json_text(16384), nullable=False),
        sa.Column("diagnostic_summary", _json_text(16384), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id", "flow_version_id"],
            ["flow_versions.org_id", "flow_versions.flow_version_id"],
            name=op.f("fk_execution_plans_flow_versions"),
        ),
        sa.PrimaryKeyConstraint("org_id", "plan_id", name=op.f("pk_execution_plans")),
        sa.UniqueConstraint(
            "org_id",
            "flow_version_id",
            "compiler_version",
            "runtime_work_binding_digest",
            "catalog_generation_id",
            "catalog_digest",
            "trigger_binding_digest",
            "policy_version",
            name="uq_execution_plans_identity",
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_execution_plans_digest", "execution_plans", ["org_id", "plan_digest"], unique=False
    )
    op.create_table(
        "record_history_sequences",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("object_name", sa.String(length=64), nullable=False),
        sa.Column("record_id", sa.String(length=64), nullable=False),
        sa.Column("last_sequence", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id", "object_name", "record_id"],
            ["records.org_id", "records.object_name", "records.record_id"],
            name=op.f("fk_record_history_sequences_records"),
        ),
        sa.PrimaryKeyConstraint(
            "org_id", "object_name", "record_id", name=op.f("pk_record_history_sequences")
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_table(
        "flow_runs",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("flow_run_id", sa.String(length=64), nullable=False),
        sa.Column("flow_version_id", sa.String(length=64), nullable=False),
        sa.Column("plan_id", sa.String(length=64), nullable=False),
        sa.Column("execution_profile", sa.String(length=32), nullable=False),
        sa.Column(
            "execution_owner",
            sa.String(length=32),
            server_default="LegacyInterpreter",
            nullable=False,
        ),
        sa.Column("runtime_state", sa.String(length=32), nullable=False),
        sa.Column("current_step_execution_id", sa.String(length=64), nullable=True),
        sa.Column("current_checkpoint_id", sa.String(length=64), nullable=True),
        sa.Column("state_version", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("ownership_epoch", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("run_after", _utc_datetime(), nullable=True),
        sa.Column("queue_class", sa.String(length=32), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("terminal_cause_code", sa.String(length=32), nullable=True),
        sa.Column("is_deleted", sa.Boolean(), server_default=sa.text("0"), nullable=False),
        sa.Column("delete_requested_at", _utc_datetime(), nullable=True),
        sa.Column("started_at", _utc_datetime(), nullable=True),
        sa.Column("completed_at", _utc_datetime(), nullable=True),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("request_digest", sa.String(length=100), nullable=True),
        sa.Column("interview_status", sa.String(length=32), nullable=False),
        sa.Column("current_element", sa.String(length=128), nullable=True),
        sa.Column("paused_at", _utc_datetime(), nullable=True),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.Column("updated_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id", "plan_id"],
            ["execution_plans.org_id", "execution_plans.plan_id"],
            name=op.f("fk_flow_runs_execution_plans"),
        ),
        sa.PrimaryKeyConstraint("org_id", "flow_run_id", name=op.f("pk_flow_runs")),
        sa.UniqueConstraint("org_id", "idempotency_key", name="uq_flow_runs_idempotency"),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_flow_runs_claim",
        "flow_runs",
        ["org_id", "runtime_state", "run_after", "queue_class", "flow_run_id"],
        unique=False,
    )
    op.create_index(
        "ix_flow_runs_migration",
        "flow_runs",
        ["org_id", "ownership_epoch", "runtime_state"],
        unique=False,
    )
    op.create_index("ix_flow_runs_plan", "flow_runs", ["org_id", "plan_id"], unique=False)
    op.create_table(
        "plan_activations",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("activation_id", sa.String(length=64), nullable=False),
        sa.Column("flow_version_id", sa.String(length=64), nullable=False),
        sa.Column("trigger_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("plan_id", sa.String(length=64), nullable=True),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("active_slot", sa.SmallInteger(), nullable=True),
        sa.Column("attempt_diagnostics", _json_text(16384), nullable=True),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.Column("activated_at", _utc_datetime(), nullable=True),
        sa.Column("superseded_at", _utc_datetime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["org_id", "plan_id"],
            ["execution_plans.org_id", "execution_plans.plan_id"],
            name=op.f("fk_plan_activations_execution_plans"),
        ),
        sa.PrimaryKeyConstraint("org_id", "activation_id", name=op.f("pk_plan_activations")),
        sa.UniqueConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "flow_version_id",
            "active_slot",
            name="uq_plan_activations_active",
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_plan_activations_plan", "plan_activations", ["org_id", "plan_id"], unique=False
    )
    op.create_table(
        "flow_checkpoints",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("checkpoint_id", sa.String(length=64), nullable=False),
        sa.Column("flow_run_id", sa.String(length=64), nullable=False),
        sa.Column("sequence", sa.BigInteger(), nullable=False),
        sa.Column("plan_cursor", _json_text(4096), nullable=False),
        sa.Column("context_schema_version", sa.Integer(), nullable=False),
        sa.Column("context_payload", _json_text(1048576), nullable=False),
        sa.Column("context_digest", sa.String(length=100), nullable=False),
        sa.Column("read_verification_set", _json_text(16384), nullable=True),
        sa.Column("created_by_attempt_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id", "flow_run_id"],
            ["flow_runs.org_id", "flow_runs.flow_run_id"],
            name=op.f("fk_flow_checkpoints_flow_runs"),
        ),
        sa.PrimaryKeyConstraint("org_id", "checkpoint_id", name=op.f("pk_flow_checkpoints")),
        sa.UniqueConstraint(
            "org_id", "flow_run_id", "sequence", name="uq_flow_checkpoints_sequence"
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_table(
        "flow_step_executions",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("step_execution_id", sa.String(length=64), nullable=False),
        sa.Column("flow_run_id", sa.String(length=64), nullable=False),
        sa.Column("plan_step_key", sa.String(length=128), nullable=False),
        sa.Column("invocation_ordinal", sa.BigInteger(), nullable=False),
        sa.Column("step_kind", sa.String(length=32), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("input_checkpoint_id", sa.String(length=64), nullable=True),
        sa.Column("output_checkpoint_id", sa.String(length=64), nullable=True),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.Column("attempt_count", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_token", sa.String(length=128), nullable=True),
        sa.Column("lease_until", _utc_datetime(), nullable=True),
        sa.Column("ownership_epoch", sa.BigInteger(), nullable=False),
        sa.Column("run_after", _utc_datetime(), nullable=True),
        sa.Column("queue_class", sa.String(length=32), nullable=False),
        sa.Column("failure_class", sa.String(length=32), nullable=True),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.Column("updated_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id", "flow_run_id"],
            ["flow_runs.org_id", "flow_runs.flow_run_id"],
            name=op.f("fk_flow_step_executions_flow_runs"),
        ),
        sa.PrimaryKeyConstraint(
            "org_id", "step_execution_id", name=op.f("pk_flow_step_executions")
        ),
        sa.UniqueConstraint(
            "org_id",
            "flow_run_id",
            "plan_step_key",
            "invocation_ordinal",
            name="uq_flow_step_executions_invocation",
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_flow_step_executions_claim",
        "flow_step_executions",
        ["org_id", "state", "queue_class", "run_after", "step_execution_id"],
        unique=False,
    )
    op.create_index(
        "ix_flow_step_executions_lease",
        "flow_step_executions",
        ["org_id", "lease_until"],
        unique=False,
    )
    op.create_table(
        "flow_dependencies",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("app_installation_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_capability_id", sa.String(length=64), nullable=False),
        sa.Column("runtime_work_binding_digest", sa.String(length=100), nullable=False),
        sa.Column("dependency_id", sa.String(length=64), nullable=False),
        sa.Column("flow_run_id", sa.String(length=64), nullable=False),
        sa.Column("step_execution_id", sa.String(length=64), nullable=False),
        sa.Column("producer_kind", sa.String(length=64), nullable=False),
        sa.Column("producer_key", sa.String(length=200), nullable=False),
        sa.Column("condition_digest", sa.String(length=100), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("active_slot", sa.SmallInteger(), nullable=True),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.Column("wake_version", sa.BigInteger(), nullable=True),
        sa.Column("wake_token", sa.String(length=128), nullable=True),
        sa.Column("deadline", _utc_datetime(), nullable=False),
        sa.Column("next_probe_at", _utc_datetime(), nullable=True),
        sa.Column("expiry_policy", sa.String(length=32), nullable=False),
        sa.Column("resolved_at", _utc_datetime(), nullable=True),
        sa.Column("resolution_receipt", _json_text(16384), nullable=True),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.Column("updated_at", _utc_datetime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id", "step_execution_id"],
            ["flow_step_executions.org_id", "flow_step_executions.step_execution_id"],
            name=op.f("fk_flow_dependencies_flow_step_executions"),
        ),
        sa.PrimaryKeyConstraint("org_id", "dependency_id", name=op.f("pk_flow_dependencies")),
        sa.UniqueConstraint(
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "step_execution_id",
            "active_slot",
            name="uq_flow_dependencies_active",
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    op.create_index(
        "ix_flow_dependencies_deadline",
        "flow_dependencies",
        ["org_id", "state", "deadline"],
        unique=False,
    )
    op.create_index(
        "ix_flow_dependencies_probe",
        "flow_dependencies",
        ["org_id", "state", "next_probe_at"],
        unique=False,
    )
    op.create_index(
        "ix_flow_dependencies_producer",
        "flow_dependencies",
        [
            "org_id",
            "app_installation_id",
            "runtime_capability_id",
            "runtime_work_binding_digest",
            "producer_kind",
            "producer_key",
            "state",
        ],
        unique=False,
    )
    op.create_index(
        "ix_flow_dependencies_step",
        "flow_dependencies",
        ["org_id", "step_execution_id"],
        unique=False,
    )
    op.create_table(
        "flow_step_attempts",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("attempt_id", sa.String(length=64), nullable=False),
        sa.Column("step_execution_id", sa.String(length=64), nullable=False),
        sa.Column("attempt_number", sa.Integer(), nullable=False),
        sa.Column("lease_token_digest", sa.String(length=100), nullable=False),
        sa.Column("ownership_epoch", sa.BigInteger(), nullable=False),
        sa.Column("root_state_version_at_claim", sa.BigInteger(), nullable=False),
        sa.Column("started_at", _utc_datetime(), nullable=False),
        sa.Column("finished_at", _utc_datetime(), nullable=True),
        sa.Column("transaction_outcome", sa.String(length=32), nullable=False),
        sa.Column("failure_class", sa.String(length=32), nullable=True),
        sa.Column("safe_error_code", sa.String(length=64), nullable=True),
        sa.Column("retry_decision", sa.String(length=32), nullable=True),
        sa.Column("retry_policy_digest", sa.String(length=100), nullable=False),
        sa.Column("recovery_backoff_floor_ms", sa.BigInteger(), nullable=False),
        sa.Column("attempt_state_version", sa.BigInteger(), nullable=False),
        sa.Column("plan_digest", sa.String(length=100), nullable=False),
        sa.Column("lock_plan_digest", sa.String(length=100), nullable=False),
        sa.Column("trace_id", sa.String(length=64), nullable=True),
        sa.Column("metrics_summary", _json_text(16384), nullable=True),
        sa.ForeignKeyConstraint(
            ["org_id", "step_execution_id"],
            ["flow_step_executions.org_id", "flow_step_executions.step_execution_id"],
            name=op.f("fk_flow_step_attempts_flow_step_executions"),
        ),
        sa.PrimaryKeyConstraint("org_id", "attempt_id", name=op.f("pk_flow_step_attempts")),
        sa.UniqueConstraint(
            "org_id", "step_execution_id", "attempt_number", name="uq_flow_step_attempts_number"
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )


def downgrade() -> None:
    # Dropping a table drops its indexes (and MySQL refuses to drop an index a foreign
    # key still needs), so only indexes on surviving tables are dropped explicitly.
    op.drop_table("flow_step_attempts")
    op.drop_table("flow_dependencies")
    op.drop_table("flow_step_executions")
    op.drop_table("flow_checkpoints")
    op.drop_table("plan_activations")
    op.drop_table("flow_runs")
    op.drop_table("record_history_sequences")
    op.drop_table("execution_plans")
    op.drop_table("business_events")
    op.drop_table("runtime_policies")
    op.drop_table("records")
    op.drop_table("flow_wake_signals")
    op.drop_table("flow_versions")
    op.drop_table("audit_records")
