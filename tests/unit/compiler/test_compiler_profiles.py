"""Profile selection (§9), exact transitive blockers, recursion and effect pairs (§7.5)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_svc.compiler import (
    CompilerInputs,
    ExecutionProfile,
    PlanCompileError,
    StepKind,
    compile_plan,
    validate_effect_pairs,
)
from runtime_svc.compiler.kinds import EdgeKind
from runtime_svc.compiler.plan import Transition
from tests.unit.compiler.compiler_corpus import (
    FLOWS,
    autolaunched,
    inputs_doc,
    load_inputs,
    read_json,
    with_subflows,
)


def _fail(source: dict[str, Any], inputs: CompilerInputs | None = None) -> PlanCompileError:
    with pytest.raises(PlanCompileError) as info:
        compile_plan(source, inputs or load_inputs())
    return info.value


def _send(name: str = "send") -> dict[str, Any]:
    return {
        "api_name": name,
        "type": "ActionCall",
        "action_type": "send_email",
        "inputs": {"to": "'a@example.com'", "subject": "'hi'"},
    }


# ------------------------------------------------------------ exact blockers


def test_atomic_request_names_the_two_level_transitive_blocker() -> None:
    inner = autolaunched("inner_mail", [_send("deliver")])
    middle = autolaunched(
        "middle", [{"api_name": "relay", "type": "Subflow", "flow": "inner_mail", "version": 1}]
    )
    top = autolaunched(
        "top",
        [{"api_name": "outer", "type": "Subflow", "flow": "middle", "version": 1}],
        run_atomically=True,
    )
    err = _fail(top, with_subflows(inner, middle))
    issue = next(i for i in err.issues if i.code == "atomic_unsafe.external_effect")
    assert issue.blocker_chain == ("Subflow outer", "Subflow relay", "ActionCall deliver")
    assert issue.path == "elements[outer]"
    assert (
        "Subflow outer → Subflow relay → ActionCall deliver: execution class external_effect"
        in issue.message
    )
    assert err.codes() == ("atomic_unsafe.external_effect",)


def test_the_same_flow_without_the_request_is_durable_and_says_why() -> None:
    inner = autolaunched("inner_mail", [_send("deliver")])
    top = autolaunched(
        "top", [{"api_name": "outer", "type": "Subflow", "flow": "inner_mail", "version": 1}]
    )
    plan = compile_plan(top, with_subflows(inner))
    assert plan.profile is ExecutionProfile.DURABLE_ORCHESTRATION
    assert plan.requested_profile is None
    assert [d.code for d in plan.diagnostics] == ["profile.not_atomic.external_effect"]
    assert plan.diagnostics[0].blocker_chain == ("Subflow outer", "ActionCall deliver")
    assert {"outer/deliver#submit", "outer/deliver#completion"} <= set(plan.step_keys)


def test_corpus_rejection_names_subflow_and_action() -> None:
    diag = read_json(FLOWS / "reject_atomic_subflow_effect" / "diagnostics.json")
    chains = {tuple(i["blocker_chain"]) for i in diag["issues"]}
    assert chains == {("Subflow notify", "ActionCall send_note")}


def test_no_silent_fallback_unless_the_policy_maps_it_visibly() -> None:
    src = read_json(FLOWS / "legacy_atomic_mapped_durable" / "flow.json")
    err = _fail(src)
    assert err.codes() == ("atomic_unsafe.wait",)
    mapped = compile_plan(
        src,
        load_inputs({"policy": {"version": 9, "legacy_atomic_mapping": "durable_orchestration"}}),
    )
    assert mapped.profile is ExecutionProfile.DURABLE_ORCHESTRATION
    assert mapped.requested_profile is ExecutionProfile.BOUNDED_ATOMIC
    assert [d.code for d in mapped.diagnostics] == ["profile.atomic_mapped_to_durable"]
    assert "policy v9" in mapped.diagnostics[0].message


def test_atomic_selected_automatically_when_provable() -> None:
    plan = compile_plan(read_json(FLOWS / "atomic_contact_loop" / "flow.json"), load_inputs())
    assert plan.profile is ExecutionProfile.BOUNDED_ATOMIC
    assert plan.bounds.max_writes == 200
    assert [s.key for s in plan.steps] == ["$atomic", "$end", "$failed"]


def test_policy_bound_change_flips_eligibility() -> None:
    src = read_json(FLOWS / "atomic_contact_loop" / "flow.json")
    tight = load_inputs({"policy": {"version": 5, "bounded_atomic": {"max_writes": 199}}})
    plan = compile_plan(src, tight)
    assert plan.profile is ExecutionProfile.DURABLE_ORCHESTRATION
    assert any(
        "writes 200 exceeds the bounded_atomic bound 199 (policy v5)" in d.message
        for d in plan.diagnostics
    )


# ------------------------------------------------------------ unknown capabilities

_FIELDS = [
    "transaction_policy",
    "replay_policy",
    "fanout_bound",
    "read_contract",
    "lock_plan",
    "effect_owner",
    "idempotency",
    "output_durability",
    "security",
    "minimum_capability_version",
]


@settings(max_examples=30, deadline=None)
@given(missing=st.sets(st.sampled_from(_FIELDS), min_size=1))
def test_unknown_capabilities_fail_closed_for_bounded_atomic(missing: set[str]) -> None:
    doc = inputs_doc()
    entry = next(e for e in doc["catalog"]["entries"] if e["action_type"] == "apply_discount")
    for f in missing:
        entry["capabilities"].pop(f)
    inputs = CompilerInputs.from_dict(doc)
    src = autolaunched(
        "discounter",
        [
            {
                "api_name": "apply",
                "type": "ActionCall",
                "action_type": "apply_discount",
                "inputs": {"opportunityId": "oppId", "percent": "5"},
            }
        ],
        variables=[{"name": "oppId", "type": "string", "input": True}],
        run_atomically=True,
    )
    err = _fail(src, inputs)
    unknown = {
        i.message.split("capability ")[1].split(" ")[0]
        for i in err.issues
        if i.code == "atomic_unsafe.unknown_capability"
    }
    assert unknown == missing
    assert all(i.blocker_chain == ("ActionCall apply",) for i in err.issues)
    # Without the request the Flow runs Durable - unless its mutation fan-out is
    # unknown, which no short transaction may cross in any profile.
    src.pop("run_atomically")
    if "fanout_bound" in missing:
        assert _fail(src, inputs).codes() == ("transaction.unbounded_mutation",)
    else:
        assert compile_plan(src, inputs).profile is ExecutionProfile.DURABLE_ORCHESTRATION


def test_missing_execution_class_fails_every_profile() -> None:
    src = autolaunched(
        "m", [{"api_name": "x", "type": "ActionCall", "action_type": "mystery_action"}]
    )
    assert _fail(src).codes() == ("capability.execution_class_unknown",)


# ------------------------------------------------------------ recursion


@pytest.mark.parametrize("cycle_len", [1, 2, 3])
def test_recursive_subflows_are_rejected(cycle_len: int) -> None:
    names = [f"r{i}" for i in range(cycle_len)]
    flows = [
        autolaunched(
            n,
            [
                {
                    "api_name": f"call_{n}",
                    "type": "Subflow",
                    "flow": names[(i + 1) % cycle_len],
                    "version": 1,
                }
            ],
        )
        for i, n in enumerate(names)
    ]
    top = autolaunched("entry", [{"api_name": "go", "type": "Subflow", "flow": "r0", "version": 1}])
    err = _fail(top, with_subflows(*flows))
    assert err.codes() == ("subflow.recursive",)
    (issue,) = err.issues
    assert issue.path == "elements[go]"
    cycle = " → ".join(f"{n}@1" for n in [*names, names[0]])
    assert cycle in issue.message
    assert issue.blocker_chain[0] == "Subflow go"


def test_diamond_subflows_are_not_recursion() -> None:
    leaf = autolaunched("leaf", [{"api_name": "noop", "type": "End"}])
    left = autolaunched(
        "left", [{"api_name": "l", "type": "Subflow", "flow": "leaf", "version": 1}]
    )
    right = autolaunched(
        "right", [{"api_name": "r", "type": "Subflow", "flow": "leaf", "version": 1}]
    )
    top = autolaunched(
        "diamond",
        [
            {"api_name": "a", "type": "Subflow", "flow": "left", "version": 1, "next": "b"},
            {"api_name": "b", "type": "Subflow", "flow": "right", "version": 1},
        ],
    )
    plan = compile_plan(top, with_subflows(leaf, left, right))
    assert [(s.api_name, s.version) for s in plan.subflows] == [
        ("leaf", 1),
        ("left", 1),
        ("right", 1),
    ]
    assert {"a/l/noop", "b/r/noop"} <= {n.id for n in plan.nodes}


def test_record_triggered_flow_cannot_be_a_subflow() -> None:
    child = read_json(FLOWS / "atomic_close_won" / "flow.json")
    top = autolaunched(
        "caller", [{"api_name": "c", "type": "Subflow", "flow": "atomic_close_won", "version": 1}]
    )
    assert "subflow.not_autolaunched" in _fail(top, with_subflows(child)).codes()


# ------------------------------------------------------------ effect pairs


def _effect_plan() -> Any:
    return compile_plan(read_json(FLOWS / "durable_send_email" / "flow.json"), load_inputs())


def test_compiled_effect_pairs_are_valid() -> None:
    plan = _effect_plan()
    assert validate_effect_pairs(plan.steps) == []
    submit, completion = plan.step("welcome#submit"), plan.step("welcome#completion")
    assert submit.kind is StepKind.EFFECT_SUBMIT and completion.kind is StepKind.EFFECT_COMPLETION
    assert submit.transitions == (
        Transition(EdgeKind.WAIT, "handoff", "welcome", "welcome#completion"),
    )
    assert (
        completion.dependency is not None and completion.dependency.key == "handoff:welcome#submit"
    )
    assert submit.effect == completion.effect
    assert len([s for s in plan.steps if s.kind is StepKind.EFFECT_SUBMIT]) == 1


def _replace_step(steps: Any, key: str, **changes: Any) -> list[Any]:
    return [replace(s, **changes) if s.key == key else s for s in steps]


def test_self_wait_is_rejected() -> None:
    steps = _replace_step(
        _effect_plan().steps,
        "welcome#submit",
        transitions=(Transition(EdgeKind.WAIT, "handoff", "welcome", "welcome#submit"),),
    )
    codes = {i.code for i in validate_effect_pairs(steps)}
    assert {"effect.self_wait", "effect.submit_edges"} <= codes


def test_return_edge_from_completion_to_submit_is_rejected() -> None:
    plan = _effect_plan()
    steps = _replace_step(
        plan.steps,
        "mark_welcomed",
        transitions=(Transition(EdgeKind.SUCCESS, "next", "mark_welcomed", "welcome#submit"),),
    )
    assert [i.code for i in validate_effect_pairs(steps)] == ["effect.return_edge"]


def test_completion_without_submit_is_rejected() -> None:
    steps = [s for s in _effect_plan().steps if s.key != "welcome#submit"]
    assert [i.code for i in validate_effect_pairs(steps)] == ["effect.orphan_completion"]


def test_submit_with_two_completions_is_rejected() -> None:
    plan = _effect_plan()
    comp = plan.step("welcome#completion")
    steps = [*plan.steps, replace(comp, key="welcome#completion2")]
    codes = [i.code for i in validate_effect_pairs(steps)]
    assert "effect.completion_count" in codes


def test_completion_depending_on_the_wrong_receipt_is_rejected() -> None:
    plan = _effect_plan()
    comp = plan.step("welcome#completion")
    assert comp.dependency is not None
    steps = _replace_step(
        plan.steps, comp.key, dependency=replace(comp.dependency, key="handoff:elsewhere")
    )
    assert [i.code for i in validate_effect_pairs(steps)] == ["effect.dependency_target"]


def test_effect_in_loop_returns_only_through_the_loop_head() -> None:
    plan = compile_plan(read_json(FLOWS / "durable_loop_with_effect" / "flow.json"), load_inputs())
    assert validate_effect_pairs(plan.steps) == []
    assert plan.step("each_contact").checkpoint is not None
    assert plan.step("each_contact").checkpoint.cursor == ("each_contact.index",)  # type: ignore[union-attr]


# ------------------------------------------------------------ embedded


def test_before_save_runs_embedded_or_not_at_all() -> None:
    ok = compile_plan(read_json(FLOWS / "embedded_discount_transform" / "flow.json"), load_inputs())
    assert ok.profile is ExecutionProfile.EMBEDDED_BEFORE_SAVE
    assert ok.step("$embedded").kind is StepKind.EMBEDDED_TRANSFORM
    assert ok.step("$embedded").checkpoint is None  # no durable root on the hot path
    bad = _fail(read_json(FLOWS / "reject_before_save_side_effects" / "flow.json"))
    assert {i.code.split(".")[0] for i in bad.issues} == {"before_save_ineligible"}
