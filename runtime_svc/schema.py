"""Runtime service schema (SQLAlchemy Core): plans, Flow runs and their lifecycle rows,
the Runtime outbox and the record engine.

Spec: §7.4 (``FlowExecutionPlan``, activation bindings), §10.1-§10.8 (FlowRun,
FlowStepExecution, FlowStepAttempt, FlowCheckpoint, FlowDependency, FlowWakeSignal, the
Runtime outbox message family, FlowEffectLink), §13.1 (history-sequence reservation),
§20.2 (legacy-safe defaults on the run root).

Key discipline (§10.0): ``org_id`` leads every primary key, unique key and index; rows
whose identity is "within work scope" (§10.6-§10.8) are keyed by the complete trusted
Runtime work scope. Ids are app-generated strings; nothing orders by AUTO_INCREMENT —
orderings are explicit columns (checkpoint ``sequence``, ``attempt_number``,
``history_sequence`` reserved under the record's lock).

"At most one active row" (one active dependency per scope and waiting step, one active
plan activation per scope and Flow version) is a unique key over a nullable
``active_slot`` column: writers set it to 1 while the row is active and to NULL when it
leaves that state. Every supported engine lets a unique key hold any number of NULLs,
so this is a portable partial unique index.

The catalog generation and metadata view a plan pins live in the catalog service's
database; their "enforced reference" (§7.4) is a retention reference registered there.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ForeignKeyConstraint,
    Index,
    Integer,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    UniqueConstraint,
    text,
)

from services.db import (
    CODE_LEN,
    DIGEST_LEN,
    ID_LEN,
    KEY_LEN,
    TABLE_OPTIONS,
    TOKEN_LEN,
    TRACE_CONTEXT_BYTES,
    WORK_SCOPE,
    AsciiId,
    JsonText,
    UtcDateTime,
    new_metadata,
    outbox_delivery_columns,
    work_scope_columns,
)
from services.request_dedupe import request_dedupe_table

__all__ = [
    "LABEL_LEN",
    "MAX_AUDIT_DETAILS_BYTES",
    "MAX_CONTEXT_PAYLOAD_BYTES",
    "MAX_EVENT_PAYLOAD_BYTES",
    "MAX_FLOW_SOURCE_BYTES",
    "MAX_OUTBOX_PAYLOAD_BYTES",
    "MAX_PLAN_CURSOR_BYTES",
    "MAX_PLAN_PAYLOAD_BYTES",
    "MAX_POLICY_BYTES",
    "MAX_RECORD_FIELDS_BYTES",
    "MAX_SUMMARY_BYTES",
    "audit_records",
    "business_events",
    "execution_plans",
    "flow_checkpoints",
    "flow_dependencies",
    "flow_effect_links",
    "flow_principals",
    "flow_record_watches",
    "flow_runs",
    "flow_step_attempts",
    "flow_step_executions",
    "flow_versions",
    "flow_wake_signals",
    "metadata",
    "plan_activations",
    "record_history_sequences",
    "records",
    "runtime_outbox",
    "runtime_policies",
    "runtime_requests",
]

#: Display labels.
LABEL_LEN = 255
#: Normalized Flow version metadata (source of compilation).
MAX_FLOW_SOURCE_BYTES = 2 * 1024 * 1024
#: One runtime policy generation.
MAX_POLICY_BYTES = 64 * 1024
#: Immutable executable plan graph and contracts (§7.4 PlanPayload).
MAX_PLAN_PAYLOAD_BYTES = 4 * 1024 * 1024
#: Bounded human/diagnostic summaries: BoundSummary, DiagnosticSummary, activation attempt
#: diagnostics, attempt MetricsSummary, ReadVerificationSet, ResolutionReceipt.
MAX_SUMMARY_BYTES = 16 * 1024
#: Checkpoint context (§10.4, §17.3: no credentials).
MAX_CONTEXT_PAYLOAD_BYTES = 1024 * 1024
#: Checkpoint plan cursor (next step and control-flow position).
MAX_PLAN_CURSOR_BYTES = 4 * 1024
#: Business record field values.
MAX_RECORD_FIELDS_BYTES = 256 * 1024
#: Business event payload.
MAX_EVENT_PAYLOAD_BYTES = 64 * 1024
#: Audit record details (safe, redacted).
MAX_AUDIT_DETAILS_BYTES = 16 * 1024
#: Frozen Runtime outbox envelope (§10.7).
MAX_OUTBOX_PAYLOAD_BYTES = 256 * 1024

metadata = new_metadata()


def _id(name: str, *, nullable: bool = False) -> Column[str]:
    return Column(name, String(ID_LEN), nullable=nullable)


def _key(name: str, *, nullable: bool = False) -> Column[str]:
    """A run, step, attempt, checkpoint or record identifier, or an object API name:
    ASCII on MySQL-family servers (``services.db.AsciiId``, ADR 0015)."""
    return Column(name, AsciiId(), nullable=nullable)


def _digest(name: str, *, nullable: bool = False) -> Column[str]:
    return Column(name, String(DIGEST_LEN), nullable=nullable)


def _code(name: str, *, nullable: bool = False) -> Column[str]:
    return Column(name, String(CODE_LEN), nullable=nullable)


def _time(name: str, *, nullable: bool = False) -> Column[datetime]:
    return Column(name, UtcDateTime(), nullable=nullable)


def _bigint(name: str, *, nullable: bool = False) -> Column[int]:
    return Column(name, BigInteger, nullable=nullable)


# --- plans ---------------------------------------------------------------------------

#: Immutable Flow version metadata.
flow_versions = Table(
    "flow_versions",
    metadata,
    _id("org_id"),
    _id("flow_version_id"),
    _id("flow_id"),
    _bigint("version_number"),
    Column("source_payload", JsonText(MAX_FLOW_SOURCE_BYTES), nullable=False),
    _digest("metadata_digest"),
    _time("created_at"),
    # Display label (request label, else the source's ``label``, else the API name).
    Column("label", String(LABEL_LEN), nullable=True),
    PrimaryKeyConstraint("org_id", "flow_version_id"),
    UniqueConstraint("org_id", "flow_id", "version_number", name="uq_flow_versions_number"),
    **TABLE_OPTIONS,
)

#: Versioned runtime policies (retry, lease, admission numbers; §16.3).
runtime_policies = Table(
    "runtime_policies",
    metadata,
    _id("org_id"),
    _bigint("policy_version"),
    Column("policy_payload", JsonText(MAX_POLICY_BYTES), nullable=False),
    _digest("policy_digest"),
    _time("created_at"),
    PrimaryKeyConstraint("org_id", "policy_version"),
    **TABLE_OPTIONS,
)

#: ``FlowExecutionPlan`` (§7.4): immutable; one per identity tuple.
execution_plans = Table(
    "execution_plans",
    metadata,
    *work_scope_columns(),
    _id("plan_id"),
    _id("flow_version_id"),
    _digest("metadata_digest"),
    _id("compiler_version"),
    _id("catalog_generation_id"),
    _digest("catalog_digest"),
    # The exact RuntimeWorkBinding tuple besides the scope columns.
    _bigint("catalog_revision"),
    _bigint("schema_generation"),
    _bigint("engine_generation"),
    _digest("catalog_snapshot_digest"),
    _digest("runtime_metadata_view_digest"),
    _digest("trigger_binding_digest"),
    _bigint("policy_version"),
    _code("execution_profile"),
    _digest("plan_digest"),
    Column("plan_payload", JsonText(MAX_PLAN_PAYLOAD_BYTES), nullable=False),
    Column("bound_summary", JsonText(MAX_SUMMARY_BYTES), nullable=False),
    Column("diagnostic_summary", JsonText(MAX_SUMMARY_BYTES), nullable=False),
    _time("created_at"),
    PrimaryKeyConstraint("org_id", "plan_id"),
    # One plan per org/source/compiler/binding/catalog/trigger/policy tuple; the binding
    # digest commits installation, capability and view.
    UniqueConstraint(
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
    ForeignKeyConstraint(
        ["org_id", "flow_version_id"], ["flow_versions.org_id", "flow_versions.flow_version_id"]
    ),
    Index("ix_execution_plans_digest", "org_id", "plan_digest"),
    **TABLE_OPTIONS,
)

#: Flow-version activation bindings: own ACTIVE/SUPERSEDED/DEACTIVATED state and the
#: diagnostics of blocked activation attempts (``plan_id`` NULL, state BLOCKED); plans stay
#: immutable. At most one ACTIVE row per Flow (API name) and installation/capability: a new
#: activation of any version, under any binding digest, supersedes the previous one.
plan_activations = Table(
    "plan_activations",
    metadata,
    *work_scope_columns(),
    _id("activation_id"),
    _id("flow_version_id"),
    _id("flow_api_name"),
    _digest("trigger_binding_digest"),
    _id("plan_id", nullable=True),
    _code("state"),  # ACTIVE | SUPERSEDED | DEACTIVATED | BLOCKED
    Column("active_slot", SmallInteger, nullable=True),
    Column("attempt_diagnostics", JsonText(MAX_SUMMARY_BYTES), nullable=True),
    _bigint("state_version"),
    _time("created_at"),
    _time("activated_at", nullable=True),
    _time("superseded_at", nullable=True),
    PrimaryKeyConstraint("org_id", "activation_id"),
    UniqueConstraint(
        "org_id",
        "flow_api_name",
        "app_installation_id",
        "runtime_capability_id",
        "active_slot",
        name="uq_plan_activations_flow_active",
    ),
    ForeignKeyConstraint(
        ["org_id", "plan_id"], ["execution_plans.org_id", "execution_plans.plan_id"]
    ),
    Index("ix_plan_activations_plan", "org_id", "plan_id"),
    Index("ix_plan_activations_version", "org_id", "flow_version_id", "active_slot"),
    **TABLE_OPTIONS,
)

# --- Flow runs and lifecycle rows ----------------------------------------------------

#: FlowRun (§10.1): the evolved interview root. Defaults are the §20.2 legacy-safe values;
#: V2 writers always insert owner, epoch and version explicitly.
flow_runs = Table(
    "flow_runs",
    metadata,
    *work_scope_columns(),
    _key("flow_run_id"),
    _id("flow_version_id"),
    # NULL only on a LegacyInterpreter-owned run (no compiled plan; revision 0009).
    _id("plan_id", nullable=True),
    _code("execution_profile"),
    Column("execution_owner", String(CODE_LEN), nullable=False, server_default="LegacyInterpreter"),
    _code("runtime_state"),
    _key("current_step_execution_id", nullable=True),
    _key("current_checkpoint_id", nullable=True),
    Column("state_version", BigInteger, nullable=False, server_default=text("0")),
    Column("ownership_epoch", BigInteger, nullable=False, server_default=text("0")),
    _time("run_after", nullable=True),
    _code("queue_class"),
    Column("priority", Integer, nullable=False),
    _code("terminal_cause_code", nullable=True),
    Column("is_deleted", Boolean, nullable=False, server_default=text("0")),
    _time("delete_requested_at", nullable=True),
    # Audit/legal hold (§10.1 DeleteFlowInterview step 7): physical retention refuses
    # the run while set. A retention fact, not a visibility field; revision 0006.
    Column("legal_hold", Boolean, nullable=False, server_default=text("0")),
    _time("started_at", nullable=True),
    _time("completed_at", nullable=True),
    # StartRun dedupe: same key + same request digest -> same run; different digest ->
    # conflict.
    Column("idempotency_key", String(KEY_LEN), nullable=True),
    _digest("request_digest", nullable=True),
    # Compatibility projection (§18.2), written only by the canonical V2 transition; the
    # legacy context view is derived from current_checkpoint_id.
    _code("interview_status"),  # Running | Paused | Error | Finished
    Column("current_element", String(TOKEN_LEN), nullable=True),
    _time("paused_at", nullable=True),
    _time("created_at"),
    _time("updated_at"),
    # Operator pause overlay (revision 0011, PauseRun/ResumeRun): set while an operator
    # holds the run; no claim picks a paused run. Not ``paused_at`` (the §18.2 wait time).
    _time("operator_paused_at", nullable=True),
    # §17.1 identity (revision 0012_identity), set once by StartRun / the after-save
    # trigger: who initiated the run (the verified credential's subject, never a
    # credential), the execution-principal mode and the digest of the authorization
    # context it was admitted under. NULL on runs created before the revision.
    Column("initiating_principal_id", String(TOKEN_LEN), nullable=True),
    _code("execution_principal_mode", nullable=True),
    _digest("authorization_context_digest", nullable=True),
    # The run's W3C trace context (``services.telemetry``; revision 0010): every attempt
    # and hop of the run continues this trace. Diagnostics, never in a checkpoint.
    Column("trace_context", JsonText(TRACE_CONTEXT_BYTES), nullable=True),
    # ``<object>:<record_id>`` of the record the run is about (revision 0014): the
    # after-save trigger's saved record; per-record run limits key on it
    # (``runtime_svc.admission.slots``). NULL for runs started without a record.
    Column("subject_record_key", String(KEY_LEN), nullable=True),
    # Legacy-owned field set of a LegacyInterpreter run (revision 0009, runtime_svc.legacy):
    # the interview context and the legacy scheduler's claim. NULL on V2 runs.
    Column("legacy_context", JsonText(MAX_CONTEXT_PAYLOAD_BYTES), nullable=True),
    Column("legacy_claimed_by", String(TOKEN_LEN), nullable=True),
    _time("legacy_claim_until", nullable=True),
    PrimaryKeyConstraint("org_id", "flow_run_id"),
    UniqueConstraint("org_id", "idempotency_key", name="uq_flow_runs_idempotency"),
    ForeignKeyConstraint(
        ["org_id", "plan_id"], ["execution_plans.org_id", "execution_plans.plan_id"]
    ),
    Index(
        "ix_flow_runs_claim", "org_id", "runtime_state", "run_after", "queue_class", "flow_run_id"
    ),
    Index("ix_flow_runs_migration", "org_id", "ownership_epoch", "runtime_state"),
    Index("ix_flow_runs_plan", "org_id", "plan_id"),
    Index("ix_flow_runs_history", "org_id", "flow_version_id", "created_at", "flow_run_id"),
    # The wait repair sweep's bounded cursor over Waiting roots (revision 0008).
    Index("ix_flow_runs_state_id", "org_id", "runtime_state", "flow_run_id"),
    # §20.3 (6): the legacy due-list filters (org, owner, epoch, legacy status, time).
    Index(
        "ix_flow_runs_legacy_due",
        "org_id",
        "execution_owner",
        "ownership_epoch",
        "interview_status",
        "run_after",
        "flow_run_id",
    ),
    **TABLE_OPTIONS,
)

#: FlowStepExecution (§10.2): one logical step invocation. The support-diagnostics lookup
#: (org, run, plan step) is served by the invocation unique key's prefix.
flow_step_executions = Table(
    "flow_step_executions",
    metadata,
    _id("org_id"),
    _key("step_execution_id"),
    _key("flow_run_id"),
    Column("plan_step_key", String(TOKEN_LEN), nullable=False),
    _bigint("invocation_ordinal"),
    _code("step_kind"),
    _code("state"),
    _key("input_checkpoint_id", nullable=True),
    _key("output_checkpoint_id", nullable=True),
    _bigint("state_version"),
    Column("attempt_count", Integer, nullable=False),
    Column("lease_owner", String(TOKEN_LEN), nullable=True),
    Column("lease_token", String(TOKEN_LEN), nullable=True),
    _time("lease_until", nullable=True),
    _bigint("ownership_epoch"),
    _time("run_after", nullable=True),
    _code("queue_class"),
    _code("failure_class", nullable=True),
    _time("created_at"),
    _time("updated_at"),
    PrimaryKeyConstraint("org_id", "step_execution_id"),
    UniqueConstraint(
        "org_id",
        "flow_run_id",
        "plan_step_key",
        "invocation_ordinal",
        name="uq_flow_step_executions_invocation",
    ),
    ForeignKeyConstraint(["org_id", "flow_run_id"], ["flow_runs.org_id", "flow_runs.flow_run_id"]),
    Index(
        "ix_flow_step_executions_claim",
        "org_id",
        "state",
        "queue_class",
        "run_after",
        "step_execution_id",
    ),
    Index("ix_flow_step_executions_lease", "org_id", "lease_until"),
    **TABLE_OPTIONS,
)

#: FlowStepAttempt (§10.3): identity and inputs immutable; the outcome columns change once,
#: Started -> terminal, fenced by ``attempt_state_version``.
flow_step_attempts = Table(
    "flow_step_attempts",
    metadata,
    _id("org_id"),
    _key("attempt_id"),
    _key("step_execution_id"),
    Column("attempt_number", Integer, nullable=False),
    _digest("lease_token_digest"),
    _bigint("ownership_epoch"),
    _bigint("root_state_version_at_claim"),
    _time("started_at"),
    _time("finished_at", nullable=True),
    _code("transaction_outcome"),  # Started | Committed | RolledBack | CommitUnknown | ...
    _code("failure_class", nullable=True),
    Column("safe_error_code", String(ID_LEN), nullable=True),
    _code("retry_decision", nullable=True),
    _digest("retry_policy_digest"),
    _bigint("recovery_backoff_floor_ms"),
    _bigint("attempt_state_version"),
    _digest("plan_digest"),
    _digest("lock_plan_digest"),
    Column("trace_id", String(ID_LEN), nullable=True),
    Column("metrics_summary", JsonText(MAX_SUMMARY_BYTES), nullable=True),
    PrimaryKeyConstraint("org_id", "attempt_id"),
    UniqueConstraint(
        "org_id", "step_execution_id", "attempt_number", name="uq_flow_step_attempts_number"
    ),
    ForeignKeyConstraint(
        ["org_id", "step_execution_id"],
        ["flow_step_executions.org_id", "flow_step_executions.step_execution_id"],
    ),
    **TABLE_OPTIONS,
)

#: FlowCheckpoint (§10.4): immutable.
flow_checkpoints = Table(
    "flow_checkpoints",
    metadata,
    _id("org_id"),
    _key("checkpoint_id"),
    _key("flow_run_id"),
    _bigint("sequence"),
    Column("plan_cursor", JsonText(MAX_PLAN_CURSOR_BYTES), nullable=False),
    Column("context_schema_version", Integer, nullable=False),
    Column("context_payload", JsonText(MAX_CONTEXT_PAYLOAD_BYTES), nullable=False),
    _digest("context_digest"),
    Column("read_verification_set", JsonText(MAX_SUMMARY_BYTES), nullable=True),
    _key("created_by_attempt_id", nullable=True),
    _time("created_at"),
    PrimaryKeyConstraint("org_id", "checkpoint_id"),
    UniqueConstraint("org_id", "flow_run_id", "sequence", name="uq_flow_checkpoints_sequence"),
    ForeignKeyConstraint(["org_id", "flow_run_id"], ["flow_runs.org_id", "flow_runs.flow_run_id"]),
    **TABLE_OPTIONS,
)

#: FlowDependency (§10.5): at most one active per (work scope, waiting step).
flow_dependencies = Table(
    "flow_dependencies",
    metadata,
    *work_scope_columns(),
    _id("dependency_id"),
    _key("flow_run_id"),
    _key("step_execution_id"),
    _id("producer_kind"),
    Column("producer_key", String(KEY_LEN), nullable=False),
    _digest("condition_digest"),
    _code("state"),  # Pending | Resolved | Expired | Quarantined | Cancelled
    Column("active_slot", SmallInteger, nullable=True),
    _bigint("state_version"),
    _bigint("wake_version", nullable=True),
    Column("wake_token", String(TOKEN_LEN), nullable=True),
    _time("deadline"),
    _time("next_probe_at", nullable=True),
    _code("expiry_policy"),  # FaultPath | TerminalFailure | Quarantine
    _time("resolved_at", nullable=True),
    Column("resolution_receipt", JsonText(MAX_SUMMARY_BYTES), nullable=True),
    _time("created_at"),
    _time("updated_at"),
    # Bounded reconciliation probes made so far (§14.4; revision 0008).
    Column("reconciliation_attempts", Integer, nullable=False, server_default=text("0")),
    # The signal the resolution consumed (NULL: none, e.g. a timer; revision 0008).
    _id("wake_signal_id", nullable=True),
    PrimaryKeyConstraint("org_id", "dependency_id"),
    UniqueConstraint(
        *WORK_SCOPE, "step_execution_id", "active_slot", name="uq_flow_dependencies_active"
    ),
    ForeignKeyConstraint(
        ["org_id", "step_execution_id"],
        ["flow_step_executions.org_id", "flow_step_executions.step_execution_id"],
    ),
    Index("ix_flow_dependencies_step", "org_id", "step_execution_id"),
    Index("ix_flow_dependencies_producer", *WORK_SCOPE, "producer_kind", "producer_key", "state"),
    Index("ix_flow_dependencies_deadline", "org_id", "state", "deadline"),
    Index("ix_flow_dependencies_probe", "org_id", "state", "next_probe_at"),
    # The oldest pending dependency per org, one index seek (metrics; revision 0010).
    Index("ix_flow_dependencies_age", "org_id", "state", "created_at"),
    **TABLE_OPTIONS,
)

#: FlowWakeSignal (§10.6): durable receipt of a producer notification, independent of
#: whether a dependency exists yet. Producer identity/token/version/evidence immutable.
flow_wake_signals = Table(
    "flow_wake_signals",
    metadata,
    *work_scope_columns(),
    _id("wake_signal_id"),
    _id("producer_kind"),
    Column("producer_key", String(KEY_LEN), nullable=False),
    Column("wake_token", String(TOKEN_LEN), nullable=False),
    _bigint("wake_version", nullable=True),
    _digest("evidence_digest"),
    Column("evidence_reference", String(KEY_LEN), nullable=True),
    _time("received_at"),
    _time("expires_at"),
    _code("resolution_state"),  # Unmatched | Consumed | Expired
    _id("dependency_id", nullable=True),
    _bigint("state_version"),
    # Revision 0008: the safe producer evidence (canonical JSON object, immutable), the
    # producer-side match still owed (set at insert, cleared once a match attempt ran:
    # a crash between signal commit and match leaves it for the repair sweep), and the
    # consume time.
    Column("evidence_json", JsonText(MAX_SUMMARY_BYTES), nullable=True),
    _time("next_match_at", nullable=True),
    _time("consumed_at", nullable=True),
    # The producer's W3C trace context (revision 0010): the resolution continues the
    # trace that delivered the signal. Diagnostics, outside the immutable evidence.
    Column("trace_context", JsonText(TRACE_CONTEXT_BYTES), nullable=True),
    PrimaryKeyConstraint(*WORK_SCOPE, "wake_signal_id"),
    UniqueConstraint(
        *WORK_SCOPE,
        "producer_kind",
        "producer_key",
        "wake_token",
        name="uq_flow_wake_signals_token",
    ),
    Index("ix_flow_wake_signals_expiry", "org_id", "resolution_state", "expires_at"),
    Index("ix_flow_wake_signals_match", "org_id", "next_match_at"),
    **TABLE_OPTIONS,
)

#: Record-change producer registration (§14.1, revision 0008): the objects some plan of a
#: work scope waits on with a record-condition wait. The record engine writes a wake
#: signal for a record change only when its object is listed here (read through a
#: per-process memo, so a write of an unwatched object costs no query). A wait commit
#: refreshes its row; a maintenance sweep deletes rows idle past a window with no pending
#: dependency.
flow_record_watches = Table(
    "flow_record_watches",
    metadata,
    _id("org_id"),
    _key("object_name"),
    _id("app_installation_id"),
    _id("runtime_capability_id"),
    _digest("runtime_work_binding_digest"),
    _time("refreshed_at"),
    PrimaryKeyConstraint(
        "org_id",
        "object_name",
        "app_installation_id",
        "runtime_capability_id",
        "runtime_work_binding_digest",
    ),
    **TABLE_OPTIONS,
)

#: The canonical Runtime outbox (§10.7). ``message_family`` + ``effect_handoff_key`` is the
#: deterministic dedupe key (for ``flow.effect.submit`` the EffectHandoffKey);
#: ``effect_owner_kind`` is the trusted destination.
runtime_outbox = Table(
    "runtime_outbox",
    metadata,
    *work_scope_columns(),
    _id("runtime_outbox_message_id"),
    _id("message_family"),
    Column("effect_handoff_key", String(KEY_LEN), nullable=False),
    _id("effect_owner_kind"),
    Column("payload_schema_version", Integer, nullable=False),
    _digest("payload_digest"),
    Column("payload", JsonText(MAX_OUTBOX_PAYLOAD_BYTES), nullable=False),
    _key("flow_run_id", nullable=True),
    _key("step_execution_id", nullable=True),
    _key("submission_attempt_id", nullable=True),
    _time("deadline", nullable=True),
    _code("failure_policy", nullable=True),
    *outbox_delivery_columns(),
    _time("created_at"),
    _time("updated_at"),
    PrimaryKeyConstraint(*WORK_SCOPE, "runtime_outbox_message_id"),
    UniqueConstraint(
        *WORK_SCOPE, "message_family", "effect_handoff_key", name="uq_runtime_outbox_key"
    ),
    Index("ix_runtime_outbox_due", "org_id", "delivery_state", "next_attempt_at"),
    **TABLE_OPTIONS,
)

#: FlowEffectLink (§10.8): immutable lineage from a Flow step to its handoff message.
flow_effect_links = Table(
    "flow_effect_links",
    metadata,
    *work_scope_columns(),
    _id("effect_link_id"),
    _key("flow_run_id"),
    _key("step_execution_id"),
    _id("effect_owner_kind"),
    _id("runtime_outbox_message_id"),
    Column("effect_handoff_key", String(KEY_LEN), nullable=False),
    _key("submission_attempt_id"),
    _time("created_at"),
    PrimaryKeyConstraint(*WORK_SCOPE, "effect_link_id"),
    UniqueConstraint(*WORK_SCOPE, "effect_handoff_key", name="uq_flow_effect_links_handoff"),
    ForeignKeyConstraint(["org_id", "flow_run_id"], ["flow_runs.org_id", "flow_runs.flow_run_id"]),
    Index("ix_flow_effect_links_run", "org_id", "flow_run_id"),
    **TABLE_OPTIONS,
)

# --- record engine -------------------------------------------------------------------

#: Business records that Flows mutate; ``record_version`` is their compare-and-swap column.
records = Table(
    "records",
    metadata,
    _id("org_id"),
    _key("object_name"),
    _key("record_id"),
    _bigint("record_version"),
    Column("fields", JsonText(MAX_RECORD_FIELDS_BYTES), nullable=False),
    _key("parent_object_name", nullable=True),
    _key("parent_record_id", nullable=True),
    Column("is_deleted", Boolean, nullable=False, server_default=text("0")),
    _time("created_at"),
    _time("updated_at"),
    # Every parent ref ([{relationship, parent_object, parent_record_id}], sorted by
    # relationship); parent_object_name/parent_record_id index the first lock-relevant one.
    # NULL = none (also rows written before revision 0005).
    Column("parent_refs", JsonText(MAX_SUMMARY_BYTES), nullable=True),
    PrimaryKeyConstraint("org_id", "object_name", "record_id"),
    Index("ix_records_parent", "org_id", "parent_object_name", "parent_record_id"),
    **TABLE_OPTIONS,
)

#: Per-record history sequence, reserved under lock after the record's own lock (§13.1).
record_history_sequences = Table(
    "record_history_sequences",
    metadata,
    _id("org_id"),
    _key("object_name"),
    _key("record_id"),
    _bigint("last_sequence"),
    _time("updated_at"),
    PrimaryKeyConstraint("org_id", "object_name", "record_id"),
    ForeignKeyConstraint(
        ["org_id", "object_name", "record_id"],
        ["records.org_id", "records.object_name", "records.record_id"],
    ),
    **TABLE_OPTIONS,
)

#: Business events, ordered per record by the reserved ``history_sequence``.
business_events = Table(
    "business_events",
    metadata,
    _id("org_id"),
    _id("event_id"),
    _key("object_name"),
    _key("record_id"),
    _bigint("history_sequence"),
    _id("event_type"),
    Column("payload", JsonText(MAX_EVENT_PAYLOAD_BYTES), nullable=False),
    _key("flow_run_id", nullable=True),
    _key("step_execution_id", nullable=True),
    _key("attempt_id", nullable=True),
    _time("occurred_at"),
    # Caller request of an RPC-driven mutation (evidence: which request wrote the event).
    # The dedupe authority is ``runtime_requests``, keyed by the complete trusted scope;
    # revision 0007 dropped the org-wide unique key over these columns.
    _id("request_rpc", nullable=True),
    Column("request_id", String(KEY_LEN), nullable=True),
    _digest("request_digest", nullable=True),
    PrimaryKeyConstraint("org_id", "event_id"),
    UniqueConstraint(
        "org_id", "object_name", "record_id", "history_sequence", name="uq_business_events_sequence"
    ),
    ForeignKeyConstraint(
        ["org_id", "object_name", "record_id"],
        ["records.org_id", "records.object_name", "records.record_id"],
    ),
    Index("ix_business_events_run", "org_id", "flow_run_id"),
    **TABLE_OPTIONS,
)

#: Principal directory (§17.2, revision 0012_identity): the runtime's persisted authority
#: on whether a principal may still act and the digest of its permission state (granted
#: permissions, FLS and RLS grants, written by the org's identity sync). Each durable step
#: compares it with the run's authorization-context digest (``runtime_svc.identity``).
#: ``version`` fences every change (conditional UPDATE + rowcount).
flow_principals = Table(
    "flow_principals",
    metadata,
    _id("org_id"),
    Column("principal_id", String(TOKEN_LEN), nullable=False),
    _code("status"),  # enabled | disabled
    _digest("permission_digest"),
    _bigint("version"),
    _time("updated_at"),
    PrimaryKeyConstraint("org_id", "principal_id"),
    **TABLE_OPTIONS,
)

#: Append-only audit evidence (safe, redacted details only; §17.3).
audit_records = Table(
    "audit_records",
    metadata,
    _id("org_id"),
    _id("audit_record_id"),
    _code("actor_kind"),
    Column("actor_id", String(TOKEN_LEN), nullable=False),
    _id("action"),
    _key("object_name", nullable=True),
    _key("record_id", nullable=True),
    _key("flow_run_id", nullable=True),
    _key("step_execution_id", nullable=True),
    _key("attempt_id", nullable=True),
    Column("details", JsonText(MAX_AUDIT_DETAILS_BYTES), nullable=False),
    _time("occurred_at"),
    PrimaryKeyConstraint("org_id", "audit_record_id"),
    Index("ix_audit_records_record", "org_id", "object_name", "record_id", "occurred_at"),
    Index("ix_audit_records_run", "org_id", "flow_run_id", "occurred_at"),
    **TABLE_OPTIONS,
)


# --- admission (§16) -------------------------------------------------------------------

#: Per-key run concurrency slots (``runtime_svc.admission.slots``; revision 0013): a run
#: of a Flow with ``admission.flows.<api>.max_concurrent_runs = N`` holds one of the slots
#: ``0 .. N-1`` of its key from its first admitted claim until it is terminal. The primary
#: key makes "at most N holders" a uniqueness fact no race can exceed; the second unique
#: key keeps a run from holding two slots of one key. A terminal holder's slot is
#: reclaimed by a fenced delete (``WHERE flow_run_id = holder``).
flow_run_slots = Table(
    "flow_run_slots",
    metadata,
    _id("org_id"),
    Column("slot_key", String(KEY_LEN), nullable=False),
    Column("slot_no", Integer, nullable=False),
    _key("flow_run_id"),
    _time("acquired_at"),
    PrimaryKeyConstraint("org_id", "slot_key", "slot_no"),
    UniqueConstraint("org_id", "slot_key", "flow_run_id", name="uq_flow_run_slots_run"),
    **TABLE_OPTIONS,
)


# --- request deduplication -----------------------------------------------------------

#: Request deduplication of every mutating RPC (``services.request_dedupe``; revision
#: 0007): (complete trusted scope, rpc, request_id) -> digest of the request body and the
#: original response. Purged by the runtime's retention sweep.
runtime_requests = request_dedupe_table(metadata, "runtime_requests")
# The §20 migration-contract tables live in their own module on this metadata.
from runtime_svc import schema_bridge as _schema_bridge  # noqa: E402,F401
