"""Operator views of a plan: ``explain`` (text) and ``to_mermaid`` (step graph).

Both are pure functions of the plan value, so the CLI, the inventory report
and golden files show exactly what activation stored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .kinds import EdgeKind
from .plan import BoundSummary, DependencyDecl, ExecutionPlan, PlanStep

__all__ = ["DependencyNotes", "explain", "to_mermaid"]

#: Extra lines explaining one dependency (its producer contract and policy bounds); the
#: runtime's producer registry supplies them (``ProducerRegistry.explainer``).
DependencyNotes = Callable[[DependencyDecl], Sequence[str]]


def _n(v: int | None) -> str:
    return "unknown" if v is None else str(v)


def _bounds(b: BoundSummary) -> str:
    locks = ", ".join(b.lock_classes) or "none"
    return (
        f"element executions ≤ {_n(b.max_steps)}, reads ≤ {_n(b.max_reads)}, "
        f"writes ≤ {_n(b.max_writes)}, fan-out ≤ {_n(b.max_fanout)}, lock classes: {locks}"
    )


def _step_lines(s: PlanStep, notes: DependencyNotes | None = None) -> list[str]:
    head = f"  [{s.kind.value}] {s.key}"
    if s.queue_class is not None:
        head += f"  (queue {s.queue_class.value})"
    if s.outcome is not None:
        head += f"  (outcome {s.outcome.value})"
    lines = [head]
    if s.nodes != (s.key,):
        lines.append(f"      nodes: {', '.join(s.nodes)}")
    for t in s.transitions:
        lines.append(f"      → {t.kind.value} [{t.label}] from {t.source} to {t.target}")
    for r in s.resources:
        parent = f" via {r.parent_relationship}" if r.parent_relationship else ""
        lines.append(
            f"      resource: {r.resource_class} {r.object}{parent} "
            f"key={r.key_source} bound={_n(r.bound)}"
        )
    if s.kind.value not in ("Terminal",):
        lines.append(f"      bounds: {_bounds(s.bounds)}")
    if s.checkpoint is not None:
        ins = ", ".join(f"{f.name}:{f.type}" for f in s.checkpoint.inputs) or "-"
        outs = ", ".join(f"{f.name}:{f.type}" for f in s.checkpoint.outputs) or "-"
        cur = f" cursor({', '.join(s.checkpoint.cursor)})" if s.checkpoint.cursor else ""
        lines.append(f"      checkpoint: in({ins}) out({outs}){cur}")
    if s.dependency is not None:
        d = s.dependency
        cond = f" condition={d.condition}" if d.condition else ""
        fs = f" → {d.fault_successor}" if d.fault_successor else ""
        lines.append(
            f"      dependency: producer={d.producer_kind} key={d.key}{cond} "
            f"deadline={d.deadline or 'owner-governed'} expiry={d.expiry_policy.value}{fs}"
        )
        if notes is not None:
            lines += [f"        {line}" for line in notes(d)]
    if s.effect is not None:
        e = s.effect
        lines.append(
            f"      effect: {e.action_type} owner={e.owner_kind}/{e.owner_id or '-'} "
            f"pair={e.submit_step} → {e.completion_step}"
        )
    for a in s.actions:
        lines.append(
            f"      action: {a.action_type} entry={a.entry_digest} "
            f"fingerprint={a.binding_fingerprint}"
        )
    if s.verifies:
        lines.append(f"      verifies snapshots of: {', '.join(s.verifies)}")
    if s.fault_code:
        lines.append(f"      fault code: {s.fault_code}")
    return lines


def explain(plan: ExecutionPlan, dependency_notes: DependencyNotes | None = None) -> str:
    """Human explanation: profile, every step with kind and resource plan, proofs, diagnostics.

    ``dependency_notes`` adds the producer contract and bounds under each dependency.
    """
    f = plan.flow
    req = plan.requested_profile.value if plan.requested_profile else "none"
    lines = [
        f"Flow {f.api_name}@{f.version} ({f.process_type})",
        f"Profile: {plan.profile.value} (requested: {req})",
        f"Plan digest: {plan.plan_digest}",
        f"Compiler: {plan.compiler_version}; policy v{plan.policy_version}; "
        f"catalog generation {plan.catalog.generation_id}",
        f"Bounds: {_bounds(plan.bounds)}",
    ]
    lines += [f"  unknown: {u}" for u in plan.bounds.unknown]
    lines.append(f"Steps (start: {plan.start_step}):")
    for s in plan.steps:
        lines += _step_lines(s, dependency_notes)
    lines.append("Loops:" if plan.loops else "Loops: none")
    for lp in plan.loops:
        proof = "bound unknown" if lp.bound is None else f"{lp.kind} bound {lp.bound}"
        lines.append(f"  {lp.loop}: {proof} ({lp.source}); body runs ≤ {_n(lp.multiplicity)} times")
    if plan.subflows:
        lines.append("Subflows:")
        lines += [f"  {s.api_name}@{s.version}: {s.plan_digest}" for s in plan.subflows]
    lines.append("Diagnostics:" if plan.diagnostics else "Diagnostics: none")
    for d in plan.diagnostics:
        lines.append(f"  {d.severity.value} {d.code} at {d.path}: {d.message}")
    return "\n".join(lines) + "\n"


def _label(text: str) -> str:
    return text.replace('"', "#quot;")


_ARROW = {
    EdgeKind.SUCCESS: "-->",
    EdgeKind.TERMINAL: "-->",
    EdgeKind.FAULT: "-.->",
    EdgeKind.WAIT: "==>",
}


def to_mermaid(plan: ExecutionPlan) -> str:
    """Mermaid ``flowchart`` of the plan's steps and transitions."""
    ids = {s.key: f"s{i}" for i, s in enumerate(plan.steps)}
    lines = ["flowchart TD"]
    for s in plan.steps:
        shape = ('(["', '"])') if s.kind.value == "Terminal" else ('["', '"]')
        lines.append(f"    {ids[s.key]}{shape[0]}{_label(s.key)}<br/>{s.kind.value}{shape[1]}")
    for s in plan.steps:
        for t in s.transitions:
            if t.target in ids:
                lines.append(
                    f"    {ids[s.key]} {_ARROW[t.kind]}"
                    f"|{_label(t.kind.value + ': ' + t.label)}| {ids[t.target]}"
                )
    lines.append(f"    start((start)) --> {ids[plan.start_step]}")
    return "\n".join(lines) + "\n"
