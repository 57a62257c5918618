"""Decoding of the four lifecycle tables' rows into the kernel's frozen records (enum
columns hold the spec's PascalCase codes; see :class:`~runtime_svc.kernel.states.CodedEnum`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime_svc.kernel.model import AttemptRecord, CheckpointMeta, RunRecord, StepRecord
from runtime_svc.kernel.states import (
    AttemptOutcome,
    ExecutionOwner,
    FailureClass,
    RetryDecision,
    RunState,
    StepState,
)

__all__ = [
    "ATTEMPT_COLUMNS",
    "RUN_COLUMNS",
    "STEP_COLUMNS",
    "attempt_from_row",
    "checkpoint_meta_from_row",
    "run_from_row",
    "step_from_row",
]

#: The ``flow_runs`` columns :func:`run_from_row` reads — a lock read selects exactly
#: these (the legacy bridge, principal and retention columns are never decoded: 32 of
#: 39 column descriptors per root read, issue 13 round 7).
RUN_COLUMNS: tuple[str, ...] = (
    "org_id",
    "flow_run_id",
    "app_installation_id",
    "runtime_capability_id",
    "runtime_work_binding_digest",
    "flow_version_id",
    "plan_id",
    "execution_profile",
    "execution_owner",
    "runtime_state",
    "state_version",
    "ownership_epoch",
    "current_step_execution_id",
    "current_checkpoint_id",
    "run_after",
    "queue_class",
    "priority",
    "terminal_cause_code",
    "is_deleted",
    "delete_requested_at",
    "started_at",
    "completed_at",
    "idempotency_key",
    "request_digest",
    "interview_status",
    "current_element",
    "paused_at",
    "created_at",
    "updated_at",
    "trace_context",
    "operator_paused_at",
)
#: The ``flow_step_executions`` columns :func:`step_from_row` reads (all of them).
STEP_COLUMNS: tuple[str, ...] = (
    "org_id",
    "step_execution_id",
    "flow_run_id",
    "plan_step_key",
    "invocation_ordinal",
    "step_kind",
    "state",
    "input_checkpoint_id",
    "output_checkpoint_id",
    "state_version",
    "attempt_count",
    "lease_owner",
    "lease_token",
    "lease_until",
    "ownership_epoch",
    "run_after",
    "queue_class",
    "failure_class",
    "created_at",
    "updated_at",
)
#: The ``flow_step_attempts`` columns :func:`attempt_from_row` reads (all but the
#: metrics summary, which only the commit writes and support reads decode).
ATTEMPT_COLUMNS: tuple[str, ...] = (
    "org_id",
    "attempt_id",
    "step_execution_id",
    "attempt_number",
    "lease_token_digest",
    "ownership_epoch",
    "root_state_version_at_claim",
    "started_at",
    "finished_at",
    "transaction_outcome",
    "failure_class",
    "safe_error_code",
    "retry_decision",
    "retry_policy_digest",
    "recovery_backoff_floor_ms",
    "attempt_state_version",
    "plan_digest",
    "lock_plan_digest",
    "trace_id",
)


def _opt(enum_type: Any, code: str | None) -> Any:
    return None if code is None else enum_type.from_code(code)


def run_from_row(r: Mapping[Any, Any]) -> RunRecord:
    """Decode one ``flow_runs`` row."""
    return RunRecord(
        org_id=r["org_id"],
        flow_run_id=r["flow_run_id"],
        app_installation_id=r["app_installation_id"],
        runtime_capability_id=r["runtime_capability_id"],
        runtime_work_binding_digest=r["runtime_work_binding_digest"],
        flow_version_id=r["flow_version_id"],
        # A LegacyInterpreter-owned run has no compiled plan (NULL since revision 0009).
        plan_id=r["plan_id"] or "",
        execution_profile=r["execution_profile"],
        execution_owner=ExecutionOwner.from_code(r["execution_owner"]),
        state=RunState.from_code(r["runtime_state"]),
        state_version=r["state_version"],
        ownership_epoch=r["ownership_epoch"],
        current_step_execution_id=r["current_step_execution_id"],
        current_checkpoint_id=r["current_checkpoint_id"],
        run_after=r["run_after"],
        queue_class=r["queue_class"],
        priority=r["priority"],
        terminal_cause_code=r["terminal_cause_code"],
        is_deleted=bool(r["is_deleted"]),
        delete_requested_at=r["delete_requested_at"],
        started_at=r["started_at"],
        completed_at=r["completed_at"],
        idempotency_key=r["idempotency_key"],
        request_digest=r["request_digest"],
        interview_status=r["interview_status"],
        current_element=r["current_element"],
        paused_at=r["paused_at"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        trace_context=r.get("trace_context"),
        operator_paused_at=r.get("operator_paused_at"),
    )


def step_from_row(r: Mapping[Any, Any]) -> StepRecord:
    """Decode one ``flow_step_executions`` row."""
    return StepRecord(
        org_id=r["org_id"],
        step_execution_id=r["step_execution_id"],
        flow_run_id=r["flow_run_id"],
        plan_step_key=r["plan_step_key"],
        invocation_ordinal=r["invocation_ordinal"],
        step_kind=r["step_kind"],
        state=StepState.from_code(r["state"]),
        input_checkpoint_id=r["input_checkpoint_id"],
        output_checkpoint_id=r["output_checkpoint_id"],
        state_version=r["state_version"],
        attempt_count=r["attempt_count"],
        lease_owner=r["lease_owner"],
        lease_token_digest=r["lease_token"],
        lease_until=r["lease_until"],
        ownership_epoch=r["ownership_epoch"],
        run_after=r["run_after"],
        queue_class=r["queue_class"],
        failure_class=_opt(FailureClass, r["failure_class"]),
        created_at=r["created_at"],
        updated_at=r["updated_at"],
    )


def attempt_from_row(r: Mapping[Any, Any]) -> AttemptRecord:
    """Decode one ``flow_step_attempts`` row."""
    return AttemptRecord(
        org_id=r["org_id"],
        attempt_id=r["attempt_id"],
        step_execution_id=r["step_execution_id"],
        attempt_number=r["attempt_number"],
        lease_token_digest=r["lease_token_digest"],
        ownership_epoch=r["ownership_epoch"],
        root_state_version_at_claim=r["root_state_version_at_claim"],
        started_at=r["started_at"],
        finished_at=r["finished_at"],
        outcome=AttemptOutcome.from_code(r["transaction_outcome"]),
        failure_class=_opt(FailureClass, r["failure_class"]),
        safe_error_code=r["safe_error_code"],
        retry_decision=_opt(RetryDecision, r["retry_decision"]),
        retry_policy_digest=r["retry_policy_digest"],
        recovery_backoff_floor_ms=r["recovery_backoff_floor_ms"],
        attempt_state_version=r["attempt_state_version"],
        plan_digest=r["plan_digest"],
        lock_plan_digest=r["lock_plan_digest"],
        trace_id=r["trace_id"],
    )


def checkpoint_meta_from_row(r: Mapping[Any, Any]) -> CheckpointMeta:
    """Decode checkpoint metadata (never the payload)."""
    return CheckpointMeta(
        checkpoint_id=r["checkpoint_id"],
        flow_run_id=r["flow_run_id"],
        sequence=r["sequence"],
        context_schema_version=r["context_schema_version"],
        context_digest=r["context_digest"],
        created_by_attempt_id=r["created_by_attempt_id"],
        created_at=r["created_at"],
    )
