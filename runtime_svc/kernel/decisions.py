"""Decision values returned by the pure transition functions (STYLE 5), their inputs,
and the shared fence revalidation. Domain outcomes are values, not exceptions: the store
applies a decision's :class:`~runtime_svc.kernel.model.Transition` with compare-and-swap
updates, and turns :class:`FenceLost` into :class:`~services.errors.FenceLostError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from runtime_svc.kernel.errors import TransitionInputError
from runtime_svc.kernel.model import AttemptRecord, LeaseFence, RunRecord, StepRecord, Transition
from runtime_svc.kernel.states import (
    AttemptOutcome,
    ExecutionOwner,
    FailureClass,
    RunState,
    StepState,
)

__all__ = [
    "ATTEMPTS",
    "RUNS",
    "STEPS",
    "Advance",
    "AlreadyCommitted",
    "CancelCompleted",
    "CancelRecorded",
    "CancelWon",
    "ClaimRequest",
    "Claimed",
    "Committed",
    "EnterWait",
    "FailRun",
    "FenceLost",
    "FinishRun",
    "HandOff",
    "LeaseExtended",
    "NextStep",
    "NoChange",
    "NotEligible",
    "QuarantineRun",
    "Quarantined",
    "Recovered",
    "RecoveryTerminal",
    "RetryExhausted",
    "RetryScheduled",
    "Started",
    "StepFailure",
    "Tombstoned",
    "WaitExpired",
    "WaitResolved",
    "revalidate_fence",
    "validate_fence_input",
]

#: Entity names used in fence errors (the table names, as ``cas_update`` reports them).
RUNS, STEPS, ATTEMPTS = "flow_runs", "flow_step_executions", "flow_step_attempts"


# --- inputs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimRequest:
    """What the scheduler brings to a claim (§12.1 steps 3-5).

    ``expected_*_version`` are the versions the non-locking candidate lookup saw; a
    mismatch under lock means someone else moved first (``NotEligible("superseded")``).
    """

    attempt_id: str
    lease_owner: str
    lease_token_digest: str
    ownership_epoch: int
    plan_digest: str
    lock_plan_digest: str
    trace_id: str | None = None
    expected_root_version: int | None = None
    expected_step_version: int | None = None


@dataclass(frozen=True)
class NextStep:
    """Advance the root to a new ``Pending`` step that starts from the output checkpoint."""

    step_execution_id: str
    plan_step_key: str
    step_kind: str
    queue_class: str
    invocation_ordinal: int = 0


@dataclass(frozen=True)
class FinishRun:
    """The committed step ends the run successfully."""


@dataclass(frozen=True)
class FailRun:
    """The committed step (``Terminal(failed)``, explicit fault) ends the run as failed."""

    cause_code: str


@dataclass(frozen=True)
class EnterWait:
    """The committed step waits on a dependency the caller inserts in the same
    transaction (§14); step and root become ``Waiting``."""


@dataclass(frozen=True)
class HandOff:
    """An ``EffectSubmit`` commit (§15.1 step 5): the submit step ``Succeeded``, its
    ``EffectCompletion`` step created directly in ``Waiting`` (on the dependency the
    caller inserts in the same transaction) and the root ``Waiting`` pointing at it.

    The completion step's identity is computed before the transaction (deterministic
    from the ``EffectHandoffKey``), so every retry of the submit names the same step.
    """

    step_execution_id: str
    plan_step_key: str
    step_kind: str
    queue_class: str
    invocation_ordinal: int = 0


@dataclass(frozen=True)
class QuarantineRun:
    """The committed step ends the run ``Quarantined`` (step ``Quarantined``): an
    ``EffectCompletion`` whose receipt is ``OUTCOME_UNKNOWN`` under a quarantine
    policy, or whose receipt or link does not validate (§15.2, §15.3)."""

    cause_code: str


#: How a successful commit advances the root.
Advance = NextStep | FinishRun | FailRun | EnterWait | HandOff | QuarantineRun


@dataclass(frozen=True)
class StepFailure:
    """A classified failure after a proven rollback or before the transaction began.

    Attributes:
        failure_class: ``RETRYABLE`` (may retry) or ``TERMINAL``.
        safe_error_code: stable, non-sensitive diagnostic code.
        outcome: ``ROLLED_BACK`` or ``PRE_TRANSACTION_FAILED``.
        min_delay_ms: a longer delay for this failure class (never below the floor).
        evidence: safe codes and digests recorded on the attempt (its metrics summary),
            e.g. a late discovery's resource-class mismatch and expanded lock plan.
    """

    failure_class: FailureClass
    safe_error_code: str
    outcome: AttemptOutcome = AttemptOutcome.ROLLED_BACK
    min_delay_ms: int = 0
    evidence: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.outcome not in (AttemptOutcome.ROLLED_BACK, AttemptOutcome.PRE_TRANSACTION_FAILED):
            raise TransitionInputError(
                "only a proven rollback or a pre-transaction failure may be recorded here",
                field="outcome",
            )
        if self.failure_class not in (FailureClass.RETRYABLE, FailureClass.TERMINAL):
            raise TransitionInputError(
                "a rollback is RETRYABLE or TERMINAL; ambiguity goes to quarantine",
                field="failure_class",
            )
        if self.min_delay_ms < 0:
            raise TransitionInputError("min_delay_ms must not be negative", field="min_delay_ms")


# --- outcomes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NotEligible:
    """The candidate cannot be claimed now; ``reason`` is a stable code."""

    reason: str


@dataclass(frozen=True)
class FenceLost:
    """The caller's fence no longer matches the locked row."""

    entity: str
    key: str
    reason: str
    expected_version: int
    found_version: int | None


