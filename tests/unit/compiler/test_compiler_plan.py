"""Public surface, plan storage form, operator views and input decoding."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
import yaml

from runtime_svc import compiler
from runtime_svc.compiler import (
    CapabilityDescriptor,
    CompilerInputs,
    ExecutionPlan,
    ExecutionProfile,
    FlowSourceError,
    PlanCompileError,
    RuntimePolicy,
    StepKind,
    compile_plan,
    explain,
    inventory_entry,
    load_flow_text,
    to_mermaid,
)
from runtime_svc.compiler.inputs import FieldError
from services.errors import InvalidArgumentError
from tests.unit.compiler.compiler_corpus import (
    FLOWS,
    autolaunched,
    inputs_doc,
    load_inputs,
    read_flow,
    read_json,
)


def _src(name: str) -> dict[str, Any]:
    return read_flow(name)


def test_public_exports_are_pinned() -> None:
    assert sorted(compiler.__all__) == [
        "COMPILER_VERSION",
        "CapabilityDescriptor",
        "CapabilityEntryView",
        "CatalogGenerationRef",
        "CompileIssue",
        "CompilerInputs",
        "Diagnostic",
        "EdgeKind",
        "Evaluator",
        "ExecutionPlan",
        "ExecutionProfile",
        "ExpiryPolicy",
        "ExpressionError",
        "ExpressionEvalError",
        "FlowDef",
        "FlowSourceError",
        "InventoryEntry",
        "MetadataViewInput",
        "PlanCompileError",
        "PlanStep",
        "QueueClass",
        "RuntimePolicy",
        "RuntimeWorkBindingRef",
        "Severity",
        "StepKind",
        "compile_plan",
        "evaluate",
        "evaluator",
        "explain",
        "inventory_entry",
        "load_flow_text",
        "parse_expression",
        "to_mermaid",
        "unparse",
        "validate_effect_pairs",
    ]
    for name in compiler.__all__:
        assert getattr(compiler, name) is not None


def test_load_flow_text_accepts_json_and_yaml() -> None:
    doc = _src("durable_send_email")
    assert load_flow_text(json.dumps(doc)) == doc
    assert load_flow_text(yaml.safe_dump(doc)) == doc
    from_yaml = compile_plan(yaml.safe_dump(doc), load_inputs())
    assert from_yaml == compile_plan(doc, load_inputs())


@pytest.mark.parametrize("text", ["[1, 2]", "just words", "a: [unclosed", ""])
def test_load_flow_text_rejects_non_mappings(text: str) -> None:
    with pytest.raises(FlowSourceError):
        load_flow_text(text)


def test_undecodable_text_is_one_compile_issue() -> None:
    with pytest.raises(PlanCompileError) as info:
        compile_plan("- not a mapping", load_inputs())
    assert info.value.codes() == ("source.undecodable",)


def test_compile_error_is_an_invalid_argument_with_every_issue() -> None:
    with pytest.raises(PlanCompileError) as info:
        compile_plan(_src("reject_unresolved_references"), load_inputs())
    err = info.value
    assert isinstance(err, InvalidArgumentError)
    assert not err.retryable
    assert err.reason == "plan_compile_failed"
    assert err.field_path == err.issues[0].path
    assert err.attributes["issue_count"] == str(len(err.issues)) and len(err.issues) >= 10
    assert list(err.issues) == sorted(err.issues)
    assert err.to_dict() == read_json(FLOWS / "reject_unresolved_references" / "diagnostics.json")


def test_plan_is_frozen_and_verifies_its_digests() -> None:
    plan = compile_plan(_src("durable_snapshot_verify"), load_inputs())
    with pytest.raises(AttributeError):
        plan.profile = ExecutionProfile.BOUNDED_ATOMIC  # type: ignore[misc]
    assert plan.verify()
    tampered = replace(
        plan, steps=tuple(replace(s, kind=StepKind.PURE_COMPUTE) for s in plan.steps)
    )
    assert not tampered.verify()
    relabeled = ExecutionPlan.from_dict({**plan.to_dict(), "compiler_version": "other"})
    assert not relabeled.verify()


def test_plan_pins_entries_and_binding() -> None:
    plan = compile_plan(_src("durable_send_email"), load_inputs())
    doc = inputs_doc()
    entry = next(e for e in doc["catalog"]["entries"] if e["action_type"] == "send_email")
    (pin,) = plan.actions
    assert (pin.entry_digest, pin.binding_fingerprint) == (
        entry["entry_digest"],
        entry["binding_fingerprint"],
    )
    assert plan.step("welcome#submit").actions == (pin,)
    assert plan.binding.metadata_view_digest == doc["metadata_view"]["digest"]
    assert plan.catalog.catalog_digest == doc["catalog"]["generation"]["catalog_digest"]
    assert plan.trigger_binding_digest.startswith("trigger-binding/v1:sha256:")
    assert plan.plan_digest.startswith("plan/v1:sha256:")


def test_snapshot_reads_are_verified_by_later_mutations() -> None:
    plan = compile_plan(_src("durable_snapshot_verify"), load_inputs())
    assert plan.step("load_account").kind is StepKind.VERIFIED_SNAPSHOT_READ
    assert plan.step("review_account").verifies == ("load_account",)


def test_explain_shows_profile_steps_resources_proofs_and_diagnostics() -> None:
    plan = compile_plan(_src("durable_unbounded_loop"), load_inputs())
    text = explain(plan)
    assert "Profile: durable_orchestration (requested: none)" in text
    for s in plan.steps:
        assert f"[{s.kind.value}] {s.key}" in text
    assert "resource: record Opportunity key=variable:o bound=1" in text
    assert "each_opp: bound unknown (get_opps: query on Opportunity has no limit" in text
    assert "warning checkpoint.unbounded_read" in text


def test_mermaid_draws_every_step_and_transition() -> None:
    plan = compile_plan(_src("durable_send_email"), load_inputs())
    chart = to_mermaid(plan)
    lines = chart.splitlines()
    assert lines[0] == "flowchart TD"
    assert len([ln for ln in lines if "<br/>" in ln]) == len(plan.steps)
    edges = [ln for ln in lines if "|" in ln]
    assert len(edges) == sum(len(s.transitions) for s in plan.steps)
    assert any("==>|wait: handoff|" in ln for ln in edges)
    assert any("-.->|fault: fault|" in ln for ln in edges)
    assert lines[-1].startswith("    start((start)) --> ")


def test_unreachable_elements_are_warned_and_left_out() -> None:
    src = autolaunched(
        "island",
        [{"api_name": "a", "type": "End"}, {"api_name": "orphan", "type": "End"}],
    )
    plan = compile_plan(src, load_inputs())
    assert [d.code for d in plan.diagnostics] == ["graph.unreachable"]
    assert "orphan" not in {n.id for n in plan.nodes}


def test_inputs_decoding_reports_paths() -> None:
    doc = inputs_doc()
    del doc["binding"]["org_id"]
    with pytest.raises(FieldError, match=r"binding\.org_id"):
        CompilerInputs.from_dict(doc)
    bad_policy = {**inputs_doc()["policy"], "legacy_atomic_mapping": "maybe"}
    with pytest.raises(FieldError, match="legacy_atomic_mapping"):
        RuntimePolicy.from_dict(bad_policy)


def test_missing_capabilities_are_unknown_not_defaulted() -> None:
    desc = CapabilityDescriptor.from_dict({}, "x")
    assert len(desc.unknown_fields()) == 11
    assert (
        CapabilityDescriptor.from_dict({"execution_class": "teleport"}, "x").execution_class.value
        == "unknown"
    )


def test_policy_digest_covers_every_bound() -> None:
    policy = load_inputs().policy
    bumped = replace(policy, bounded_atomic=replace(policy.bounded_atomic, max_reads=501))
    assert bumped.policy_digest() != policy.policy_digest()
    assert replace(policy).policy_digest() == policy.policy_digest()


@pytest.mark.parametrize(
    ("name", "cohort"),
    [
        ("reject_atomic_wait", 1),
        ("autolaunched_pure_compute", 2),
        ("embedded_discount_transform", 3),
        ("atomic_close_won", 4),
        ("durable_wait_time_fault_path", 5),
        ("durable_wait_event_terminal", 6),
        ("durable_send_email", 7),
        ("durable_subflow_effect", 8),
        ("durable_unbounded_loop", 8),
    ],
)
def test_inventory_rows_and_cohorts(name: str, cohort: int) -> None:
    row = inventory_entry(_src(name), load_inputs())
    assert row.cohort == cohort
    assert row.api_name == name
    if cohort == 1:
        assert row.profile is None and row.rejections and row.legacy_behavior == ("run_atomically",)
    else:
        assert row.profile is not None and row.step_boundaries and not row.rejections
    assert json.loads(json.dumps(row.to_dict()))["cohort"] == cohort


def test_inventory_reports_unknown_capabilities_and_loop_proofs() -> None:
    row = inventory_entry(_src("reject_atomic_unknown_capability"), load_inputs())
    assert len(row.unknown_capabilities) == 6
    loops = inventory_entry(_src("atomic_nested_loops"), load_inputs()).loop_proofs
    assert loops == (
        "each_item: metadata bound 100 "
        "(get_items: relationship Opportunity_LineItems max_children 100)",
        "each_opp: declared bound 2 (variable opps max_items 2)",
    )
