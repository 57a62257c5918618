"""Pure transition functions for recovery (§12.4), outcome ambiguity (§5.2, §13.4),
cancellation/delete (§10.1, §11.1) and dependency waits (§14, §18.2). Re-exported by
:mod:`runtime_svc.kernel.transitions`, which documents the arrow coverage."""

from __future__ import annotations

from datetime import datetime

from runtime_svc.kernel.decisions import (
    AlreadyCommitted,
    CancelCompleted,
    CancelRecorded,
    CancelWon,
    FenceLost,
    NoChange,
    Quarantined,
    Recovered,
    RecoveryTerminal,
    Tombstoned,
    WaitExpired,
    WaitResolved,
    revalidate_fence,
)
from runtime_svc.kernel.errors import TransitionInputError
from runtime_svc.kernel.model import (
    KEEP,
    AttemptPatch,
    AttemptRecord,
    LeaseFence,
    RunRecord,
    StepPatch,
    StepRecord,
    Transition,
)
from runtime_svc.kernel.patches import (
    CAUSE_CANCELLED,
    CAUSE_COMMIT_UNKNOWN,
    CAUSE_DEPENDENCY_AMBIGUOUS,
    CAUSE_DEPENDENCY_EXPIRED,
    CAUSE_LEASE_EXPIRY_LIMIT,
    CAUSE_RETRY_EXHAUSTED,
    CAUSE_ROLLBACK_UNKNOWN,
    CLAIMABLE,
    LEASED,
    NO_LEASE,
    ms,
    patch_attempt,
    patch_root,
    patch_step,
    terminal_failure,
)
from runtime_svc.kernel.policy import RetryPolicy
from runtime_svc.kernel.states import (
    ACTIVE_RUN_STATES,
    TERMINAL_RUN_STATES,
    AttemptOutcome,
    FailureClass,
    RetryDecision,
    RunState,
    StepState,
)

__all__ = [
    "decide_cancel",
    "decide_cancel_cleanup",
    "decide_commit_unknown",
    "decide_recovery",
    "decide_resolve_wait",
    "decide_wait_expired",
]


# --- recovery and ambiguity --------------------------------------------------------------


def decide_recovery(
    root: RunRecord,
    step: StepRecord,
    attempt: AttemptRecord | None,
    now: datetime,
    policy: RetryPolicy,
    prior_lease_expiries: int,
) -> Recovered | RecoveryTerminal | NoChange:
    """§12.4: fence an expired ``Claimed``/``Running`` step's ``Started`` attempt.

    ``now`` is ``RecoveryObservedAt`` (the database clock). The step becomes
    ``RetryScheduled`` with ``run_after = now + RecoveryBackoffFloor`` of the old attempt
    and the root ``Runnable`` on the same current step; once the step has been fenced
    ``policy.max_lease_expiries`` times (or its attempt budget is spent) the next expiry is
    terminal instead. A commit that already won, or a cancellation, leaves nothing to do.
    """
    reasons: list[tuple[bool, str]] = [
        (step.state not in LEASED, "not_recoverable"),
        (step.lease_until is None or step.lease_until > now, "lease_live"),
        (attempt is None or attempt.attempt_number != step.attempt_count, "no_started_attempt"),
        (
            root.state in (RunState.CANCEL_REQUESTED, RunState.CANCELLED) or root.is_deleted,
            "cancel_won",
        ),
    ]
    reason = next((why for failed, why in reasons if failed), None)
    if reason is not None or attempt is None:
        return NoChange(reason or "no_started_attempt")
    if attempt.outcome is not AttemptOutcome.STARTED:
        return NoChange("attempt_terminal")
    if (
        root.state is not RunState.RUNNING
        or root.state_version != attempt.root_state_version_at_claim
        or root.current_step_execution_id != step.step_execution_id
        or root.ownership_epoch != attempt.ownership_epoch
        or step.lease_token_digest != attempt.lease_token_digest
    ):
        return NoChange("root_advanced")
    expiries = prior_lease_expiries + 1
    if expiries > policy.max_lease_expiries or attempt.attempt_number >= policy.max_attempts:
        cause = (
            CAUSE_LEASE_EXPIRY_LIMIT
            if expiries > policy.max_lease_expiries
            else CAUSE_RETRY_EXHAUSTED
        )
        return RecoveryTerminal(
            terminal_failure(
                root,
                step,
                attempt,
                now,
                AttemptOutcome.FENCED,
                FailureClass.FENCED,
                "lease_expired",
                cause,
            ),
            cause_code=cause,
        )
    run_after = now + ms(attempt.recovery_backoff_floor_ms)
    return Recovered(
        Transition(
            run=patch_root(
                root,
                RunState.RUNNABLE,
                expect_current_step=step.step_execution_id,
                run_after=run_after,
            ),
            step=patch_step(
                step,
                StepState.RETRY_SCHEDULED,
                run_after=run_after,
                failure_class=FailureClass.FENCED,
                **NO_LEASE,
            ),
            attempt=patch_attempt(
                attempt,
                AttemptOutcome.FENCED,
                now,
                failure_class=FailureClass.FENCED,
                retry=RetryDecision.SCHEDULED,
                safe_error_code="lease_expired",
            ),
        ),
        run_after=run_after,
        recovery_observed_at=now,
    )