@dataclass(frozen=True)
class NoChange:
    """Nothing to write (an idempotent repeat, or nothing to recover); ``reason`` says why."""

    reason: str


@dataclass(frozen=True)
class Claimed:
    """Root ``Runnable -> Running``, step ``-> Claimed``, a new ``Started`` attempt."""

    transition: Transition
    lease_until: datetime
    root_state_version: int
    step_state_version: int
    attempt_number: int
    recovery_backoff_floor_ms: int

    def fence(
        self, org_id: str, flow_run_id: str, step: StepRecord, request: ClaimRequest, token: str
    ) -> LeaseFence:
        """The worker's fence for this claim; ``token`` is the raw lease token whose
        digest ``request`` carried (it exists nowhere else)."""
        return LeaseFence(
            org_id=org_id,
            flow_run_id=flow_run_id,
            step_execution_id=step.step_execution_id,
            attempt_id=request.attempt_id,
            attempt_number=self.attempt_number,
            lease_owner=request.lease_owner,
            lease_token=token,
            ownership_epoch=request.ownership_epoch,
            root_state_version=self.root_state_version,
            step_state_version=self.step_state_version,
            attempt_state_version=0,
            input_checkpoint_id=step.input_checkpoint_id,
            lease_until=self.lease_until,
        )


@dataclass(frozen=True)
class Started:
    """Step ``Claimed -> Running``; ``step_state_version`` is the final commit fence."""

    transition: Transition
    step_state_version: int


@dataclass(frozen=True)
class LeaseExtended:
    """A heartbeat: new ``lease_until``, no version change (the commit fence stays)."""

    lease_until: datetime


@dataclass(frozen=True)
class Committed:
    """The final fenced commit: attempt ``Committed``, step ``Succeeded``/``Waiting``,
    root advanced."""

    transition: Transition
    run_state: RunState


@dataclass(frozen=True)
class RetryScheduled:
    """Proven rollback: attempt terminal, step ``RetryScheduled``, root ``Runnable``."""

    transition: Transition
    run_after: datetime
    delay_ms: int


@dataclass(frozen=True)
class RetryExhausted:
    """No retry permitted: step ``Failed``, root ``TerminalFailed``."""

    transition: Transition
    cause_code: str


@dataclass(frozen=True)
class CancelWon:
    """Cancellation already fenced this attempt; the step is never rescheduled."""


@dataclass(frozen=True)
class AlreadyCommitted:
    """The attempt's commit is durable (the outcome marker says ``Committed``)."""


@dataclass(frozen=True)
class Recovered:
    """Expired lease fenced: attempt ``Fenced``, step ``RetryScheduled`` with
    ``run_after >= recovery_observed_at + RecoveryBackoffFloor``, root ``Runnable``."""

    transition: Transition
    run_after: datetime
    recovery_observed_at: datetime


@dataclass(frozen=True)
class RecoveryTerminal:
    """Lease-expiry or attempt budget spent: the terminal policy signal of §12.3."""

    transition: Transition
    cause_code: str


