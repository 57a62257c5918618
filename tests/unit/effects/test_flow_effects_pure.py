"""The pure Flow side of external effects (§15.1-§15.4, §10.1): deterministic identities,
the frozen payload, receipt validation and routing, the handoff convergence transitions
and the kernel's HandOff / QuarantineRun commits — no database."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from datetime import timedelta
from typing import Any

import pytest

import runtime_svc.effects.steps as effect_steps
from runtime_svc.effects import (
    MAX_EFFECT_PAYLOAD_BYTES,
    ConsumedReceipt,
    LinkRecord,
    PayloadError,
    ReceiptInvalid,
    Route,
    effect_payload,
    route_completion,
    submit_identities,
    validate_receipt,
)
from runtime_svc.kernel.decisions import Committed, HandOff, NoChange, QuarantineRun
from runtime_svc.kernel.states import AttemptOutcome, FailureClass, RunState, StepState
from runtime_svc.kernel.transitions import decide_commit
from runtime_svc.kernel.transitions_effects import (
    CAUSE_ACCEPTANCE_UNKNOWN,
    CAUSE_CANCELLED_AFTER_EFFECT,
    CAUSE_EFFECT_OUTCOME_UNKNOWN,
    CAUSE_EFFECT_UNREPORTED,
    CAUSE_HANDOFF_REJECTED,
    decide_cancelled_receipt,
    decide_cancelled_unreported,
    decide_handoff_rejected,
    decide_handoff_unknown,
)
from runtime_svc.kernel.transitions_waits import WaitTransition
from runtime_svc.kernel.wait_model import DependencyState, ExpiryPolicyCode, FaultSuccessor
from services.auth import TrustedRuntimeWorkScope
from services.effect_contract import (
    CompletionEvidence,
    CompletionOutcomeCode,
    runtime_outbox_message_id,
)
from tests.unit.kernel.factories import T0, run, step
from tests.unit.kernel.test_kernel_transitions import do_start, new_model, parts
from tests.unit.waits.test_wait_transitions import dep, sig

SCOPE = TrustedRuntimeWorkScope("org_unit", "inst", "cap", "binding")


# --- identities and payload ------------------------------------------------------------


def test_identities_are_deterministic_and_distinct_per_invocation_and_scope() -> None:
    a = submit_identities(SCOPE, flow_run_id="r", submit_step_key="s#submit", invocation_ordinal=0)
    assert a == submit_identities(
        SCOPE, flow_run_id="r", submit_step_key="s#submit", invocation_ordinal=0
    )
    assert a.message_id == runtime_outbox_message_id(a.handoff_key)
    others = [
        submit_identities(SCOPE, flow_run_id="r", submit_step_key="s#submit", invocation_ordinal=1),
        submit_identities(
            dataclasses.replace(SCOPE, app_installation_id="inst2"),
            flow_run_id="r",
            submit_step_key="s#submit",
            invocation_ordinal=0,
        ),
    ]
    for b in others:
        for f in dataclasses.fields(a):
            assert getattr(a, f.name) != getattr(b, f.name), f.name
    assert len({a.completion_step_id, a.dependency_id, a.link_id, a.message_id}) == 4


def test_the_payload_is_canonical_and_safe() -> None:
    assert effect_payload({"to": "a@b.c", "n": 2}) == {"to": "a@b.c", "n": 2}
    with pytest.raises(PayloadError) as cred:
        effect_payload({"body": "Bearer abcdefghijklmnopqrstuvwxyz0123456789"})
    assert cred.value.code == "effect_payload_credential"
    assert "abcdefghijkl" not in str(cred.value)  # the path is named, never the value
    with pytest.raises(PayloadError) as big:
        effect_payload({"body": "x" * (MAX_EFFECT_PAYLOAD_BYTES + 1)})
    assert big.value.code == "effect_payload_too_large"
    with pytest.raises(PayloadError) as odd:
        effect_payload({"n": float("nan")})
    assert odd.value.code == "effect_payload_invalid"


# --- receipts ----------------------------------------------------------------------------


def _ids() -> Any:
    return submit_identities(
        SCOPE, flow_run_id="r", submit_step_key="s#submit", invocation_ordinal=0
    )


def _link(**kw: Any) -> LinkRecord:
    ids = _ids()
    values = {
        "org_id": "org_unit",
        "app_installation_id": "inst",
        "runtime_capability_id": "cap",
        "runtime_work_binding_digest": "binding",
        "effect_link_id": ids.link_id,
        "flow_run_id": "r",
        "step_execution_id": "step_submit",
        "effect_owner_kind": "email.smtp",
        "runtime_outbox_message_id": ids.message_id,
        "effect_handoff_key": ids.handoff_key,
        "submission_attempt_id": "att",
    }
    values.update(kw)
    return LinkRecord(**values)


def _receipt(outcome: CompletionOutcomeCode = CompletionOutcomeCode.SUCCEEDED, **kw: Any) -> Any:
    ev = CompletionEvidence(
        command_id="cmd_1",
        outcome_version=1,
        outcome=outcome,
        effect_owner_kind=kw.pop("owner", "email.smtp"),
        effect_handoff_key=kw.pop("key", _ids().handoff_key),
    )
    values = {
        "producer_kind": "effect.completion",
        "producer_key": _ids().handoff_key,
        "wake_token": ev.wake_token,
        "wake_version": 1,
        "evidence_digest": ev.digest(),
        "evidence_json": ev.to_json(),
        "dependency_wake_version": 1,
    }
    values.update(kw)
    return ConsumedReceipt(**values)


def _validate(receipt: ConsumedReceipt, link: LinkRecord | None) -> CompletionEvidence:
    return validate_receipt(
        receipt,
        link,
        producer_kind="effect.completion",
        handoff_key=_ids().handoff_key,
        owner_kind="email.smtp",
        flow_run_id="r",
    )


def test_a_matching_receipt_validates() -> None:
    ev = _validate(_receipt(), _link())
    assert ev.command_id == "cmd_1" and ev.outcome is CompletionOutcomeCode.SUCCEEDED


@pytest.mark.parametrize(
    ("receipt", "link", "code"),
    [
        (_receipt(), None, "effect_link_missing"),
        (_receipt(), _link(effect_owner_kind="webhook.http"), "effect_link_owner_mismatch"),
        (_receipt(), _link(flow_run_id="other"), "effect_link_run_mismatch"),
        (_receipt(), _link(runtime_outbox_message_id="rob_x"), "effect_link_message_mismatch"),
        (_receipt(producer_kind="external.signal"), _link(), "effect_receipt_kind_mismatch"),
        (_receipt(owner="webhook.http"), _link(), "effect_evidence_owner_mismatch"),
        (_receipt(evidence_digest="wake-evidence/v1:sha256:" + "0" * 64), _link(),
         "effect_evidence_digest_mismatch"),
        (_receipt(wake_token="cmd_2/1"), _link(), "effect_wake_token_mismatch"),
        (_receipt(wake_version=2), _link(), "effect_outcome_version_mismatch"),
        (_receipt(dependency_wake_version=3), _link(), "effect_outcome_version_mismatch"),
        (_receipt(evidence_json='{"x": 1}'), _link(), "effect_receipt_malformed"),
        (_receipt(evidence_json=None), _link(), "effect_receipt_evidence_missing"),
    ],
)  # fmt: skip
def test_any_disagreement_between_receipt_and_link_is_refused(
    receipt: ConsumedReceipt, link: LinkRecord | None, code: str
) -> None:
    with pytest.raises(ReceiptInvalid) as err:
        _validate(receipt, link)
    assert err.value.code == code


_O, _P = CompletionOutcomeCode, ExpiryPolicyCode


@pytest.mark.parametrize(
    ("outcome", "policy", "fault", "route"),
    [
        (_O.SUCCEEDED, _P.FAULT_PATH, True, Route.SUCCESS),
        (_O.SUCCEEDED, _P.QUARANTINE, False, Route.SUCCESS),
        (_O.FAILED, _P.FAULT_PATH, True, Route.FAULT_PATH),
        (_O.FAILED, _P.QUARANTINE, False, Route.TERMINAL_FAILURE),
        (_O.OUTCOME_UNKNOWN, _P.FAULT_PATH, True, Route.FAULT_PATH),
        (_O.OUTCOME_UNKNOWN, _P.QUARANTINE, False, Route.QUARANTINE),
    ],
)
def test_routing_of_a_validated_receipt(
    outcome: CompletionOutcomeCode, policy: ExpiryPolicyCode, fault: bool, route: Route
) -> None:
    assert route_completion(outcome, policy, has_fault_path=fault).route is route


def test_the_completion_step_has_no_path_to_the_outbox() -> None:
    """§15.2: only ``commit_tail`` enqueues (its ``writes`` builds the message's INSERT,
    its ``settle`` answers for it), it takes a ``PreparedSubmit``, and only the submit
    branch builds one — the completion branch returns none."""
    tree = ast.parse(inspect.getsource(effect_steps))
    callers, builders = set(), set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in ("enqueue_write", "enqueue_settle", "enqueue_txn"):
                    callers.add(fn.name)
                if node.func.id == "PreparedSubmit":
                    builders.add(fn.name)
    assert callers == {"commit_tail", "writes", "settle"}  # the two nested in commit_tail
    tail = inspect.signature(effect_steps.EffectSteps.commit_tail)
    assert tail.parameters["prepared"].annotation in ("PreparedSubmit", effect_steps.PreparedSubmit)
    assert builders == {"_submit"}
    completion = inspect.getsource(effect_steps.EffectSteps._completion)
    completion += inspect.getsource(effect_steps.EffectSteps._route)
    assert "enqueue" not in completion and "PreparedSubmit" not in completion


# --- kernel: HandOff and QuarantineRun commits --------------------------------------------


def test_handoff_commit_succeeds_the_submit_and_creates_the_waiting_completion() -> None:
    m = _commit_inputs()
    decision = decide_commit(
        *m,
        HandOff("step_completion", "s#completion", "EffectCompletion", "effect_completion"),
        "ck",
    )
    assert isinstance(decision, Committed) and decision.run_state is RunState.WAITING
    t = decision.transition
    assert t.step is not None and t.step.to_state is StepState.SUCCEEDED
    assert t.attempt is not None and t.attempt.to_state is AttemptOutcome.COMMITTED
    assert t.new_step is not None and t.new_step.state is StepState.WAITING
    assert t.new_step.input_checkpoint_id == "ck"
    assert t.run is not None and t.run.current_step_execution_id == "step_completion"


def test_quarantine_commit_ends_step_and_root_quarantined() -> None:
    decision = decide_commit(*_commit_inputs(), QuarantineRun("effect_receipt_invalid"), "ck")
    assert isinstance(decision, Committed) and decision.run_state is RunState.QUARANTINED
    t = decision.transition
    assert t.step is not None and t.step.to_state is StepState.QUARANTINED
    assert t.step.failure_class is FailureClass.AMBIGUOUS
    assert t.run is not None and t.run.terminal_cause_code == "effect_receipt_invalid"


def _commit_inputs() -> tuple[Any, Any, Any, Any, Any]:
    """A claimed, Running step of a fresh run and its worker's fence."""
    m = new_model()
    do_start(m)
    root, s, a, fence = parts(m)
    return root, s, a, fence, T0


