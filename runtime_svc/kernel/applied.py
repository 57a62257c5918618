"""The rows a transition leaves behind, derived in memory (pure; no I/O).

Step continuation (``docs/adr/0002-step-continuation.md``) claims step k+1 and moves it
``Running`` inside the transaction that commits step k. That transaction holds the root
lock and *wrote* every row the continuation decides on: the root it just advanced, the
step k+1 it just inserted, the attempt the claim just inserted. Reading them back with
``SELECT … FOR UPDATE`` would return exactly what these functions compute from the row
it locked and the patch it applied — at the price of five wide round trips per step.

Deriving instead of re-reading weakens no fence: every write that follows is still a
conditional UPDATE whose predicates (version, state, epoch, lease-token digest) the
database checks against the stored row; a derivation that disagreed with the stored row
would make that UPDATE match nothing, raise ``FenceLostError`` and roll the whole
transaction back — it can cost liveness, never admit a stale writer.
"""

from __future__ import annotations

from datetime import datetime

from runtime_svc.kernel.model import (
    AttemptRecord,
    NewAttempt,
    NewStep,
    RunPatch,
    RunRecord,
    StepPatch,
    StepRecord,
    Transition,
    patch_changes,
)
from runtime_svc.kernel.states import ACTIVE_RUN_STATES, AttemptOutcome, StepState
from runtime_svc.kernel.tables import compatibility_status
from services.evolve import evolve

__all__ = [
    "applied_run",
    "applied_step",
    "inserted_attempt",
    "inserted_step",
    "projected_step_state",
]


def projected_step_state(transition: Transition) -> StepState | None:
    """The current step's state the root's compatibility projection is computed with
    (the new step's, else the patched step's)."""
    if transition.new_step is not None:
        return transition.new_step.state
    if transition.step is not None:
        return transition.step.to_state
    return None


def applied_run(
    root: RunRecord, patch: RunPatch, step_state: StepState | None, now: datetime
) -> RunRecord:
    """``root`` after ``patch`` was applied at ``now`` (``store_rows._run_write``)."""
    paused = root.operator_paused_at is not None and patch.to_state in ACTIVE_RUN_STATES
    return evolve(
        root,
        **patch_changes(patch),
        state=patch.to_state,
        state_version=patch.expected_version + 1,
        interview_status=compatibility_status(patch.to_state, step_state, paused=paused).code,
        updated_at=now,
    )


def applied_step(step: StepRecord, patch: StepPatch, now: datetime) -> StepRecord:
    """``step`` after ``patch`` was applied at ``now`` (``store_rows._step_write``)."""
    return evolve(
        step,
        **patch_changes(patch),
        state=patch.to_state,
        state_version=patch.expected_version + 1,
        updated_at=now,
    )


def inserted_step(org_id: str, new: NewStep, now: datetime) -> StepRecord:
    """The row ``store_rows.step_insert`` inserts for ``new`` at ``now``."""
    return StepRecord(
        org_id=org_id,
        step_execution_id=new.step_execution_id,
        flow_run_id=new.flow_run_id,
        plan_step_key=new.plan_step_key,
        invocation_ordinal=new.invocation_ordinal,
        step_kind=new.step_kind,
        state=new.state,
        input_checkpoint_id=new.input_checkpoint_id,
        output_checkpoint_id=None,
        state_version=0,
        attempt_count=0,
        lease_owner=None,
        lease_token_digest=None,
        lease_until=None,
        ownership_epoch=new.ownership_epoch,
        run_after=new.run_after,
        queue_class=new.queue_class,
        failure_class=None,
        created_at=now,
        updated_at=now,
    )


def inserted_attempt(org_id: str, new: NewAttempt) -> AttemptRecord:
    """The row ``store_rows.attempt_insert`` inserts for ``new``."""
    return AttemptRecord(
        org_id=org_id,
        attempt_id=new.attempt_id,
        step_execution_id=new.step_execution_id,
        attempt_number=new.attempt_number,
        lease_token_digest=new.lease_token_digest,
        ownership_epoch=new.ownership_epoch,
        root_state_version_at_claim=new.root_state_version_at_claim,
        started_at=new.started_at,
        finished_at=None,
        outcome=AttemptOutcome.STARTED,
        failure_class=None,
        safe_error_code=None,
        retry_decision=None,
        retry_policy_digest=new.retry_policy_digest,
        recovery_backoff_floor_ms=new.recovery_backoff_floor_ms,
        attempt_state_version=0,
        plan_digest=new.plan_digest,
        lock_plan_digest=new.lock_plan_digest,
        trace_id=new.trace_id,
    )
