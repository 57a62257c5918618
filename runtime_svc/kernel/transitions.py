"""Pure transition functions of the orchestration kernel (§11, §12; STYLE 5).

Each ``decide_*`` function takes row snapshots read under lock (root, step, attempt),
the database clock ``now`` and the caller's inputs, and returns a decision value from
:mod:`runtime_svc.kernel.decisions`; it never performs I/O. A decision that writes
carries a :class:`~runtime_svc.kernel.model.Transition` whose patches were checked
against the transition tables when they were built, and whose predicates make the store's
conditional UPDATEs the real fence (ARCHITECTURE §2).

Arrow coverage (§11.1 run / §11.2 step / §11.3 attempt):

=========================  ==================================================================
function                   arrows
=========================  ==================================================================
decide_claim               run Runnable→Running; step Pending|RetryScheduled→Claimed (a due
                           retry whose attempt budget is spent: step RetryScheduled→Failed,
                           run Runnable→TerminalFailed, ``retry_exhausted``)
decide_start_running       step Claimed→Running
decide_commit              attempt Started→Committed; step Running→Succeeded|Waiting|
                           Quarantined; run Running→Runnable|Succeeded|TerminalFailed|Waiting|
                           Quarantined; an EffectSubmit's completion step inserted Waiting
decide_rollback_retry      attempt Started→RolledBack|PreTransactionFailed; step
                           Running→RetryScheduled|Failed; run Running→Runnable|TerminalFailed
decide_recovery            attempt Started→Fenced; step Claimed|Running→RetryScheduled
                           (or →Failed at the limit); run Running→Runnable|TerminalFailed
decide_commit_unknown      attempt Started→CommitUnknown|RollbackUnknown; step
                           Running→Quarantined; run Running→Quarantined
decide_cancel              run Accepted|Runnable|Running|Waiting→CancelRequested; step
                           Pending|RetryScheduled→Cancelled, Claimed|Running|Waiting→
                           CancelRequested; attempt Started→Cancelled
decide_cancel_cleanup      run CancelRequested→Cancelled; step CancelRequested→Cancelled
decide_resolve_wait        step Waiting→Pending; run Waiting→Runnable
decide_wait_expired        step Waiting→Failed|Quarantined; run Waiting→TerminalFailed|Quarantined
=========================  ==================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from runtime_svc.kernel.decisions import (
    STEPS,
    Advance,
    CancelWon,
    Claimed,
    ClaimRequest,
    Committed,
    EnterWait,
    FailRun,
    FenceLost,
    FinishRun,
    HandOff,
    LeaseExtended,
    NextStep,
    NotEligible,
    QuarantineRun,
    RetryExhausted,
    RetryScheduled,
    Started,
    StepFailure,
    revalidate_fence,
)
from runtime_svc.kernel.model import (
    AttemptRecord,
    LeaseFence,
    NewAttempt,
    NewStep,
    RunRecord,
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
    CAUSE_STEP_FAILED,
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
    AttemptOutcome,
    ExecutionOwner,
    FailureClass,
    RetryDecision,
    RunState,
    StepState,
)
from runtime_svc.kernel.tables import (
    ATTEMPT_TRANSITIONS,
    RUN_TRANSITIONS,
    STEP_TRANSITIONS,
    check_transition,
    compatibility_status,
)
from runtime_svc.kernel.transitions_recovery import (
    decide_cancel,
    decide_cancel_cleanup,
    decide_commit_unknown,
    decide_recovery,
    decide_resolve_wait,
    decide_wait_expired,
)

__all__ = [
    "ATTEMPT_TRANSITIONS",
    "CAUSE_CANCELLED",
    "CAUSE_COMMIT_UNKNOWN",
    "CAUSE_DEPENDENCY_AMBIGUOUS",
    "CAUSE_DEPENDENCY_EXPIRED",
    "CAUSE_LEASE_EXPIRY_LIMIT",
    "CAUSE_RETRY_EXHAUSTED",
    "CAUSE_ROLLBACK_UNKNOWN",
    "CAUSE_STEP_FAILED",
    "RUN_TRANSITIONS",
    "STEP_TRANSITIONS",
    "RetryPolicy",
    "check_transition",
    "compatibility_status",
    "decide_cancel",
    "decide_cancel_cleanup",
    "decide_claim",
    "decide_commit",
    "decide_commit_unknown",
    "decide_heartbeat",
    "decide_recovery",
    "decide_resolve_wait",
    "decide_rollback_retry",
    "decide_start_running",
    "decide_wait_expired",
]


# --- admission and claim -----------------------------------------------------------------


def decide_claim(
    root: RunRecord, step: StepRecord, now: datetime, policy: RetryPolicy, request: ClaimRequest
) -> Claimed | NotEligible | RetryExhausted:
    """§12.1 steps 3-5: claim ``step`` for ``request`` if it is the root's due current step.

    The new attempt's ``RecoveryBackoffFloor`` is the deterministic jittered backoff of
    its attempt number, which is never below the ordinary retry floor of that attempt.

    The attempt budget bounds automatic *retries* (§13.4: "attempt count ... remain"):
    only an eligible ``RetryScheduled`` step needs budget left (§12.1 step 3). A
    ``Pending`` step is always claimable — a first execution, or a step resumed after its
    wait resolved (``Waiting -> Pending``), which is no retry even when entering the wait
    used the last attempt. A due ``RetryScheduled`` step whose budget is already spent
    (the policy was lowered after it was scheduled) can never be claimed again: the
    decision ends it — step ``Failed``, root ``TerminalFailed`` with ``retry_exhausted``
    (a documented extension of §11, see :mod:`runtime_svc.kernel.tables`) — instead of
    leaving the run unclaimable for ever.
    """
    checks: list[tuple[bool, str]] = [
        (root.execution_owner is not ExecutionOwner.FLOW_RUNTIME_V2, "not_v2_owned"),
        (root.ownership_epoch != request.ownership_epoch, "epoch_mismatch"),
        (root.is_deleted or root.delete_requested_at is not None, "deleted"),
        (root.state is not RunState.RUNNABLE, "root_not_runnable"),
        # PauseRun (issue 14 item 5): a paused run is never claimed until ResumeRun.
        (root.operator_paused_at is not None, "paused"),
        (root.current_step_execution_id != step.step_execution_id, "not_current_step"),
        (step.flow_run_id != root.flow_run_id, "not_current_step"),
        (
            request.expected_root_version not in (None, root.state_version)
            or request.expected_step_version not in (None, step.state_version),
            "superseded",
        ),
        (step.state not in CLAIMABLE, "step_not_claimable"),
        (step.ownership_epoch != request.ownership_epoch, "epoch_mismatch"),
        (step.run_after is not None and step.run_after > now, "not_due"),
        (
            step.state is StepState.RETRY_SCHEDULED and step.attempt_count >= policy.max_attempts,
            "attempt_budget_spent",
        ),
    ]
    reason = next((why for failed, why in checks if failed), None)
    if reason == "attempt_budget_spent":
        return _budget_spent(root, step, now)
    if reason is not None:
        return NotEligible(reason)
    number = step.attempt_count + 1
    lease_until = now + ms(policy.lease_duration_ms)
    floor = policy.backoff_ms(number, step.step_execution_id)
    run = patch_root(
        root,
        RunState.RUNNING,
        expect_current_step=step.step_execution_id,
        require_not_paused=True,
        run_after=None,
        started_at=root.started_at or now,
    )
    step_patch = patch_step(
        step,
        StepState.CLAIMED,
        lease_owner=request.lease_owner,
        lease_token_digest=request.lease_token_digest,
        lease_until=lease_until,
        run_after=None,
        attempt_count=number,
        failure_class=None,
    )
    attempt = NewAttempt(
        attempt_id=request.attempt_id,
        step_execution_id=step.step_execution_id,
        attempt_number=number,
        lease_token_digest=request.lease_token_digest,
        ownership_epoch=request.ownership_epoch,
        root_state_version_at_claim=root.state_version + 1,
        started_at=now,
        retry_policy_digest=policy.digest(),
        recovery_backoff_floor_ms=floor,
        plan_digest=request.plan_digest,
        lock_plan_digest=request.lock_plan_digest,
        trace_id=request.trace_id,
    )
    return Claimed(
        Transition(run=run, step=step_patch, new_attempt=attempt),
        lease_until=lease_until,
        root_state_version=root.state_version + 1,
        step_state_version=step.state_version + 1,
        attempt_number=number,
        recovery_backoff_floor_ms=floor,
    )


def _budget_spent(root: RunRecord, step: StepRecord, now: datetime) -> RetryExhausted:
    """End a due step that no attempt may run any more, and its run (no attempt row: none
    was started)."""
    transition = Transition(
        run=patch_root(
            root,
            RunState.TERMINAL_FAILED,
            expect_current_step=step.step_execution_id,
            run_after=None,
            completed_at=now,
            terminal_cause_code=CAUSE_RETRY_EXHAUSTED,
        ),
        step=patch_step(
            step, StepState.FAILED, run_after=None, failure_class=FailureClass.RETRYABLE
        ),
    )
    return RetryExhausted(transition, cause_code=CAUSE_RETRY_EXHAUSTED)


def decide_start_running(
    root: RunRecord, step: StepRecord, attempt: AttemptRecord, fence: LeaseFence, now: datetime
) -> Started | FenceLost:
    """§12.2 step 3: step ``Claimed -> Running`` while root and lease are still ours."""
    lost = revalidate_fence(root, step, attempt, fence, step_states=frozenset({StepState.CLAIMED}))
    if lost is not None:
        return lost
    if step.lease_until is None or step.lease_until <= now:
        return FenceLost(
            STEPS,
            step.step_execution_id,
            "lease_expired",
            fence.step_state_version,
            step.state_version,
        )
    patch = patch_step(step, StepState.RUNNING)
    return Started(Transition(step=patch), step_state_version=step.state_version + 1)


def decide_heartbeat(
    root: RunRecord,
    step: StepRecord,
    attempt: AttemptRecord,
    fence: LeaseFence,
    now: datetime,
    policy: RetryPolicy,
) -> LeaseExtended | FenceLost:
    """§12.3: extend a live lease without changing the commit fence (no version bump)."""
    lost = revalidate_fence(root, step, attempt, fence, step_states=LEASED)
    if lost is not None:
        return lost
    if step.lease_until is None or step.lease_until <= now:
        return FenceLost(
            STEPS,
            step.step_execution_id,
            "lease_expired",
            fence.step_state_version,
            step.state_version,
        )
    return LeaseExtended(now + ms(policy.lease_duration_ms))


# --- commit and rollback -----------------------------------------------------------------


def decide_commit(
    root: RunRecord,
    step: StepRecord,
    attempt: AttemptRecord,
    fence: LeaseFence,
    now: datetime,
    advance: Advance,
    output_checkpoint_id: str,
    evidence: Mapping[str, Any] | None = None,
) -> Committed | FenceLost:
    """§12.2 steps 9-12: the final fenced transition, made in the business transaction;
    ``evidence`` (e.g. the lock plan the step committed with) is kept on the attempt."""
    lost = revalidate_fence(root, step, attempt, fence, step_states=frozenset({StepState.RUNNING}))
    if lost is None and step.input_checkpoint_id != fence.input_checkpoint_id:
        lost = FenceLost(
            STEPS,
            step.step_execution_id,
            "input_checkpoint",
            fence.step_state_version,
            step.state_version,
        )
    if lost is not None:
        return lost
    attempt_patch = patch_attempt(
        attempt,
        AttemptOutcome.COMMITTED,
        now,
        failure_class=None,
        retry=RetryDecision.NONE,
        evidence=evidence,
    )
    step_to = StepState.SUCCEEDED
    failure: FailureClass | None = None
    if isinstance(advance, EnterWait):
        step_to = StepState.WAITING
    elif isinstance(advance, QuarantineRun):
        step_to, failure = StepState.QUARANTINED, FailureClass.AMBIGUOUS
    step_patch = patch_step(
        step,
        step_to,
        expect_input_checkpoint_id=fence.input_checkpoint_id,
        output_checkpoint_id=output_checkpoint_id,
        run_after=None,
        failure_class=failure,
        **NO_LEASE,
    )
    common: dict[str, object] = {
        "expect_current_step": step.step_execution_id,
        "current_checkpoint_id": output_checkpoint_id,
        "run_after": None,
    }
    new_step: NewStep | None = None
    match advance:
        case NextStep():
            run = patch_root(
                root,
                RunState.RUNNABLE,
                **{**common, "run_after": now},
                current_step_execution_id=advance.step_execution_id,
                current_element=advance.plan_step_key,
            )
            new_step = NewStep(
                step_execution_id=advance.step_execution_id,
                flow_run_id=root.flow_run_id,
                plan_step_key=advance.plan_step_key,
                invocation_ordinal=advance.invocation_ordinal,
                step_kind=advance.step_kind,
                input_checkpoint_id=output_checkpoint_id,
                ownership_epoch=root.ownership_epoch,
                run_after=now,
                queue_class=advance.queue_class,
            )
        case FinishRun():
            run = patch_root(root, RunState.SUCCEEDED, **common, completed_at=now)
        case FailRun():
            run = patch_root(
                root,
                RunState.TERMINAL_FAILED,
                **common,
                completed_at=now,
                terminal_cause_code=advance.cause_code,
            )
        case EnterWait():
            run = patch_root(root, RunState.WAITING, **common, paused_at=now)
        case HandOff():
            # §15.1 step 5: the submit succeeded and its completion step waits (on the
            # dependency inserted in this transaction); the root points at it.
            run = patch_root(
                root,
                RunState.WAITING,
                **common,
                paused_at=now,
                current_step_execution_id=advance.step_execution_id,
                current_element=advance.plan_step_key,
            )
            new_step = NewStep(
                step_execution_id=advance.step_execution_id,
                flow_run_id=root.flow_run_id,
                plan_step_key=advance.plan_step_key,
                invocation_ordinal=advance.invocation_ordinal,
                step_kind=advance.step_kind,
                input_checkpoint_id=output_checkpoint_id,
                ownership_epoch=root.ownership_epoch,
                run_after=None,
                queue_class=advance.queue_class,
                state=StepState.WAITING,
            )
        case QuarantineRun():
            run = patch_root(
                root,
                RunState.QUARANTINED,
                **common,
                completed_at=now,
                terminal_cause_code=advance.cause_code,
            )
    transition = Transition(run=run, step=step_patch, attempt=attempt_patch, new_step=new_step)
    return Committed(transition, run_state=run.to_state)


def _retry_allowed(
    step: StepRecord, attempt: AttemptRecord, now: datetime, policy: RetryPolicy, delay_ms: int
) -> bool:
    if attempt.attempt_number >= policy.max_attempts:
        return False
    if policy.max_retry_elapsed_ms:
        due = now + ms(delay_ms)
        return due - step.created_at <= ms(policy.max_retry_elapsed_ms)
    return True


def decide_rollback_retry(
    root: RunRecord,
    step: StepRecord,
    attempt: AttemptRecord,
    fence: LeaseFence,
    now: datetime,
    policy: RetryPolicy,
    failure: StepFailure,
) -> RetryScheduled | RetryExhausted | CancelWon | FenceLost:
    """§12.2 "proven rollback": record the attempt's terminal outcome and either schedule
    a durable retry no earlier than ``now + RecoveryBackoffFloor`` or end the step.

    The delay is ``max(floor, min(failure.min_delay_ms, max_delay_ms))``: bounded by the
    policy cap, never below the attempt's immutable floor.
    """
    if attempt.outcome is AttemptOutcome.CANCELLED and root.state in (
        RunState.CANCEL_REQUESTED,
        RunState.CANCELLED,
    ):
        return CancelWon()
    lost = revalidate_fence(root, step, attempt, fence, step_states=frozenset({StepState.RUNNING}))
    if lost is not None:
        return lost
    delay = max(attempt.recovery_backoff_floor_ms, min(failure.min_delay_ms, policy.max_delay_ms))
    retryable = failure.failure_class is FailureClass.RETRYABLE
    if retryable and _retry_allowed(step, attempt, now, policy, delay):
        run_after = now + ms(delay)
        return RetryScheduled(
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
                    failure_class=FailureClass.RETRYABLE,
                    **NO_LEASE,
                ),
                attempt=patch_attempt(
                    attempt,
                    failure.outcome,
                    now,
                    failure_class=FailureClass.RETRYABLE,
                    retry=RetryDecision.SCHEDULED,
                    safe_error_code=failure.safe_error_code,
                    evidence=failure.evidence,
                ),
            ),
            run_after=run_after,
            delay_ms=delay,
        )
    # A terminal (non-retryable) failure names its own safe code as the run's cause (the
    # caller of a synchronous run sees e.g. ``budget_exceeded.max_reads``); exhausted
    # retries are one cause whatever the last attempt's code.
    cause = CAUSE_RETRY_EXHAUSTED if retryable else (failure.safe_error_code or CAUSE_STEP_FAILED)
    return RetryExhausted(
        terminal_failure(
            root,
            step,
            attempt,
            now,
            failure.outcome,
            failure.failure_class,
            failure.safe_error_code,
            cause,
            failure.evidence,
        ),
        cause_code=cause,
    )
