"""Pure decisions of the operator controls (``transitions_operator``; issue 14 item 5):
pause/resume of every run state, the claim's refusal of a paused run, the §18.2
projection of a paused run, and the operator-only exits of ``Quarantined``."""

from __future__ import annotations

from typing import Any

import pytest

from runtime_svc.kernel.decisions import Claimed, ClaimRequest, NotEligible
from runtime_svc.kernel.errors import IllegalTransitionError, TerminalStateError
from runtime_svc.kernel.model import RunRecord, StepRecord
from runtime_svc.kernel.states import (
    ACTIVE_RUN_STATES,
    TERMINAL_RUN_STATES,
    CompatibilityStatus,
    ExecutionOwner,
    RunState,
    StepState,
)
from runtime_svc.kernel.tables import (
    OPERATOR_RUN_ARROWS,
    OPERATOR_STEP_ARROWS,
    check_operator_transition,
    check_transition,
    compatibility_status,
)
from runtime_svc.kernel.transitions import decide_claim
from runtime_svc.kernel.transitions_operator import (
    OperatorNoChange,
    OperatorRefused,
    PauseChange,
    Restart,
    decide_pause,
    decide_restart,
    decide_resume,
)
from tests.unit.kernel.factories import POLICY, T0, run, step

REQUEST = ClaimRequest(
    lease_owner="w",
    lease_token_digest="d" * 64,
    attempt_id="att_1",
    ownership_epoch=1,
    plan_digest="p",
    lock_plan_digest="l",
)


@pytest.mark.parametrize("state", sorted(ACTIVE_RUN_STATES))
def test_an_active_run_is_paused_on_its_own_version_and_state(state: RunState) -> None:
    root = run(state=state, state_version=7)
    assert decide_pause(root, T0) == PauseChange("run_1", 7, state, 1, T0)


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        *((s, "run_terminal") for s in sorted(TERMINAL_RUN_STATES)),
        (RunState.CANCEL_REQUESTED, "run_cancelling"),
    ],
)
def test_a_terminal_or_cancelling_run_cannot_be_paused(state: RunState, reason: str) -> None:
    assert decide_pause(run(state=state), T0) == OperatorRefused(reason)


def test_pause_and_resume_are_idempotent_and_refuse_legacy_or_deleted_runs() -> None:
    paused = run(operator_paused_at=T0)
    assert decide_pause(paused, T0) == OperatorNoChange("already_paused")
    assert decide_resume(run()) == OperatorNoChange("not_paused")
    assert decide_resume(paused) == PauseChange("run_1", 0, RunState.RUNNABLE, 1, None)
    legacy = run(execution_owner=ExecutionOwner.LEGACY_INTERPRETER, operator_paused_at=T0)
    assert decide_pause(legacy, T0) == OperatorRefused("legacy_owned_run")
    assert decide_resume(legacy) == OperatorRefused("legacy_owned_run")
    assert decide_pause(run(is_deleted=True), T0) == OperatorRefused("deleted")


def test_the_claim_refuses_a_paused_run_before_spending_a_budget() -> None:
    due = step(state=StepState.PENDING, run_after=T0)
    assert isinstance(decide_claim(run(), due, T0, POLICY, REQUEST), Claimed)
    assert decide_claim(run(operator_paused_at=T0), due, T0, POLICY, REQUEST) == NotEligible(
        "paused"
    )
    # A spent retry budget is not ended while paused (the operator may still act).
    spent = step(state=StepState.RETRY_SCHEDULED, attempt_count=POLICY.max_attempts)
    paused = run(operator_paused_at=T0)
    assert decide_claim(paused, spent, T0, POLICY, REQUEST) == NotEligible("paused")
    claimed = decide_claim(run(), due, T0, POLICY, REQUEST)
    assert isinstance(claimed, Claimed) and claimed.transition.run is not None
    assert claimed.transition.run.require_not_paused


@pytest.mark.parametrize("state", sorted(RunState))
def test_a_paused_active_run_projects_paused_and_others_by_state(state: RunState) -> None:
    projected = compatibility_status(state, paused=True)
    if state in ACTIVE_RUN_STATES:
        assert projected is CompatibilityStatus.PAUSED
    else:
        assert projected is compatibility_status(state)