# --- convergence transitions ---------------------------------------------------------------


def _effect_dep(**kw: Any) -> Any:
    return dep(producer_kind="effect.completion", expiry_policy=ExpiryPolicyCode.FAULT_PATH, **kw)


def _waiting() -> tuple[Any, Any]:
    return (
        run(state=RunState.WAITING, interview_status="Paused", paused_at=T0),
        step(state=StepState.WAITING, lease_owner=None, lease_token_digest=None),
    )


def _cancelling() -> tuple[Any, Any]:
    return (
        run(state=RunState.CANCEL_REQUESTED, interview_status="Error", delete_requested_at=T0),
        step(state=StepState.CANCEL_REQUESTED, lease_owner=None, lease_token_digest=None),
    )


def test_rejection_of_a_waiting_run_takes_the_compiled_fault_path() -> None:
    root, s = _waiting()
    fault = FaultSuccessor("step_f", "failed", "BoundedMutation", "durable_mutation", 0)
    out = decide_handoff_rejected(root, s, _effect_dep(), T0, fault=fault)
    assert isinstance(out, WaitTransition) and out.outcome == "fault_path"
    assert out.dependency is not None and out.dependency.to_state is DependencyState.EXPIRED
    assert out.transition.run is not None and out.transition.run.to_state is RunState.RUNNABLE
    # Without a resolvable successor: quarantine, never a guess.
    out = decide_handoff_rejected(root, s, _effect_dep(), T0, fault=None)
    assert isinstance(out, WaitTransition) and out.cause_code == CAUSE_HANDOFF_REJECTED
    assert out.transition.run is not None and out.transition.run.to_state is RunState.QUARANTINED