def decide_commit_unknown(
    root: RunRecord,
    step: StepRecord,
    attempt: AttemptRecord,
    fence: LeaseFence,
    now: datetime,
    outcome: AttemptOutcome = AttemptOutcome.COMMIT_UNKNOWN,
) -> Quarantined | AlreadyCommitted | CancelWon | FenceLost:
    """§5.2.6 / §13.4: the connection died around COMMIT/ROLLBACK. Read the marker the
    transaction would have written (the attempt outcome): ``Committed`` means our commit
    won; otherwise quarantine attempt, step and root — never a retry."""
    if outcome not in (AttemptOutcome.COMMIT_UNKNOWN, AttemptOutcome.ROLLBACK_UNKNOWN):
        raise TransitionInputError(
            "outcome must be CommitUnknown or RollbackUnknown", field="outcome"
        )
    if attempt.outcome is AttemptOutcome.COMMITTED:
        return AlreadyCommitted()
    if attempt.outcome is AttemptOutcome.CANCELLED:
        return CancelWon()
    # Only a Running step can have opened the business transaction whose outcome is lost.
    lost = revalidate_fence(root, step, attempt, fence, step_states=frozenset({StepState.RUNNING}))
    if lost is not None:
        return lost
    cause = (
        CAUSE_COMMIT_UNKNOWN if outcome is AttemptOutcome.COMMIT_UNKNOWN else CAUSE_ROLLBACK_UNKNOWN
    )
    return Quarantined(
        Transition(
            run=patch_root(
                root,
                RunState.QUARANTINED,
                expect_current_step=step.step_execution_id,
                run_after=None,
                completed_at=now,
                terminal_cause_code=cause,
            ),
            step=patch_step(
                step,
                StepState.QUARANTINED,
                run_after=None,
                failure_class=FailureClass.AMBIGUOUS,
                **NO_LEASE,
            ),
            attempt=patch_attempt(
                attempt,
                outcome,
                now,
                failure_class=FailureClass.AMBIGUOUS,
                retry=RetryDecision.QUARANTINED,
                safe_error_code=cause,
            ),
        )
    )


# --- cancellation and delete -------------------------------------------------------------


def decide_cancel(
    root: RunRecord,
    step: StepRecord | None,
    attempt: AttemptRecord | None,
    now: datetime,
    *,
    delete: bool,
) -> CancelRecorded | Tombstoned | NoChange:
    """§10.1 ``DeleteFlowInterview`` steps 2-5 (``delete=True``) or a plain cancellation.

    An active root becomes ``CancelRequested`` with ``DeleteRequestedAt`` (and, for a
    delete, ``IsDeleted``); in the same decision its current step is cancelled
    (``Pending``/``RetryScheduled``) or fenced to ``CancelRequested``
    (``Claimed``/``Running``/``Waiting``), and a ``Started`` attempt of a claimed or
    running step becomes terminal ``Cancelled``. A terminal or already-cancelling run
    only gains the soft-delete fact; a repeat is a no-op with the same outcome.
    """
    if root.state not in ACTIVE_RUN_STATES:
        if delete and not root.is_deleted:
            run = patch_root(
                root,
                root.state,
                require_live=False,
                is_deleted=True,
                delete_requested_at=root.delete_requested_at or now,
            )
            return Tombstoned(Transition(run=run))
        done = root.state in TERMINAL_RUN_STATES and root.state is not RunState.CANCELLED
        return NoChange("terminal" if done else "already_cancelled")
    run = patch_root(
        root,
        RunState.CANCEL_REQUESTED,
        require_live=False,
        is_deleted=True if delete else KEEP,
        delete_requested_at=now,
        run_after=None,
    )
    step_patch: StepPatch | None = None
    attempt_patch: AttemptPatch | None = None
    if step is not None and step.step_execution_id == root.current_step_execution_id:
        if step.state in CLAIMABLE:
            step_patch = patch_step(
                step, StepState.CANCELLED, run_after=None, failure_class=FailureClass.CANCELLED
            )
        elif step.state in LEASED or step.state is StepState.WAITING:
            # The lease is dropped with the version bump: the stale worker's fence (token
            # and step version) can no longer match, and the recovery sweep, which scans
            # leases, never sees a cancelled step.
            step_patch = patch_step(
                step, StepState.CANCEL_REQUESTED, failure_class=FailureClass.CANCELLED, **NO_LEASE
            )
            if (
                step.state in LEASED
                and attempt is not None
                and attempt.step_execution_id == step.step_execution_id
                and attempt.outcome is AttemptOutcome.STARTED
            ):
                attempt_patch = patch_attempt(
                    attempt,
                    AttemptOutcome.CANCELLED,
                    now,
                    failure_class=FailureClass.CANCELLED,
                    retry=RetryDecision.NONE,
                    safe_error_code=CAUSE_CANCELLED,
                )
    return CancelRecorded(Transition(run=run, step=step_patch, attempt=attempt_patch))


