"""Row values of commands, remote attempts, fences and receipts (frozen, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy.engine import RowMapping

from effect_owner_svc.commands.model import AttemptOutcome, CommandState
from effect_owner_svc.inbox.fence import FenceState, HandoffAttributes
from services.auth import TrustedRuntimeWorkScope
from services.outbox import OutboxMessage

__all__ = [
    "AttemptRecord",
    "CommandRecord",
    "FenceRecord",
    "ReceiptRecord",
    "attempt_from_row",
    "command_from_row",
    "fence_from_row",
    "receipt_from_row",
    "scope_of",
]


def scope_of(row: Any) -> TrustedRuntimeWorkScope:
    """The work scope of any row/record with the four scope attributes."""
    get = row.__getitem__ if isinstance(row, RowMapping) else row.__getattribute__
    return TrustedRuntimeWorkScope(
        get("org_id"),
        get("app_installation_id"),
        get("runtime_capability_id"),
        get("runtime_work_binding_digest"),
    )


@dataclass(frozen=True)
class FenceRecord:
    """One ``owner_inbox`` row."""

    attributes: HandoffAttributes
    state: FenceState
    command_id: str | None
    decided_at: datetime
    quarantine_count: int
    quarantine_reason: str | None


def fence_from_row(row: RowMapping) -> FenceRecord:
    return FenceRecord(
        attributes=HandoffAttributes(
            org_id=row["org_id"],
            app_installation_id=row["app_installation_id"],
            runtime_capability_id=row["runtime_capability_id"],
            runtime_work_binding_digest=row["runtime_work_binding_digest"],
            effect_handoff_key=row["effect_handoff_key"],
            runtime_outbox_message_id=row["runtime_outbox_message_id"],
            payload_digest=row["payload_digest"],
        ),
        state=FenceState(row["state"]),
        command_id=row["external_command_id"],
        decided_at=row["decided_at"],
        quarantine_count=int(row["quarantine_count"]),
        quarantine_reason=row["quarantine_reason"],
    )


@dataclass(frozen=True)
class CommandRecord:
    """One ``external_commands`` row."""

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    runtime_work_binding_digest: str
    command_id: str
    effect_handoff_key: str
    effect_owner_kind: str
    payload_schema_version: int
    payload: str
    payload_digest: str
    state: CommandState
    state_version: int
    outcome_version: int
    attempt_count: int
    reconcile_attempts: int
    next_attempt_at: datetime | None
    lease_owner: str | None
    lease_token: str | None
    lease_until: datetime | None
    runtime_outbox_message_id: str | None
    flow_run_id: str | None
    step_execution_id: str | None
    submission_attempt_id: str | None
    deadline: datetime | None
    failure_policy: str | None
    provider_idempotency_key: str
    safe_error_code: str | None
    result_digest: str | None
    created_at: datetime
    updated_at: datetime
    #: The acceptance's W3C trace context (``services.telemetry`` JSON): diagnostics only.
    trace_context: str | None = None


def command_from_row(row: RowMapping) -> CommandRecord:
    return CommandRecord(
        org_id=row["org_id"],
        app_installation_id=row["app_installation_id"],
        runtime_capability_id=row["runtime_capability_id"],
        runtime_work_binding_digest=row["runtime_work_binding_digest"],
        command_id=row["external_command_id"],
        effect_handoff_key=row["effect_handoff_key"],
        effect_owner_kind=row["effect_owner_kind"],
        payload_schema_version=int(row["payload_schema_version"]),
        payload=row["payload"],
        payload_digest=row["payload_digest"],
        state=CommandState(row["state"]),
        state_version=int(row["state_version"]),
        outcome_version=int(row["outcome_version"]),
        attempt_count=int(row["attempt_count"]),
        reconcile_attempts=int(row["reconcile_attempts"]),
        next_attempt_at=row["next_attempt_at"],
        lease_owner=row["lease_owner"],
        lease_token=row["lease_token"],
        lease_until=row["lease_until"],
        runtime_outbox_message_id=row["runtime_outbox_message_id"],
        flow_run_id=row["flow_run_id"],
        step_execution_id=row["step_execution_id"],
        submission_attempt_id=row["submission_attempt_id"],
        deadline=row["deadline"],
        failure_policy=row["failure_policy"],
        provider_idempotency_key=row["provider_idempotency_key"] or "",
        safe_error_code=row["safe_error_code"],
        result_digest=row["result_digest"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        trace_context=row.get("trace_context"),
    )


@dataclass(frozen=True)
class AttemptRecord:
    """One ``remote_attempts`` row."""

    org_id: str
    remote_attempt_id: str
    command_id: str
    attempt_number: int
    provider_idempotency_key: str
    outcome: AttemptOutcome
    safe_error_code: str | None
    response_digest: str | None
    state_version: int
    started_at: datetime
    finished_at: datetime | None


def attempt_from_row(row: RowMapping) -> AttemptRecord:
    return AttemptRecord(
        org_id=row["org_id"],
        remote_attempt_id=row["remote_attempt_id"],
        command_id=row["external_command_id"],
        attempt_number=int(row["attempt_number"]),
        provider_idempotency_key=row["provider_idempotency_key"],
        outcome=AttemptOutcome(row["outcome"]),
        safe_error_code=row["safe_error_code"],
        response_digest=row["response_digest"],
        state_version=int(row["state_version"]),
        started_at=row["started_at"],
        finished_at=row["finished_at"],
    )


@dataclass(frozen=True)
class ReceiptRecord:
    """One ``completion_receipts`` row (its evidence is the wake-signal evidence)."""

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    runtime_work_binding_digest: str
    command_id: str
    outcome_version: int
    effect_handoff_key: str
    outcome: str
    evidence_json: str
    evidence_digest: str
    created_at: datetime
    #: Not a column: the owner-outbox message that delivers this receipt, when the
    #: writing transaction enqueued it pre-claimed for this process's dispatcher.
    delivery: OutboxMessage | None = field(default=None, compare=False, repr=False)


def receipt_from_row(row: RowMapping) -> ReceiptRecord:
    return ReceiptRecord(
        org_id=row["org_id"],
        app_installation_id=row["app_installation_id"],
        runtime_capability_id=row["runtime_capability_id"],
        runtime_work_binding_digest=row["runtime_work_binding_digest"],
        command_id=row["external_command_id"],
        outcome_version=int(row["outcome_version"]),
        effect_handoff_key=row["effect_handoff_key"],
        outcome=row["outcome"],
        evidence_json=row["outcome_payload"] or "",
        evidence_digest=row["outcome_digest"],
        created_at=row["created_at"],
    )
