"""Declare each durable step's execution principal (§17.2) and reject undeclared system
identities (§22.6 "system-mode step requires explicit declared identity").

A step's mode is the strongest catalog ``SecurityPolicy.principal_mode`` among its
action nodes (``system`` over ``initiating_principal``; a step without actions runs as
the initiating principal); its reauthorization policy is the most conservative declared
one (``terminal_failure`` over ``fault_path`` over ``system_handoff``; the default
``terminal_failure`` when no action declares one). A ``system`` step, or one that hands
off to system on a denial, must name its identity explicitly with the ``ActionCall``
``system_identity`` key: there is no implicit "run as the runtime". A declared identity
where none applies is rejected as well, so a typo never silently changes who acts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from .capabilities import NodeCaps
from .diagnostics import IssueSink
from .graph import FlowGraph, NodeKind
from .identity import ExecutionPrincipalMode, ReauthorizationPolicy, StepPrincipal
from .kinds import StepKind
from .language import ActionCall
from .plan import PlanStep

__all__ = ["declare_principals", "step_principal_of"]

#: Conservative first: a step whose actions disagree takes the safest declared outcome.
_POLICY_ORDER = (
    ReauthorizationPolicy.TERMINAL_FAILURE,
    ReauthorizationPolicy.FAULT_PATH,
    ReauthorizationPolicy.SYSTEM_HANDOFF,
)
_UNDECLARED = StepPrincipal(
    ExecutionPrincipalMode.INITIATING_PRINCIPAL, ReauthorizationPolicy.TERMINAL_FAILURE
)


def _mode(value: str | None) -> ExecutionPrincipalMode:
    # Free-form or absent catalog modes run as the initiating principal: never broader.
    if value == ExecutionPrincipalMode.SYSTEM.value:
        return ExecutionPrincipalMode.SYSTEM
    return ExecutionPrincipalMode.INITIATING_PRINCIPAL


def _policy(value: str | None) -> ReauthorizationPolicy | None:
    try:
        return ReauthorizationPolicy(value) if value is not None else None
    except ValueError:
        return None


def step_principal_of(
    graph: FlowGraph, caps: Mapping[str, NodeCaps], step: PlanStep, sink: IssueSink
) -> StepPrincipal:
    """The declared principal of durable ``step`` (errors go to ``sink``)."""
    modes: set[ExecutionPrincipalMode] = set()
    policies: set[ReauthorizationPolicy] = set()
    identities: dict[str, str] = {}
    for nid in step.nodes:
        node, c = graph.nodes[nid], caps[nid]
        if node.kind is not NodeKind.ELEMENT or not isinstance(node.element, ActionCall):
            continue
        sec = c.entry.capabilities.security if c.entry is not None else None
        modes.add(_mode(sec.principal_mode if sec else None))
        policy = _policy(sec.reauthorization if sec else None)
        if policy is not None:
            policies.add(policy)
        if node.element.system_identity is not None:
            identities[nid] = node.element.system_identity
    if not modes:
        return _UNDECLARED
    mode = max(modes, key=lambda m: m is ExecutionPrincipalMode.SYSTEM)
    on_denied = next((p for p in _POLICY_ORDER if p in policies), _UNDECLARED.on_denied)
    needs_identity = (
        mode is ExecutionPrincipalMode.SYSTEM or on_denied is ReauthorizationPolicy.SYSTEM_HANDOFF
    )
    declared = sorted(set(identities.values()))
    head = graph.nodes[step.entry]
    if needs_identity and not declared:
        why = (
            "runs in system mode"
            if mode is ExecutionPrincipalMode.SYSTEM
            else ("hands off to system when reauthorization fails")
        )
        sink.error(
            f"{head.issue_path()}.system_identity",
            "principal.system_identity_required",
            f"step {step.key} {why} but declares no explicit system identity; add "
            "'system_identity' to its ActionCall (§17.1)",
            head.chain(),
        )
    elif len(declared) > 1:
        sink.error(
            f"{head.issue_path()}.system_identity",
            "principal.system_identity_ambiguous",
            f"step {step.key} declares {len(declared)} different system identities; "
            "one step acts as one identity",
            head.chain(),
        )
    elif declared and not needs_identity:
        nid = sorted(identities)[0]
        sink.error(
            f"{graph.nodes[nid].issue_path()}.system_identity",
            "principal.system_identity_not_applicable",
            f"step {step.key} runs as the initiating principal and never hands off to "
            "system; remove 'system_identity' (§17.1)",
            graph.nodes[nid].chain(),
        )
    return StepPrincipal(mode, on_denied, declared[0] if len(declared) == 1 else None)


def declare_principals(
    graph: FlowGraph, caps: Mapping[str, NodeCaps], steps: tuple[PlanStep, ...], sink: IssueSink
) -> tuple[PlanStep, ...]:
    """``steps`` of a Durable Orchestration plan with their declared principal; terminal
    steps (they only end the run) carry none."""
    out: list[PlanStep] = []
    for s in steps:
        if s.kind in (StepKind.TERMINAL, StepKind.EXPLICIT_FAULT):
            out.append(s)
            continue
        # An effect's completion step shares its submit's action node: one report.
        report = sink if s.kind is not StepKind.EFFECT_COMPLETION else IssueSink()
        out.append(replace(s, principal=step_principal_of(graph, caps, s, report)))
    return tuple(out)
