"""Compile-only inventory (§20.4): one row per Flow, without changing execution.

``inventory_entry`` calls :func:`~.compile.compile_plan` - the same function
activation uses - and reports the selected profile or the rejection, unknown
capabilities, loop proofs, step boundaries, legacy behaviour relied upon and
the §20.7 migration cohort.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from .compile import compile_plan
from .diagnostics import PlanCompileError
from .inputs import CompilerInputs
from .kinds import ExecutionProfile, StepKind
from .parse import FlowSourceError, load_flow_text
from .plan import ExecutionPlan

__all__ = ["COHORTS", "InventoryEntry", "cohort_of", "inventory_entry"]

#: §20.7 cohort order (1-based).
COHORTS = (
    "metadata-only compile and diagnostics",
    "pure autolaunched flows",
    "Embedded Before-Save flows",
    "small Bounded Atomic flows",
    "time waits without external effects",
    "producer-backed waits",
    "external-effect flows",
    "large and complex subflow/loop cohorts",
)

_PURE_KINDS = {StepKind.PURE_COMPUTE, StepKind.TERMINAL}


@dataclass(frozen=True)
class InventoryEntry:
    """One §20.4 inventory row."""

    api_name: str
    version: int | None
    profile: ExecutionProfile | None
    plan_digest: str | None
    rejections: tuple[str, ...]
    unknown_capabilities: tuple[str, ...]
    loop_proofs: tuple[str, ...]
    step_boundaries: tuple[str, ...]
    legacy_behavior: tuple[str, ...]
    cohort: int

    def to_dict(self) -> dict[str, Any]:
        """Canonical form (one JSON line of an inventory report)."""
        return {
            "api_name": self.api_name,
            "version": self.version,
            "profile": None if self.profile is None else self.profile.value,
            "plan_digest": self.plan_digest,
            "rejections": list(self.rejections),
            "unknown_capabilities": list(self.unknown_capabilities),
            "loop_proofs": list(self.loop_proofs),
            "step_boundaries": list(self.step_boundaries),
            "legacy_behavior": list(self.legacy_behavior),
            "cohort": self.cohort,
            "cohort_name": COHORTS[self.cohort - 1],
        }


def cohort_of(plan: ExecutionPlan) -> int:
    """The §20.7 cohort of a compiled plan: the riskiest cohort any of its traits falls in."""
    if plan.profile is ExecutionProfile.EMBEDDED_BEFORE_SAVE:
        return 3
    kinds = {s.kind for s in plan.steps}
    cohort = 4
    if plan.profile is ExecutionProfile.BOUNDED_ATOMIC and kinds <= _PURE_KINDS:
        cohort = 2
    waits = [
        s.dependency for s in plan.steps if s.kind is StepKind.DEPENDENCY_WAIT and s.dependency
    ]
    if waits:
        cohort = 6 if any(d.producer_kind != "runtime.timer" for d in waits) else 5
    if StepKind.EFFECT_SUBMIT in kinds:
        cohort = 7
    unknown_loop = any(lp.bound is None for lp in plan.loops)
    if (
        plan.subflows
        or unknown_loop
        or (plan.profile is ExecutionProfile.DURABLE_ORCHESTRATION and plan.loops)
    ):
        cohort = 8
    return cohort


def inventory_entry(flow_source: Mapping[str, Any] | str, inputs: CompilerInputs) -> InventoryEntry:
    """Compile ``flow_source`` and summarise the result as an inventory row."""
    doc: Mapping[str, Any] = {}
    with suppress(FlowSourceError):  # compile_plan reports it as source.undecodable
        doc = load_flow_text(flow_source) if isinstance(flow_source, str) else flow_source
    api = str(doc.get("api_name", "?"))
    version = doc.get("version") if isinstance(doc.get("version"), int) else None
    legacy = ("run_atomically",) if doc.get("run_atomically") is True else ()
    try:
        plan = compile_plan(flow_source, inputs)
    except PlanCompileError as exc:
        return InventoryEntry(
            api_name=api,
            version=version,
            profile=None,
            plan_digest=None,
            rejections=tuple(f"{i.path}: [{i.code}] {i.message}" for i in exc.issues),
            unknown_capabilities=tuple(
                i.message for i in exc.issues if i.code.endswith("unknown_capability")
            ),
            loop_proofs=(),
            step_boundaries=(),
            legacy_behavior=legacy,
            cohort=1,
        )
    return InventoryEntry(
        api_name=plan.flow.api_name,
        version=plan.flow.version,
        profile=plan.profile,
        plan_digest=plan.plan_digest,
        rejections=(),
        unknown_capabilities=tuple(u for u in plan.bounds.unknown if "capability" in u),
        loop_proofs=tuple(
            f"{lp.loop}: bound unknown ({lp.source})"
            if lp.bound is None
            else f"{lp.loop}: {lp.kind} bound {lp.bound} ({lp.source})"
            for lp in plan.loops
        ),
        step_boundaries=tuple(f"{s.key} [{s.kind.value}]" for s in plan.steps),
        legacy_behavior=legacy,
        cohort=cohort_of(plan),
    )