def test_rejection_of_a_cancelling_run_completes_the_cancellation() -> None:
    root, s = _cancelling()
    out = decide_handoff_rejected(root, s, _effect_dep(), T0)
    assert isinstance(out, WaitTransition) and out.cause_code == "cancelled"
    assert out.dependency is not None and out.dependency.to_state is DependencyState.CANCELLED
    assert out.transition.run is not None and out.transition.run.to_state is RunState.CANCELLED
    assert out.transition.step is not None
    assert out.transition.step.to_state is StepState.CANCELLED


@pytest.mark.parametrize("cancelling", [False, True])
def test_acceptance_unknown_quarantines_dependency_step_and_root(cancelling: bool) -> None:
    root, s = _cancelling() if cancelling else _waiting()
    out = decide_handoff_unknown(root, s, _effect_dep(), T0)
    assert isinstance(out, WaitTransition) and out.cause_code == CAUSE_ACCEPTANCE_UNKNOWN
    assert out.dependency is not None and out.dependency.to_state is DependencyState.QUARANTINED
    assert out.transition.run is not None and out.transition.run.to_state is RunState.QUARANTINED
    assert out.transition.step is not None
    assert out.transition.step.to_state is StepState.QUARANTINED


@pytest.mark.parametrize(
    ("outcome", "state", "cause"),
    [
        ("SUCCEEDED", RunState.CANCELLED, CAUSE_CANCELLED_AFTER_EFFECT),
        ("FAILED", RunState.CANCELLED, "cancelled"),
        ("OUTCOME_UNKNOWN", RunState.QUARANTINED, CAUSE_EFFECT_OUTCOME_UNKNOWN),
    ],
)
def test_a_receipt_for_a_cancelling_run_is_kept_and_named(
    outcome: str, state: RunState, cause: str
) -> None:
    root, s = _cancelling()
    d = _effect_dep(producer_key="k")
    signal = sig(producer_kind="effect.completion", producer_key="k", wake_version=1)
    out = decide_cancelled_receipt(
        root, s, d, signal, T0, outcome=outcome, receipt={"outcome": outcome}
    )
    assert isinstance(out, WaitTransition) and out.cause_code == cause
    assert out.transition.run is not None and out.transition.run.to_state is state
    assert out.dependency is not None and out.dependency.to_state is DependencyState.RESOLVED
    assert out.signal is not None  # consumed in the same transition


