"""Compile-only inventory rows (§20.4) with the compiler's migration cohorts (§20.7).

:func:`inventory_row` turns one compile outcome — the plan, or the
:class:`~runtime_svc.compiler.PlanCompileError` — into the report §20.4 asks for:
selected profile, rejection reasons, unknown action/subflow capabilities, loop and
fan-out proof, estimated step boundaries, legacy behaviour relied upon and the
migration cohort. It is a pure function of the compile and its inputs; producing the
report changes no execution state.

Pure: no I/O, no generated protos.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from runtime_svc.compiler import (
    CompileIssue,
    CompilerInputs,
    Diagnostic,
    ExecutionPlan,
    ExecutionProfile,
    PlanCompileError,
    StepKind,
)
from runtime_svc.compiler.inventory import cohort_of
from runtime_svc.definitions.source import SubflowRef, subflow_refs

__all__ = [
    "Cohort",
    "DiagnosticValue",
    "InventoryRow",
    "diagnostics_of",
    "inventory_row",
    "unknown_capabilities",
]


class Cohort(StrEnum):
    """Migration cohorts in the recommended order of §20.7."""

    METADATA_ONLY = "metadata_only"
    PURE_AUTOLAUNCHED = "pure_autolaunched"
    EMBEDDED_BEFORE_SAVE = "embedded_before_save"
    SMALL_BOUNDED_ATOMIC = "small_bounded_atomic"
    TIME_WAITS = "time_waits"
    PRODUCER_WAITS = "producer_waits"
    EXTERNAL_EFFECTS = "external_effects"
    LARGE_COMPLEX = "large_complex"


@dataclass(frozen=True, order=True)
class DiagnosticValue:
    """One compiler diagnostic, blocking (``error``) or not (``warning``/``info``)."""

    severity: str
    path: str
    code: str
    message: str
    blocker_chain: tuple[str, ...] = ()

    @classmethod
    def of_issue(cls, issue: CompileIssue) -> DiagnosticValue:
        return cls("error", issue.path, issue.code, issue.message, issue.blocker_chain)

    @classmethod
    def of_diagnostic(cls, d: Diagnostic) -> DiagnosticValue:
        return cls(d.severity.value, d.path, d.code, d.message, d.blocker_chain)

    def to_dict(self) -> dict[str, Any]:
        return {
            "severity": self.severity,
            "path": self.path,
            "code": self.code,
            "message": self.message,
            "blocker_chain": list(self.blocker_chain),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DiagnosticValue:
        return cls(
            str(d["severity"]),
            str(d["path"]),
            str(d["code"]),
            str(d["message"]),
            tuple(str(c) for c in d.get("blocker_chain", ())),
        )


_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def diagnostics_of(
    outcome: ExecutionPlan | PlanCompileError,
) -> tuple[DiagnosticValue, ...]:
    """Every diagnostic of a compile, errors first, then by path (the proto's order)."""
    if isinstance(outcome, PlanCompileError):
        values = [DiagnosticValue.of_issue(i) for i in outcome.issues]
    else:
        values = [DiagnosticValue.of_diagnostic(d) for d in outcome.diagnostics]
    return tuple(sorted(values, key=lambda v: (_SEVERITY_ORDER.get(v.severity, 9), v)))


@dataclass(frozen=True)
class InventoryRow:
    """The §20.4 report of one Flow version."""

    flow_api_name: str
    flow_version_id: str
    compilable: bool
    profile: ExecutionProfile | None
    diagnostics: tuple[DiagnosticValue, ...]
    unknown_capabilities: tuple[str, ...]
    fanout_proven: bool
    estimated_step_count: int
    legacy_behaviors: tuple[str, ...]
    cohort: Cohort


def _walk(source: Mapping[str, Any], inputs: CompilerInputs) -> tuple[set[str], set[SubflowRef]]:
    """Action types and subflow references reachable from ``source`` (bounded walk)."""
    actions: set[str] = set()
    seen: set[SubflowRef] = set()
    stack = [source]
    while stack and len(seen) <= len(inputs.subflows) + 1:
        doc = stack.pop()
        for el in doc.get("elements") or ():
            if (
                isinstance(el, Mapping)
                and el.get("type") == "ActionCall"
                and isinstance(el.get("action_type"), str)
            ):
                actions.add(el["action_type"])
        for ref in subflow_refs(doc):
            if ref in seen:
                continue
            seen.add(ref)
            child = inputs.subflow(ref.api_name, ref.version)
            if child is not None:
                stack.append(child.source)
    return actions, seen


def unknown_capabilities(source: Mapping[str, Any], inputs: CompilerInputs) -> tuple[str, ...]:
    """Action and subflow references whose capabilities are unknown (transitively).

    An action is unknown when the sealed generation has no entry for it, only a
    contract-only entry, or an entry that leaves capability fields undeclared; a subflow
    when its Flow version is not among the inputs.
    """
    actions, subflows = _walk(source, inputs)
    out: list[str] = []
    generation = inputs.catalog.generation_id
    for action in sorted(actions):
        entries = inputs.entries_for(action)
        if not entries:
            out.append(f"action {action}: not in catalog generation {generation}")
            continue
        for e in entries:
            if e.contract_only:
                out.append(f"action {action}: contract-only entry without a handler")
            missing = e.capabilities.unknown_fields()
            if missing:
                out.append(f"action {action}: unknown {', '.join(missing)}")
    for ref in sorted(subflows):
        if inputs.subflow(ref.api_name, ref.version) is None:
            out.append(f"subflow {ref.api_name}@{ref.version}: not registered")
    return tuple(out)


def _cohort(plan: ExecutionPlan) -> Cohort:
    # The compiler owns the classification (runtime_svc.compiler.inventory.cohort_of,
    # 1-based in §20.7 order); Cohort lists the same cohorts in the same order.
    return list(Cohort)[cohort_of(plan) - 1]


def _legacy(source: Mapping[str, Any], diagnostics: tuple[DiagnosticValue, ...]) -> list[str]:
    out = []
    if source.get("run_atomically") is True:
        out.append("legacy.run_atomically")
    if any(d.code == "profile.atomic_mapped_to_durable" for d in diagnostics):
        out.append("legacy.atomic_mapped_to_durable")
    trigger = source.get("trigger")
    if isinstance(trigger, Mapping) and trigger.get("timing") == "before_save":
        out.append("legacy.before_save_transient_interview")
    return out


def _legacy_of_plan(plan: ExecutionPlan) -> list[str]:
    """Legacy-interpreter behaviour a V2 plan of this Flow no longer offers the same way
    (§20.4 "legacy behavior relied upon"; the shadow comparison checks each of them)."""
    kinds = [s.kind for s in plan.steps]
    out = []
    if StepKind.EFFECT_SUBMIT in kinds:
        # Legacy: the external call ran inline, inside the interview's transaction.
        out.append("legacy.inline_external_call")
    if StepKind.DEPENDENCY_WAIT in kinds:
        out.append("legacy.paused_interview_wait")
    if plan.subflows:
        out.append("legacy.subflow_call_frame")
    mutations = sum(1 for k in kinds if k is StepKind.BOUNDED_MUTATION)
    if plan.profile is ExecutionProfile.DURABLE_ORCHESTRATION and (
        mutations > 1 or (mutations and plan.loops)
    ):
        # Legacy: one all-or-nothing segment; V2: every mutation step (and every loop
        # iteration of one) commits on its own.
        out.append("legacy.all_or_nothing_segment")
    return out


def inventory_row(
    flow_api_name: str,
    flow_version_id: str,
    source: Mapping[str, Any],
    inputs: CompilerInputs,
    outcome: ExecutionPlan | PlanCompileError,
) -> InventoryRow:
    """The §20.4 row of one compile outcome."""
    diagnostics = diagnostics_of(outcome)
    unknown = unknown_capabilities(source, inputs)
    legacy = tuple(_legacy(source, diagnostics))
    if isinstance(outcome, PlanCompileError):
        elements = source.get("elements")
        return InventoryRow(
            flow_api_name=flow_api_name,
            flow_version_id=flow_version_id,
            compilable=False,
            profile=None,
            diagnostics=diagnostics,
            unknown_capabilities=unknown,
            fanout_proven=False,
            estimated_step_count=len(elements) if isinstance(elements, list) else 0,
            legacy_behaviors=legacy,
            cohort=Cohort.METADATA_ONLY,
        )
    plan = outcome
    legacy = (*legacy, *_legacy_of_plan(plan))
    proven = plan.bounds.max_fanout is not None and all(lp.bound is not None for lp in plan.loops)
    return InventoryRow(
        flow_api_name=flow_api_name,
        flow_version_id=flow_version_id,
        compilable=True,
        profile=plan.profile,
        diagnostics=diagnostics,
        unknown_capabilities=tuple(sorted({*unknown, *plan.bounds.unknown})),
        fanout_proven=proven,
        estimated_step_count=len(plan.steps),
        legacy_behaviors=legacy,
        cohort=_cohort(plan),
    )