@dataclass(frozen=True)
class Quarantined:
    """Commit/rollback outcome unknown: attempt, step and root quarantined, no retry."""

    transition: Transition


@dataclass(frozen=True)
class CancelRecorded:
    """Root ``-> CancelRequested`` with the active step and ``Started`` attempt fenced."""

    transition: Transition


@dataclass(frozen=True)
class Tombstoned:
    """Only the soft-delete fact was recorded (terminal or already-cancelling run)."""

    transition: Transition


@dataclass(frozen=True)
class CancelCompleted:
    """Cleanup done: root (and step) ``Cancelled``."""

    transition: Transition


@dataclass(frozen=True)
class WaitResolved:
    """Step ``Waiting -> Pending`` and root ``Waiting -> Runnable`` together (§18.2)."""

    transition: Transition


@dataclass(frozen=True)
class WaitExpired:
    """Dependency expired under a terminal or quarantine policy."""

    transition: Transition
    cause_code: str


# --- fence validation --------------------------------------------------------------------


def validate_fence_input(org_id: str, fence: LeaseFence) -> None:
    """Reject a malformed fence before any SQL (§10.1: a caller without the expected
    owner/epoch/version is rejected before SQL execution).

    Raises:
        TransitionInputError: wrong org, epoch < 1, missing token or bad versions.
    """
    if fence.org_id != org_id:
        raise TransitionInputError("fence belongs to another org", field="org_id")
    if fence.ownership_epoch < 1:
        raise TransitionInputError("V2 transitions need an ownership epoch >= 1", field="epoch")
    if not fence.lease_token:
        raise TransitionInputError("fence has no lease token", field="lease_token")
    if min(fence.root_state_version, fence.step_state_version, fence.attempt_state_version) < 0:
        raise TransitionInputError("fence versions must not be negative", field="state_version")


def revalidate_fence(
    root: RunRecord,
    step: StepRecord,
    attempt: AttemptRecord,
    fence: LeaseFence,
    *,
    step_states: frozenset[StepState],
) -> FenceLost | None:
    """Compare the locked root, step and attempt with the worker's fence (§12.2 steps 9-10).

    Returns None when every component still matches, else the first mismatch, root first.
    """
    digest = fence.token_digest
    skey = step.step_execution_id
    # The checks in their order; the first that fails names the mismatch. Only that one
    # builds its FenceLost (a commit that holds its fence builds none).
    run = (
        (root.execution_owner is not ExecutionOwner.FLOW_RUNTIME_V2, "owner"),
        (root.ownership_epoch != fence.ownership_epoch, "epoch"),
        (root.state is RunState.CANCEL_REQUESTED, "cancel_requested"),
        (root.is_deleted or root.delete_requested_at is not None, "deleted"),
        (root.state is not RunState.RUNNING, "root_not_running"),
        (root.state_version != fence.root_state_version, "root_version"),
        (root.current_step_execution_id != skey, "current_step"),
    )
    for failed, reason in run:
        if failed:
            return FenceLost(
                RUNS, root.flow_run_id, reason, fence.root_state_version, root.state_version
            )
    steps = (
        (step.flow_run_id != root.flow_run_id, "other_run"),
        (step.state not in step_states, "step_state"),
        (step.ownership_epoch != fence.ownership_epoch, "epoch"),
        (step.lease_token_digest != digest, "lease_token"),
        (step.state_version != fence.step_state_version, "step_version"),
    )
    for failed, reason in steps:
        if failed:
            return FenceLost(STEPS, skey, reason, fence.step_state_version, step.state_version)
    attempts = (
        (attempt.step_execution_id != skey, "other_step"),
        (attempt.outcome is not AttemptOutcome.STARTED, "attempt_terminal"),
        (attempt.attempt_state_version != fence.attempt_state_version, "version"),
        (attempt.lease_token_digest != digest, "lease_token"),
        (attempt.ownership_epoch != fence.ownership_epoch, "epoch"),
        (attempt.root_state_version_at_claim != root.state_version, "root_version_at_claim"),
    )
    for failed, reason in attempts:
        if failed:
            return FenceLost(
                ATTEMPTS,
                attempt.attempt_id,
                reason,
                fence.attempt_state_version,
                attempt.attempt_state_version,
            )
    return None
