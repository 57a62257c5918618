"""Pure wait transitions (§14.2 step 6, §14.3, §11.1): every arrow, every refusal, and
the terminal immutability of dependencies and signals — no database."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest

from runtime_svc.kernel.decisions import NoChange
from runtime_svc.kernel.errors import IllegalTransitionError, TerminalStateError
from runtime_svc.kernel.states import FailureClass, RunState, StepState
from runtime_svc.kernel.transitions_waits import (
    CAUSE_PRODUCER_DELETED,
    CAUSE_PRODUCER_MISSING,
    CAUSE_WAIT_EXPIRED,
    WaitTransition,
    cancel_dependency,
    decide_expiry,
    decide_repair,
    decide_resolution,
    scope_of,
)
from runtime_svc.kernel.wait_model import (
    DependencyPatch,
    DependencyRecord,
    DependencyState,
    ExpiryPolicyCode,
    FaultSuccessor,
    SignalPatch,
    SignalRecord,
    SignalState,
    WorkScopeKey,
)
from tests.unit.kernel.factories import T0, run, step

SCOPE = WorkScopeKey("org_unit", "inst", "cap", "binding")
RECEIPT = {"producer": "external.signal"}


def _root(**kw: Any) -> Any:
    base = {"state": RunState.WAITING, "interview_status": "Paused", "paused_at": T0}
    return run(**{**base, **kw})


def _step(**kw: Any) -> Any:
    return step(**{"state": StepState.WAITING, "lease_owner": None, **kw})


def dep(**kw: Any) -> DependencyRecord:
    values: dict[str, Any] = {
        "scope": SCOPE,
        "dependency_id": "dep_1",
        "flow_run_id": "run_1",
        "step_execution_id": "step_1",
        "producer_kind": "external.signal",
        "producer_key": "approval:1",
        "condition_digest": "c",
        "state": DependencyState.PENDING,
        "state_version": 0,
        "wake_version": None,
        "wake_token": None,
        "deadline": T0 + timedelta(hours=1),
        "next_probe_at": None,
        "expiry_policy": ExpiryPolicyCode.TERMINAL_FAILURE,
        "resolved_at": None,
        "resolution_receipt": None,
        "created_at": T0,
        "updated_at": T0,
        "reconciliation_attempts": 0,
        "wake_signal_id": None,
    }
    values.update(kw)
    return DependencyRecord(**values)


def sig(**kw: Any) -> SignalRecord:
    values: dict[str, Any] = {
        "scope": SCOPE,
        "wake_signal_id": "sig_1",
        "producer_kind": "external.signal",
        "producer_key": "approval:1",
        "wake_token": "t1",
        "wake_version": None,
        "evidence_digest": "d",
        "evidence_reference": None,
        "evidence_json": None,
        "received_at": T0,
        "expires_at": T0 + timedelta(days=1),
        "state": SignalState.UNMATCHED,
        "dependency_id": None,
        "state_version": 0,
        "next_match_at": None,
        "consumed_at": None,
    }
    values.update(kw)
    return SignalRecord(**values)


def test_scope_of_a_root_is_all_four_components() -> None:
    assert scope_of(_root()) == SCOPE


def test_resolution_consumes_the_signal_and_resumes_step_and_root_together() -> None:
    d = decide_resolution(_root(), _step(), dep(), sig(), T0, receipt=RECEIPT)
    assert isinstance(d, WaitTransition) and d.outcome == "resolved"
    run_patch, step_patch = d.transition.run, d.transition.step
    assert run_patch is not None and step_patch is not None
    assert (run_patch.from_state, run_patch.to_state) == (RunState.WAITING, RunState.RUNNABLE)
    assert run_patch.paused_at is None and run_patch.run_after == T0
    assert (step_patch.from_state, step_patch.to_state) == (StepState.WAITING, StepState.PENDING)
    assert d.dependency is not None and d.dependency.to_state is DependencyState.RESOLVED
    assert d.dependency.values["wake_signal_id"] == "sig_1"
    assert d.dependency.values["active_slot"] is None
    assert d.dependency.values["resolution_receipt"] == '{"producer":"external.signal"}'
    assert d.signal is not None and d.signal.to_state is SignalState.CONSUMED
    assert d.signal.values["dependency_id"] == "dep_1"


def test_resolution_without_a_signal_records_the_wake_version() -> None:
    d = decide_resolution(_root(), _step(), dep(), None, T0, receipt=RECEIPT, wake_version=7)
    assert isinstance(d, WaitTransition) and d.signal is None
    assert d.dependency is not None and d.dependency.values["wake_version"] == 7


@pytest.mark.parametrize(
    ("root", "step_", "dependency", "signal", "reason"),
    [
        (_root(), _step(), dep(state=DependencyState.RESOLVED), None, "dependency_resolved"),
        (_root(), _step(), dep(state=DependencyState.CANCELLED), None, "dependency_cancelled"),
        (_root(app_installation_id="other"), _step(), dep(), None, "scope_mismatch"),
        (_root(flow_run_id="run_2"), _step(), dep(), None, "other_run"),
        (_root(), _step(step_execution_id="step_2"), dep(), None, "not_waiting_step"),
        (_root(current_step_execution_id="step_9"), _step(), dep(), None, "not_current_step"),
        (_root(is_deleted=True), _step(), dep(), None, "deleted"),
        (_root(state=RunState.CANCEL_REQUESTED), _step(), dep(), None, "root_not_waiting"),
        (_root(), _step(state=StepState.CANCEL_REQUESTED), dep(), None, "step_not_waiting"),
        (_root(), _step(), dep(), sig(scope=WorkScopeKey("o", "i", "c", "b")), "signal_mismatch"),
        (_root(), _step(), dep(), sig(producer_key="approval:2"), "signal_mismatch"),
        (_root(), _step(), dep(), sig(producer_kind="effect.completion"), "signal_mismatch"),
        (_root(), _step(), dep(), sig(state=SignalState.CONSUMED), "signal_consumed"),
        (_root(), _step(), dep(wake_version=5), sig(wake_version=5), "stale_signal"),
        (_root(), _step(), dep(wake_version=5), sig(wake_version=4), "stale_signal"),
    ],
)
def test_resolution_refuses_anything_that_is_not_exactly_this_wait(
    root: Any, step_: Any, dependency: DependencyRecord, signal: SignalRecord | None, reason: str
) -> None:
    assert decide_resolution(root, step_, dependency, signal, T0, receipt=RECEIPT) == NoChange(
        reason
    )


def test_terminal_failure_expiry() -> None:
    d = decide_expiry(_root(), _step(), dep(), T0 + timedelta(hours=2))
    assert isinstance(d, WaitTransition) and d.outcome == "terminal_failure"
    assert d.cause_code == CAUSE_WAIT_EXPIRED
    assert d.transition.run is not None and d.transition.run.to_state is RunState.TERMINAL_FAILED
    assert d.transition.step is not None and d.transition.step.to_state is StepState.FAILED
    assert d.dependency is not None and d.dependency.to_state is DependencyState.EXPIRED


def test_expiry_before_the_deadline_is_refused() -> None:
    assert decide_expiry(_root(), _step(), dep(), T0) == NoChange("not_due")


def test_fault_path_expiry_activates_the_successor_on_the_resume_checkpoint() -> None:
    fault = FaultSuccessor("step_f", "escalate", "BoundedMutation", "durable_mutation", 0)
    d = decide_expiry(
        _root(),
        _step(),
        dep(expiry_policy=ExpiryPolicyCode.FAULT_PATH),
        T0 + timedelta(hours=2),
        fault=fault,
    )
    assert isinstance(d, WaitTransition) and d.outcome == "fault_path" and d.cause_code is None
    new = d.transition.new_step
    assert new is not None and new.plan_step_key == "escalate"
    assert new.input_checkpoint_id == "ckpt_1"
    assert d.transition.run is not None
    assert d.transition.run.to_state is RunState.RUNNABLE
    assert d.transition.run.current_step_execution_id == "step_f"
    assert d.transition.step is not None
    assert d.transition.step.failure_class is FailureClass.TERMINAL


def test_fault_path_without_a_resolvable_successor_quarantines_never_guesses() -> None:
    d = decide_expiry(
        _root(),
        _step(),
        dep(expiry_policy=ExpiryPolicyCode.FAULT_PATH),
        T0 + timedelta(hours=2),
    )
    assert isinstance(d, WaitTransition) and d.outcome == "quarantined"


def test_quarantine_policy_and_a_missing_producer_quarantine_all_three() -> None:
    for d in (
        decide_expiry(
            _root(), _step(), dep(expiry_policy=ExpiryPolicyCode.QUARANTINE), T0 + timedelta(days=1)
        ),
        decide_expiry(_root(), _step(), dep(), T0, cause=CAUSE_PRODUCER_MISSING, quarantine=True),
    ):
        assert isinstance(d, WaitTransition) and d.outcome == "quarantined"
        assert d.transition.run is not None and d.transition.run.to_state is RunState.QUARANTINED
        assert d.transition.step is not None
        assert d.transition.step.to_state is StepState.QUARANTINED
        assert d.dependency is not None and d.dependency.to_state is DependencyState.QUARANTINED


def test_a_deleted_producer_expires_before_the_deadline() -> None:
    d = decide_expiry(_root(), _step(), dep(), T0, cause=CAUSE_PRODUCER_DELETED)
    assert isinstance(d, WaitTransition) and d.cause_code == CAUSE_PRODUCER_DELETED


def test_cancel_dependency_only_from_pending() -> None:
    patch = cancel_dependency(dep(), T0)
    assert patch is not None and patch.to_state is DependencyState.CANCELLED
    assert cancel_dependency(dep(state=DependencyState.EXPIRED), T0) is None


def test_repair_replays_each_terminal_outcome_without_touching_the_dependency() -> None:
    cases = {
        DependencyState.RESOLVED: (RunState.RUNNABLE, "resolved"),
        DependencyState.EXPIRED: (RunState.TERMINAL_FAILED, "terminal_failure"),
        DependencyState.QUARANTINED: (RunState.QUARANTINED, "quarantined"),
        DependencyState.CANCELLED: (RunState.CANCEL_REQUESTED, "cancel_requested"),
    }
    for state, (run_to, outcome) in cases.items():
        d = decide_repair(_root(), _step(), dep(state=state), T0)
        assert isinstance(d, WaitTransition), state
        assert d.outcome == outcome and d.dependency is None and d.signal is None
        assert d.transition.run is not None and d.transition.run.to_state is run_to
    assert decide_repair(_root(), _step(), dep(), T0) == NoChange("dependency_pending")
    healthy = decide_repair(
        _root(state=RunState.RUNNABLE), _step(), dep(state=DependencyState.RESOLVED), T0
    )
    assert healthy == NoChange("root_not_waiting")


def test_terminal_dependencies_and_signals_can_never_change() -> None:
    for state in (DependencyState.RESOLVED, DependencyState.CANCELLED):
        with pytest.raises(TerminalStateError):
            DependencyPatch("d", 1, DependencyState.EXPIRED, {}, from_state=state)
    with pytest.raises(IllegalTransitionError):
        DependencyPatch("d", 1, DependencyState.PENDING, {})
    with pytest.raises(TerminalStateError):
        SignalPatch(SCOPE, "s", 1, SignalState.EXPIRED, {}, from_state=SignalState.CONSUMED)
    with pytest.raises(IllegalTransitionError):
        SignalPatch(SCOPE, "s", 1, SignalState.UNMATCHED, {})


def test_records_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        dep().state = DependencyState.RESOLVED  # type: ignore[misc]
