"""§17 / §22.6: every durable step declares its execution principal; a system-mode step
(or one handing off to system) requires an explicit declared identity."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from runtime_svc.compiler import compile_plan
from runtime_svc.compiler.diagnostics import PlanCompileError
from runtime_svc.compiler.identity import (
    ExecutionPrincipalMode,
    ReauthorizationPolicy,
    StepPrincipal,
)
from runtime_svc.compiler.inputs import CompilerInputs
from runtime_svc.compiler.kinds import StepKind
from tests.unit.compiler.compiler_corpus import FLOWS, inputs_doc, load_inputs, read_json


def _inputs(security: dict[str, Any] | None) -> CompilerInputs:
    doc = copy.deepcopy(inputs_doc())
    if security is not None:
        for entry in doc["catalog"]["entries"]:
            if entry["action_type"] == "send_email":
                entry["capabilities"]["security"] = security
    return CompilerInputs.from_dict(doc)


def _flow(system_identity: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = read_json(FLOWS / "durable_send_email" / "flow.json")
    if system_identity is not None:
        for e in doc["elements"]:
            if e["api_name"] == "welcome":
                e["system_identity"] = system_identity
    return doc


def _codes(exc: pytest.ExceptionInfo[PlanCompileError]) -> list[str]:
    return [i.code for i in exc.value.issues]


def test_every_durable_step_declares_its_principal_and_terminals_none() -> None:
    plan = compile_plan(_flow(), load_inputs())
    for step in plan.steps:
        if step.kind in (StepKind.TERMINAL, StepKind.EXPLICIT_FAULT):
            assert step.principal is None
        else:
            # The corpus' free-form catalog modes run as the initiating principal, never
            # broader, and the undeclared reauthorization policy is the conservative one.
            assert step.principal == StepPrincipal(
                ExecutionPrincipalMode.INITIATING_PRINCIPAL,
                ReauthorizationPolicy.TERMINAL_FAILURE,
            )


def test_system_mode_step_without_declared_identity_is_a_compile_error() -> None:
    inputs = _inputs({"principal_mode": "system", "reauthorization": "fault_path"})
    with pytest.raises(PlanCompileError) as exc:
        compile_plan(_flow(), inputs)
    assert _codes(exc) == ["principal.system_identity_required"]
    issue = exc.value.issues[0]
    assert issue.path == "elements[welcome].system_identity"
    assert "system mode" in issue.message and "welcome#submit" in issue.message
    assert exc.value.code.name == "INVALID_ARGUMENT"


def test_system_mode_step_with_declared_identity_records_it() -> None:
    inputs = _inputs({"principal_mode": "system", "reauthorization": "fault_path"})
    plan = compile_plan(_flow("svc-mailer"), inputs)
    submit = plan.step("welcome#submit")
    assert submit.principal == StepPrincipal(
        ExecutionPrincipalMode.SYSTEM, ReauthorizationPolicy.FAULT_PATH, "svc-mailer"
    )
    # The other steps have no action: they run as the initiating principal.
    assert plan.step("mark_welcomed").principal == StepPrincipal(
        ExecutionPrincipalMode.INITIATING_PRINCIPAL, ReauthorizationPolicy.TERMINAL_FAILURE
    )


def test_system_handoff_needs_a_declared_identity_too() -> None:
    inputs = _inputs(
        {"principal_mode": "initiating_principal", "reauthorization": "system_handoff"}
    )
    with pytest.raises(PlanCompileError) as exc:
        compile_plan(_flow(), inputs)
    assert _codes(exc) == ["principal.system_identity_required"]
    assert "hands off to system" in exc.value.issues[0].message
    plan = compile_plan(_flow("svc-mailer"), inputs)
    assert plan.step("welcome#submit").principal == StepPrincipal(
        ExecutionPrincipalMode.INITIATING_PRINCIPAL,
        ReauthorizationPolicy.SYSTEM_HANDOFF,
        "svc-mailer",
    )


def test_a_declared_identity_where_none_applies_is_rejected() -> None:
    inputs = _inputs({"principal_mode": "initiating_principal", "reauthorization": "fault_path"})
    with pytest.raises(PlanCompileError) as exc:
        compile_plan(_flow("svc-mailer"), inputs)
    assert _codes(exc) == ["principal.system_identity_not_applicable"]


def test_the_declared_identity_is_part_of_the_plan_identity() -> None:
    inputs = _inputs({"principal_mode": "system", "reauthorization": "fault_path"})
    a = compile_plan(_flow("svc-mailer"), inputs)
    b = compile_plan(_flow("svc-other"), inputs)
    assert a.plan_digest != b.plan_digest
    assert type(a).from_dict(a.to_dict()) == a


def test_step_principal_round_trips_and_rejects_unknown_values() -> None:
    p = StepPrincipal(ExecutionPrincipalMode.SYSTEM, ReauthorizationPolicy.SYSTEM_HANDOFF, "svc-x")
    assert StepPrincipal.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError):
        StepPrincipal.from_dict({"mode": "root", "on_denied": "fault_path"})