def test_quarantine_exits_are_operator_only() -> None:
    assert {
        (RunState.QUARANTINED, RunState.RUNNABLE),
        (RunState.QUARANTINED, RunState.TERMINAL_FAILED),
        (RunState.TERMINAL_FAILED, RunState.RUNNABLE),
    } == OPERATOR_RUN_ARROWS
    assert {
        (StepState.QUARANTINED, StepState.RETRY_SCHEDULED),
        (StepState.QUARANTINED, StepState.FAILED),
    } == OPERATOR_STEP_ARROWS
    for a, b in OPERATOR_RUN_ARROWS:
        check_operator_transition("run", a, b)
        with pytest.raises(TerminalStateError):  # never on an automatic path
            check_transition("run", a, b)
    for a, b in OPERATOR_STEP_ARROWS:
        check_operator_transition("step", a, b)
        with pytest.raises(TerminalStateError):
            check_transition("step", a, b)
    with pytest.raises(IllegalTransitionError):
        check_operator_transition("run", RunState.SUCCEEDED, RunState.RUNNABLE)
    with pytest.raises(IllegalTransitionError):
        check_operator_transition("run", RunState.QUARANTINED, RunState.RUNNING)
    with pytest.raises(IllegalTransitionError):
        check_operator_transition("step", StepState.QUARANTINED, StepState.PENDING)


def _restart(root: RunRecord, source: StepRecord | None, checkpoint: str = "ckpt_1") -> Any:
    return decide_restart(
        root, checkpoint, source, new_step_execution_id="step_new", invocation_ordinal=1, now=T0
    )


def test_a_failed_run_restarts_on_a_new_pending_step_of_the_checkpoints_consumer() -> None:
    failed = run(
        state=RunState.TERMINAL_FAILED,
        state_version=4,
        current_step_execution_id="step_2",
        terminal_cause_code="step_failed",
        completed_at=T0,
    )
    source = step(plan_step_key="s1", input_checkpoint_id="ckpt_1")
    decision = _restart(failed, source)
    assert isinstance(decision, Restart)
    patch, new = decision.transition.run, decision.transition.new_step
    assert patch is not None and new is not None
    assert (patch.from_state, patch.to_state, patch.expected_version) == (
        RunState.TERMINAL_FAILED,
        RunState.RUNNABLE,
        4,
    )
    assert patch.operator and patch.expect_current_step == "step_2"
    assert (patch.current_step_execution_id, patch.current_checkpoint_id) == ("step_new", "ckpt_1")
    assert (patch.completed_at, patch.terminal_cause_code) == (None, None)
    assert (new.plan_step_key, new.invocation_ordinal, new.input_checkpoint_id, new.state) == (
        "s1",
        1,
        "ckpt_1",
        StepState.PENDING,
    )
    assert decision.transition.step is None  # the failed step is never rewritten


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        (RunState.QUARANTINED, "run_quarantined"),
        (RunState.SUCCEEDED, "run_not_failed"),
        (RunState.CANCELLED, "run_not_failed"),
        (RunState.RUNNABLE, "run_not_failed"),
        (RunState.WAITING, "run_not_failed"),
    ],
)
def test_restart_is_only_for_a_failed_run(state: RunState, reason: str) -> None:
    assert _restart(run(state=state), step()) == OperatorRefused(reason)


def test_restart_needs_a_checkpoint_that_was_a_step_input_of_the_run() -> None:
    failed = run(state=RunState.TERMINAL_FAILED)
    refused = OperatorRefused("checkpoint_not_a_step_input")
    assert _restart(failed, None) == refused
    assert _restart(failed, step(flow_run_id="run_other")) == refused
    assert _restart(failed, step(input_checkpoint_id="ckpt_9")) == refused
    legacy = run(state=RunState.TERMINAL_FAILED, execution_owner=ExecutionOwner.LEGACY_INTERPRETER)
    assert _restart(legacy, step()) == OperatorRefused("legacy_owned_run")
    with pytest.raises(TerminalStateError):  # the arrow exists for operators only
        check_transition("run", RunState.TERMINAL_FAILED, RunState.RUNNABLE)
