"""Migration-contract tables of the runtime schema (§20; revision ``0009_legacy_bridge``).

Registered on :data:`runtime_svc.schema.metadata` (``schema.py`` imports this module at
its end), so Alembic's ``db verify`` compares them with the live schema like every other
table. Kept apart from ``schema.py`` only to keep both modules small.

* ``flow_interviews`` — the **pre-bridge FlowInterview shape** (docs/adr/0001): the table
  pre-bridge binaries write during the additive-schema window. Its ``org_id`` is the §20.2
  nullable compatibility OrgID, and the additive lifecycle columns carry the legacy-safe
  server defaults (``LegacyInterpreter``/0/0, ``is_deleted`` false), so an old insert that
  omits them reads back a non-deleted legacy-owned row at state version zero. Keyed by
  the legacy, globally unique ``interview_id`` — the ID-only identity old binaries use.
  The org-schema gate adopts every stamped row into the org-keyed ``flow_runs``.
* ``flow_deployment_control`` — the persisted deployment control record carrying
  ``FlowInterviewWriteProtocolGeneration`` and the gate evidence (§20.3). It is
  deployment-scoped, not tenant data: one row per control key, no ``org_id`` (the
  deployment's one trusted org is a *value* of the record, proven by the backfill).
* ``flow_interview_writers`` — the fleet registry: every bridge-aware process registers
  its binary version and write-protocol generation and heartbeats; the drain gate reads
  it as the authoritative fleet evidence.
* ``flow_interview_org_backfill_receipts`` — ``FlowInterviewOrgBackfillReceipt`` (§20.2).
* ``flow_migration_cohorts`` — cohort flags per org x Flow version x profile (§20.7).
* ``flow_shadow_comparisons`` — persisted shadow-comparison outcomes (§20.5), the
  authoritative source of the "projection divergence" release evidence (§23.3).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Index,
    PrimaryKeyConstraint,
    String,
    Table,
    text,
)

from runtime_svc.schema import MAX_CONTEXT_PAYLOAD_BYTES, MAX_SUMMARY_BYTES, metadata
from services.db import (
    CODE_LEN,
    DIGEST_LEN,
    ID_LEN,
    TABLE_OPTIONS,
    TOKEN_LEN,
    JsonText,
    UtcDateTime,
)

__all__ = [
    "MAX_EVIDENCE_BYTES",
    "flow_deployment_control",
    "flow_interview_org_backfill_receipts",
    "flow_interview_writers",
    "flow_interviews",
    "flow_migration_cohorts",
    "flow_shadow_comparisons",
]

#: Gate evidence and comparison summaries (bounded, safe: ids, counts, codes).
MAX_EVIDENCE_BYTES = 64 * 1024

#: The pre-bridge FlowInterview table (see the module docstring). Legacy columns first,
#: then the §20.2 additive columns with their legacy-safe defaults, then adoption.
flow_interviews = Table(
    "flow_interviews",
    metadata,
    Column("interview_id", String(ID_LEN), nullable=False),
    Column("flow_api_name", String(ID_LEN), nullable=False),
    Column("flow_version_number", BigInteger, nullable=False),
    Column("interview_status", String(CODE_LEN), nullable=False),
    Column("current_element", String(TOKEN_LEN), nullable=True),
    Column("paused_at", UtcDateTime(), nullable=True),
    Column("resume_at", UtcDateTime(), nullable=True),
    Column("context_payload", JsonText(MAX_CONTEXT_PAYLOAD_BYTES), nullable=False),
    Column("is_deleted", Boolean, nullable=False, server_default=text("0")),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
    # §20.2 additive columns: nullable compatibility OrgID and legacy-safe defaults.
    Column("org_id", String(ID_LEN), nullable=True),
    Column("execution_owner", String(CODE_LEN), nullable=False, server_default="LegacyInterpreter"),
    Column("ownership_epoch", BigInteger, nullable=False, server_default=text("0")),
    Column("state_version", BigInteger, nullable=False, server_default=text("0")),
    Column("delete_requested_at", UtcDateTime(), nullable=True),
    # Set by the org-schema gate when the row was adopted into flow_runs.
    Column("adopted_at", UtcDateTime(), nullable=True),
    PrimaryKeyConstraint("interview_id"),
    Index("ix_flow_interviews_org", "org_id", "interview_id"),
    **TABLE_OPTIONS,
)

#: The deployment control record (§20.3).
flow_deployment_control = Table(
    "flow_deployment_control",
    metadata,
    Column("control_key", String(ID_LEN), nullable=False),
    # FlowInterviewWriteProtocolGeneration: 0 = pre-bridge coexistence, 1 = enforced.
    Column("write_protocol_generation", BigInteger, nullable=False),
    # additive | drained | org_schema_verified | write_protocol_enabled
    Column("phase", String(CODE_LEN), nullable=False),
    # clean_install | legacy_adoption
    Column("origin", String(CODE_LEN), nullable=False),
    Column("default_new_run_owner", String(CODE_LEN), nullable=False),
    Column("v2_admission_enabled", Boolean, nullable=False),
    Column("isolated_single_org", Boolean, nullable=False),
    Column("deployment_org_id", String(ID_LEN), nullable=True),
    Column("quarantine_reason", String(TOKEN_LEN), nullable=True),
    Column("drain_started_at", UtcDateTime(), nullable=True),
    Column("drained_at", UtcDateTime(), nullable=True),
    Column("drain_evidence", JsonText(MAX_EVIDENCE_BYTES), nullable=True),
    Column("org_backfill_receipt_id", String(ID_LEN), nullable=True),
    Column("org_schema_verified_at", UtcDateTime(), nullable=True),
    Column("write_protocol_enabled_at", UtcDateTime(), nullable=True),
    Column("admission_changed_at", UtcDateTime(), nullable=True),
    Column("state_version", BigInteger, nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
    PrimaryKeyConstraint("control_key"),
    **TABLE_OPTIONS,
)

#: The writer fleet registry (authoritative fleet evidence of the drain gate).
flow_interview_writers = Table(
    "flow_interview_writers",
    metadata,
    Column("process_id", String(ID_LEN), nullable=False),
    Column("binary_version", String(ID_LEN), nullable=False),
    Column("write_protocol_generation", BigInteger, nullable=False),
    Column("compiler_version", String(ID_LEN), nullable=False),
    Column("host", String(TOKEN_LEN), nullable=False),
    Column("started_at", UtcDateTime(), nullable=False),
    Column("heartbeat_at", UtcDateTime(), nullable=False),
    Column("lease_until", UtcDateTime(), nullable=False),
    Column("stopped_at", UtcDateTime(), nullable=True),
    Column("state_version", BigInteger, nullable=False),
    PrimaryKeyConstraint("process_id"),
    Index("ix_flow_interview_writers_live", "write_protocol_generation", "lease_until"),
    **TABLE_OPTIONS,
)

#: FlowInterviewOrgBackfillReceipt (§20.2): one row per sweep; ``kind`` = sweep | final.
flow_interview_org_backfill_receipts = Table(
    "flow_interview_org_backfill_receipts",
    metadata,
    Column("receipt_id", String(ID_LEN), nullable=False),
    Column("kind", String(CODE_LEN), nullable=False),
    # complete | quarantined
    Column("outcome", String(CODE_LEN), nullable=False),
    Column("authority_digest", String(DIGEST_LEN), nullable=True),
    Column("org_id", String(ID_LEN), nullable=True),
    Column("scanned_count", BigInteger, nullable=False),
    Column("stamped_count", BigInteger, nullable=False),
    Column("already_matching_count", BigInteger, nullable=False),
    Column("null_count", BigInteger, nullable=False),
    Column("mismatch_count", BigInteger, nullable=False),
    Column("adopted_count", BigInteger, nullable=False),
    Column("schema_generation", String(ID_LEN), nullable=False),
    Column("details", JsonText(MAX_SUMMARY_BYTES), nullable=False),
    Column("completed_at", UtcDateTime(), nullable=False),
    PrimaryKeyConstraint("receipt_id"),
    **TABLE_OPTIONS,
)

#: Cohort flags per org x Flow version x profile (§20.6-§20.7): the owner of NEW runs.
flow_migration_cohorts = Table(
    "flow_migration_cohorts",
    metadata,
    Column("org_id", String(ID_LEN), nullable=False),
    Column("flow_version_id", String(ID_LEN), nullable=False),
    Column("execution_profile", String(CODE_LEN), nullable=False),
    Column("cohort", String(CODE_LEN), nullable=False),
    Column("new_run_owner", String(CODE_LEN), nullable=False),
    Column("evidence_comparison_id", String(ID_LEN), nullable=True),
    Column("enabled_at", UtcDateTime(), nullable=True),
    Column("disabled_at", UtcDateTime(), nullable=True),
    Column("state_version", BigInteger, nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
    PrimaryKeyConstraint("org_id", "flow_version_id", "execution_profile"),
    **TABLE_OPTIONS,
)

#: Shadow comparisons (§20.5): legacy interpreter vs compiled plan on one fixture.
flow_shadow_comparisons = Table(
    "flow_shadow_comparisons",
    metadata,
    Column("org_id", String(ID_LEN), nullable=False),
    Column("comparison_id", String(ID_LEN), nullable=False),
    Column("flow_version_id", String(ID_LEN), nullable=False),
    Column("plan_digest", String(DIGEST_LEN), nullable=True),
    Column("scenario_digest", String(DIGEST_LEN), nullable=False),
    # match | explained | diverged
    Column("outcome", String(CODE_LEN), nullable=False),
    Column("blocking", Boolean, nullable=False),
    Column("divergences", JsonText(MAX_EVIDENCE_BYTES), nullable=False),
    Column("compared_at", UtcDateTime(), nullable=False),
    PrimaryKeyConstraint("org_id", "comparison_id"),
    Index("ix_flow_shadow_comparisons_version", "org_id", "flow_version_id", "compared_at"),
    **TABLE_OPTIONS,
)