def decide_cancel_cleanup(
    root: RunRecord,
    step: StepRecord | None,
    attempt: AttemptRecord | None,
    now: datetime,
    *,
    cause: str | None = None,
) -> CancelCompleted | NoChange:
    """§11.1 ``CancelRequested -> Cancelled`` once the active step has been fenced;
    ``cause`` overrides the terminal cause (an effect that completed before the
    cancellation is named, never hidden)."""
    if root.state is RunState.CANCELLED:
        return NoChange("already_cancelled")
    if root.state is not RunState.CANCEL_REQUESTED:
        return NoChange("not_cancel_requested")
    step_patch: StepPatch | None = None
    attempt_patch: AttemptPatch | None = None
    if step is not None and step.state is StepState.CANCEL_REQUESTED:
        step_patch = patch_step(step, StepState.CANCELLED, **NO_LEASE)
        if (
            attempt is not None
            and attempt.step_execution_id == step.step_execution_id
            and attempt.outcome is AttemptOutcome.STARTED
        ):
            attempt_patch = patch_attempt(
                attempt,
                AttemptOutcome.CANCELLED,
                now,
                failure_class=FailureClass.CANCELLED,
                retry=RetryDecision.NONE,
                safe_error_code=CAUSE_CANCELLED,
            )
    run = patch_root(
        root,
        RunState.CANCELLED,
        require_live=False,
        completed_at=now,
        terminal_cause_code=cause or CAUSE_CANCELLED,
        run_after=None,
    )
    return CancelCompleted(Transition(run=run, step=step_patch, attempt=attempt_patch))


# --- waits (§14, §18.2) ------------------------------------------------------------------


def _waiting(root: RunRecord, step: StepRecord) -> str | None:
    if root.state is not RunState.WAITING:
        return "root_not_waiting"
    if step.state is not StepState.WAITING:
        return "step_not_waiting"
    if root.current_step_execution_id != step.step_execution_id:
        return "not_current_step"
    if root.is_deleted or root.delete_requested_at is not None:
        return "deleted"
    return None


def decide_resolve_wait(
    root: RunRecord, step: StepRecord, now: datetime
) -> WaitResolved | NoChange:
    """Dependency resolved: step ``Waiting -> Pending`` and root ``Waiting -> Runnable``
    in the same transition, with the projection back to ``Running``."""
    reason = _waiting(root, step)
    if reason is not None:
        return NoChange(reason)
    return WaitResolved(
        Transition(
            run=patch_root(
                root,
                RunState.RUNNABLE,
                expect_current_step=step.step_execution_id,
                run_after=now,
                paused_at=None,
            ),
            step=patch_step(step, StepState.PENDING, run_after=now),
        )
    )


def decide_wait_expired(
    root: RunRecord, step: StepRecord, now: datetime, *, quarantine: bool, cause: str | None = None
) -> WaitExpired | NoChange:
    """Dependency expiry under a terminal (``Failed``/``TerminalFailed``) or quarantine
    policy; ``cause`` overrides the default terminal cause (a deleted or missing
    producer). The fault-path policy activates the fault step instead
    (:mod:`runtime_svc.kernel.transitions_waits`)."""
    reason = _waiting(root, step)
    if reason is not None:
        return NoChange(reason)
    run_to, step_to, default_cause, failure = (
        (
            RunState.QUARANTINED,
            StepState.QUARANTINED,
            CAUSE_DEPENDENCY_AMBIGUOUS,
            FailureClass.AMBIGUOUS,
        )
        if quarantine
        else (
            RunState.TERMINAL_FAILED,
            StepState.FAILED,
            CAUSE_DEPENDENCY_EXPIRED,
            FailureClass.TERMINAL,
        )
    )
    cause = cause or default_cause
    return WaitExpired(
        Transition(
            run=patch_root(
                root,
                run_to,
                expect_current_step=step.step_execution_id,
                completed_at=now,
                terminal_cause_code=cause,
            ),
            step=patch_step(step, step_to, failure_class=failure),
        ),
        cause_code=cause,
    )
