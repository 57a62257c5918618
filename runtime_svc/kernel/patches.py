"""Helpers shared by the transition modules: fenced patch builders, the stable terminal
cause codes, and the step-state groups. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from runtime_svc.kernel.model import (
    KEEP,
    AttemptPatch,
    AttemptRecord,
    RunPatch,
    RunRecord,
    StepPatch,
    StepRecord,
    Transition,
)
from runtime_svc.kernel.states import (
    AttemptOutcome,
    FailureClass,
    RetryDecision,
    RunState,
    StepState,
)
from services.digest import canonical_json

__all__ = [
    "CAUSE_CANCELLED",
    "CAUSE_COMMIT_UNKNOWN",
    "CAUSE_DEPENDENCY_AMBIGUOUS",
    "CAUSE_DEPENDENCY_EXPIRED",
    "CAUSE_LEASE_EXPIRY_LIMIT",
    "CAUSE_RETRY_EXHAUSTED",
    "CAUSE_ROLLBACK_UNKNOWN",
    "CAUSE_STEP_FAILED",
    "CLAIMABLE",
    "LEASED",
    "NO_LEASE",
    "ms",
    "patch_attempt",
    "patch_root",
    "patch_step",
    "terminal_failure",
]

# Stable, safe terminal cause codes (``flow_runs.terminal_cause_code``, §10.1, §19).
CAUSE_RETRY_EXHAUSTED = "retry_budget_exhausted"
CAUSE_STEP_FAILED = "step_failed"
CAUSE_LEASE_EXPIRY_LIMIT = "lease_expiry_limit"
CAUSE_COMMIT_UNKNOWN = "commit_outcome_unknown"
CAUSE_ROLLBACK_UNKNOWN = "rollback_outcome_unknown"
CAUSE_CANCELLED = "cancelled"
CAUSE_DEPENDENCY_EXPIRED = "dependency_expired"
CAUSE_DEPENDENCY_AMBIGUOUS = "dependency_ambiguous"

#: Step states a claim may take.
CLAIMABLE = frozenset({StepState.PENDING, StepState.RETRY_SCHEDULED})
#: Step states that hold a lease.
LEASED = frozenset({StepState.CLAIMED, StepState.RUNNING})


def ms(value: int) -> timedelta:
    """Milliseconds as a ``timedelta``."""
    return timedelta(milliseconds=value)


def patch_root(root: RunRecord, to: RunState, **changes: object) -> RunPatch:
    """A patch of ``root`` fenced on its own version, state and epoch."""
    return RunPatch(
        flow_run_id=root.flow_run_id,
        expected_version=root.state_version,
        from_state=root.state,
        to_state=to,
        expect_epoch=root.ownership_epoch,
        **changes,  # type: ignore[arg-type]
    )


def patch_step(step: StepRecord, to: StepState, **changes: object) -> StepPatch:
    """A patch of ``step`` fenced on its version, state, epoch and current lease digest."""
    return StepPatch(
        step_execution_id=step.step_execution_id,
        expected_version=step.state_version,
        from_state=step.state,
        to_state=to,
        expect_epoch=step.ownership_epoch,
        expect_lease_token_digest=step.lease_token_digest,
        **changes,  # type: ignore[arg-type]
    )


def patch_attempt(
    attempt: AttemptRecord,
    to: AttemptOutcome,
    now: datetime,
    *,
    failure_class: FailureClass | None,
    retry: RetryDecision,
    safe_error_code: str | None = None,
    evidence: Mapping[str, Any] | None = None,
) -> AttemptPatch:
    """``Started -> to`` fenced on attempt version, lease digest, epoch, root-at-claim;
    ``evidence`` (safe codes and digests only) becomes the attempt's metrics summary."""
    return AttemptPatch(
        attempt_id=attempt.attempt_id,
        expected_version=attempt.attempt_state_version,
        to_state=to,
        expect_lease_token_digest=attempt.lease_token_digest,
        expect_epoch=attempt.ownership_epoch,
        expect_root_state_version_at_claim=attempt.root_state_version_at_claim,
        failure_class=failure_class,
        safe_error_code=safe_error_code,
        retry_decision=retry,
        finished_at=now,
        metrics_summary=KEEP if evidence is None else canonical_json(evidence).decode(),
    )


#: Patch fields that drop a step's lease.
NO_LEASE: dict[str, object] = {
    "lease_owner": None,
    "lease_token_digest": None,
    "lease_until": None,
}


def terminal_failure(
    root: RunRecord,
    step: StepRecord,
    attempt: AttemptRecord,
    now: datetime,
    outcome: AttemptOutcome,
    failure_class: FailureClass,
    safe_error_code: str | None,
    cause: str,
    evidence: Mapping[str, Any] | None = None,
) -> Transition:
    """Attempt ``outcome`` (retry ``Terminal``), step ``Failed``, root ``TerminalFailed``."""
    return Transition(
        run=patch_root(
            root,
            RunState.TERMINAL_FAILED,
            expect_current_step=step.step_execution_id,
            run_after=None,
            completed_at=now,
            terminal_cause_code=cause,
        ),
        step=patch_step(
            step, StepState.FAILED, run_after=None, failure_class=failure_class, **NO_LEASE
        ),
        attempt=patch_attempt(
            attempt,
            outcome,
            now,
            failure_class=failure_class,
            retry=RetryDecision.TERMINAL,
            safe_error_code=safe_error_code,
            evidence=evidence,
        ),
    )
