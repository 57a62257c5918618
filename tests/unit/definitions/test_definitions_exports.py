"""The public surface of ``runtime_svc.definitions`` is pinned (STYLE 13)."""

from __future__ import annotations

import runtime_svc.definitions as definitions


def test_public_exports_are_pinned() -> None:
    assert definitions.__all__ == [
        "DEFAULT_POLICY_DOCUMENT",
        "DEFAULT_WAIT_PRODUCERS",
        "ActivationBlockedError",
        "ActivationOutcome",
        "Activations",
        "ActivePlanBinding",
        "AdmissionError",
        "AdmissionErrorCode",
        "AdmittedPlan",
        "CatalogSnapshot",
        "Cohort",
        "CompileOutcome",
        "DefinitionService",
        "DiagnosticValue",
        "FlowSourceInfo",
        "FlowSourceInvalidError",
        "FlowVersionConflictError",
        "InventoryRow",
        "PlanCompiler",
        "PlanView",
        "PolicyGeneration",
        "PolicyStore",
        "RequestBoundView",
        "TriggerSelection",
        "build_compiler_inputs",
        "inventory_row",
        "normalize_policy_document",
        "parse_source_json",
        "select_for_trigger",
        "select_plan_for_trigger",
    ]
    for name in definitions.__all__:
        assert getattr(definitions, name) is not None
