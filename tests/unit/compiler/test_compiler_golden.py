"""Golden corpus: every Flow under ``tests/flows`` compiles byte-identically.

Regenerate after an intended change with ``UPDATE_GOLDEN=1 pytest tests/unit/compiler``
and review the diff: a changed golden plan is a changed plan identity.
"""

from __future__ import annotations

import json
import os

import pytest

from runtime_svc.compiler import ExecutionPlan, ExecutionProfile, StepKind
from runtime_svc.compiler.language import ElementType
from tests.unit.compiler.compiler_corpus import (
    FLOWS,
    OUTPUT_FILES,
    flow_names,
    read_json,
    render_case,
)

UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"


@pytest.mark.parametrize("name", flow_names())
def test_golden_case(name: str) -> None:
    case = FLOWS / name
    rendered = render_case(name)
    if UPDATE:
        for f in OUTPUT_FILES:
            (case / f).unlink(missing_ok=True)
        for f, text in rendered.items():
            (case / f).write_text(text, encoding="utf-8")
    for f in OUTPUT_FILES:
        path = case / f
        if f in rendered:
            assert path.exists(), f"{name}/{f} missing; run with UPDATE_GOLDEN=1"
            assert path.read_text(encoding="utf-8") == rendered[f], (
                f"{name}/{f} differs from a fresh compile"
            )
        else:
            assert not path.exists(), (
                f"{name}/{f} is stale: the case now renders {sorted(rendered)}"
            )


def _plans() -> dict[str, ExecutionPlan]:
    return {
        n: ExecutionPlan.from_dict(read_json(FLOWS / n / "plan.json"))
        for n in flow_names()
        if (FLOWS / n / "plan.json").exists()
    }


def _issue_codes() -> set[str]:
    codes: set[str] = set()
    for n in flow_names():
        p = FLOWS / n / "diagnostics.json"
        if p.exists():
            codes |= {i["code"] for i in read_json(p)["issues"]}
    return codes


def test_corpus_size_and_element_coverage() -> None:
    names = flow_names()
    assert len(names) >= 25
    seen: set[str] = set()
    for n in names:
        seen |= {
            str(e.get("type"))
            for e in read_json(FLOWS / n / "flow.json")["elements"]
            if isinstance(e, dict)
        }
    assert {t.value for t in ElementType} <= seen


def test_corpus_covers_every_profile_and_step_kind() -> None:
    plans = _plans()
    assert {p.profile for p in plans.values()} == set(ExecutionProfile)
    kinds = {s.kind for p in plans.values() for s in p.steps}
    assert kinds == set(StepKind)


def test_golden_plans_round_trip_and_verify() -> None:
    for name, plan in _plans().items():
        assert plan.verify(), name
        assert ExecutionPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan, name


def test_corpus_covers_every_rejection_class() -> None:
    required = {
        # §7.2 step 1-2: parse, normalize, resolve
        "source.unknown_field",
        "source.duplicate_name",
        "expression.syntax",
        "graph.unknown_target",
        "expression.unknown_variable",
        "metadata.unknown_field",
        "metadata.unknown_object",
        "action.unknown",
        "action.contract_only",
        "subflow.missing",
        "catalog.not_sealed",
        "inputs.binding_mismatch",
        "trigger.not_subscribed",
        "trigger.subscription_mismatch",
        # step 3-4: graph and recursion
        "graph.cycle",
        "loop.body_does_not_return",
        "subflow.recursive",
        # step 5-7: capabilities and bounds
        "capability.execution_class_unknown",
        "checkpoint.sensitive_output",
        # step 9: transaction / checkpoint / wait boundaries
        "transaction.unbounded_mutation",
        "effect.no_owner",
        "wait.deadline_exceeds_policy",
        "wait.fault_path_without_connector",
        "wait.unregistered_producer",
        # steps 10-11 and §9: profile rules
        "atomic_unsafe.external_effect",
        "atomic_unsafe.wait",
        "atomic_unsafe.unknown_capability",
        "atomic_unsafe.unbounded_loop",
        "atomic_unsafe.exceeds_policy",
        "atomic_unsafe.replay_policy",
        "atomic_unsafe.transaction_policy",
        "before_save_ineligible.writes_other_records",
        "before_save_ineligible.wait",
        "before_save_ineligible.external_effect",
        "before_save_ineligible.unbounded_fanout",
        "profile.atomic_request_before_save",
    }
    assert required <= _issue_codes()