def test_transitions_refuse_anything_but_their_own_pending_wait() -> None:
    root, s = _waiting()
    done = _effect_dep(state=DependencyState.RESOLVED)
    assert isinstance(decide_handoff_rejected(root, s, done, T0), NoChange)
    assert isinstance(decide_handoff_unknown(root, s, done, T0), NoChange)
    other = step(step_execution_id="step_2", state=StepState.WAITING)
    assert isinstance(decide_handoff_unknown(root, other, _effect_dep(), T0), NoChange)
    # A receipt for a run that is not cancelling is the normal resolution's business.
    signal = sig(producer_kind="effect.completion", producer_key="approval:1")
    out = decide_cancelled_receipt(
        root, s, _effect_dep(), signal, T0, outcome="SUCCEEDED", receipt={}
    )
    assert out == NoChange("root_not_cancelling")


def test_an_unreported_accepted_effect_quarantines_a_cancelling_run_only_when_due() -> None:
    root, s = _cancelling()
    d = _effect_dep(deadline=T0 + timedelta(days=1))
    assert decide_cancelled_unreported(root, s, d, T0) == NoChange("not_due")
    out = decide_cancelled_unreported(root, s, d, T0 + timedelta(days=2))
    assert isinstance(out, WaitTransition) and out.cause_code == CAUSE_EFFECT_UNREPORTED
