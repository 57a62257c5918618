"""``compile_plan``: the one pure compiler entry point (§7.2).

Activation, control-plane verification, the inventory report and the CLI all
call this function; none keeps its own eligibility logic. The compiler reads
only its arguments: no tenant records, no runtime traffic, no clock.

Phases report into one :class:`~.diagnostics.IssueSink` and stop at a gate
only where later phases would be meaningless (an unresolved reference cannot
be placed in a graph); the error raised at a gate carries every issue found so
far.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from services.invariants import InvariantError

from .bounds import loop_proofs, multiplicities, to_proofs
from .capabilities import annotate, summarize
from .catalog_inputs import CapabilityEntryView
from .dataflow import access, snapshot_origins, variable_types
from .diagnostics import CompileIssue, IssueSink, PlanCompileError
from .graph import FlowGraph, NodeKind, build_graph
from .inputs import CompilerInputs
from .kinds import ExecutionProfile
from .language import FlowDef, Subflow, TriggerTiming
from .parse import FlowSourceError, load_flow_text, parse_flow
from .plan import (
    COMPILER_VERSION,
    ExecutionPlan,
    FlowIdentity,
    PlanEdge,
    PlanNode,
    PlanVariable,
    SubflowPin,
    trigger_binding_digest,
)
from .principals import declare_principals
from .profiles import select_profile
from .resolve import (
    check_inputs,
    check_subflow_interface,
    resolve_flow,
    select_trigger_subscriptions,
)
from .steps import StepContext, action_pin, build_steps
from .validate import validate_durable, validate_effect_pairs

__all__ = ["compile_plan"]

_Key = tuple[str, int]


@dataclass(frozen=True)
class _Compiled:
    flow: FlowDef
    plan: ExecutionPlan
    children: Mapping[_Key, FlowDef]
    pins: Mapping[_Key, Mapping[str, CapabilityEntryView]]


@dataclass
class _Children:
    """Compiled Subflow targets of one Flow, transitively."""

    flows: dict[_Key, FlowDef] = field(default_factory=dict)
    pins: dict[_Key, Mapping[str, CapabilityEntryView]] = field(default_factory=dict)
    plans: dict[_Key, SubflowPin] = field(default_factory=dict)


def _plan_nodes(graph: FlowGraph) -> tuple[PlanNode, ...]:
    out = []
    for nid, node in graph.nodes.items():
        scope = tuple(f"{f.element}:{f.flow}@{f.version}" for f in node.scope)
        if node.kind is NodeKind.ELEMENT and node.element is not None:
            out.append(PlanNode(nid, node.element.type.value, scope, node.element.to_dict()))
        elif node.kind is NodeKind.RETURN and isinstance(node.element, Subflow):
            out.append(
                PlanNode(
                    nid, node.kind.value, scope, {"outputs": dict(sorted(node.element.outputs))}
                )
            )
        else:
            out.append(PlanNode(nid, node.kind.value, scope, None))
    return tuple(out)


def _plan_variables(flow: FlowDef, types: Mapping[str, str]) -> tuple[PlanVariable, ...]:
    top = {v.name: v for v in flow.variables}
    return tuple(
        PlanVariable(name, t, name in top and top[name].input, name in top and top[name].output)
        for name, t in sorted(types.items())
    )


class _Compiler:
    def __init__(self, inputs: CompilerInputs, compiler_version: str) -> None:
        self.inputs = inputs
        self.compiler_version = compiler_version
        self.memo: dict[_Key, _Compiled] = {}

    def subflows(self, flow: FlowDef, stack: tuple[_Key, ...], sink: IssueSink) -> _Children:
        """Compile every Subflow target first (step 4: recursion is detected here)."""
        out = _Children()
        here = (*stack, (flow.api_name, flow.version))
        for el in flow.elements:
            if not isinstance(el, Subflow):
                continue
            key = (el.flow, el.version)
            path = f"elements[{el.api_name}]"
            if key in here:
                cycle = " → ".join(f"{a}@{v}" for a, v in (*here[here.index(key) :], key))
                sink.error(
                    path,
                    "subflow.recursive",
                    f"recursive subflow reference: {cycle}",
                    (f"Subflow {el.api_name}",),
                )
                continue
            src = self.inputs.subflow(*key)
            if src is None:
                sink.error(
                    f"{path}.flow",
                    "subflow.missing",
                    f"Flow {el.flow}@{el.version} is not among the compile inputs",
                )
                continue
            try:
                child = self.compile(src.source, here)
            except PlanCompileError as exc:
                for i in exc.issues:
                    sink.error(
                        path,
                        i.code,
                        f"Subflow {el.flow}@{el.version}: {i.path}: {i.message}",
                        (f"Subflow {el.api_name}", *i.blocker_chain),
                    )
                continue
            if (child.flow.api_name, child.flow.version) != key:
                sink.error(
                    f"{path}.flow",
                    "subflow.identity_mismatch",
                    f"the source given for {el.flow}@{el.version} is another Flow",
                )
                continue
            check_subflow_interface(flow, el, child.flow, sink)
            out.flows[key] = child.flow
            out.flows.update(child.children)
            out.pins.update(child.pins)
            out.plans[key] = SubflowPin(el.flow, el.version, child.plan.plan_digest)
            for sp in child.plan.subflows:
                out.plans[(sp.api_name, sp.version)] = sp
        return out

    def compile(self, source: Mapping[str, Any] | str, stack: tuple[_Key, ...] = ()) -> _Compiled:
        sink = IssueSink()
        if isinstance(source, str):
            try:
                source = load_flow_text(source)
            except FlowSourceError as exc:
                raise PlanCompileError(
                    [CompileIssue("flow", "source.undecodable", str(exc))]
                ) from None
        # Step 1: parse and normalize.
        flow = parse_flow(source, sink)
        if flow is None:
            sink.raise_if_errors()
            raise PlanCompileError(
                [CompileIssue("flow", "source.invalid", "the Flow document is unusable")]
            )
        key = (flow.api_name, flow.version)
        if key in self.memo and stack:
            return self.memo[key]
        # Step 2: resolve elements, actions, triggers; compile subflows (step 4: recursion).
        if not stack:
            check_inputs(self.inputs, sink)
        own_pins = resolve_flow(flow, self.inputs, sink)
        subs = select_trigger_subscriptions(flow, self.inputs.metadata_view, sink)
        kids = self.subflows(flow, stack, sink)
        children = kids.flows
        pins = {**kids.pins, key: own_pins}
        sink.raise_if_errors()
        # Step 3: control-flow graph with subflows inlined; cycles rejected.
        graph = build_graph(flow, children, sink)
        sink.raise_if_errors()
        if graph is None:
            raise InvariantError("no control-flow graph and no compile error")
        # Steps 5-7: capabilities, transitive propagation, loop and fan-out bounds.
        view = self.inputs.metadata_view
        loops = loop_proofs(graph, view, children)
        mult = multiplicities(graph, loops)
        caps = annotate(graph, view, pins, children)
        unknown_loops = [
            f"{' → '.join(graph.nodes[lid].chain())}: loop bound unknown ({b.source})"
            for lid, b in loops.items()
            if b.value is None
        ]
        summary = summarize(graph, caps, graph.nodes, mult, unknown_loops)
        # Steps 10-11: profile selection; unsafe explicit requests rejected.
        profile = select_profile(flow, graph, caps, loops, summary, self.inputs.policy, sink)
        sink.raise_if_errors()
        if profile is None:
            raise InvariantError("no profile and no compile error")
        # Steps 8-9, 12: steps, boundaries, keys, resources, checkpoints, dependencies.
        acc = access(graph)
        ctx = StepContext(
            flow,
            graph,
            caps,
            acc,
            variable_types(graph, flow),
            snapshot_origins(graph, acc),
            mult,
            summary,
        )
        steps, start = build_steps(ctx, profile)
        if profile is ExecutionProfile.DURABLE_ORCHESTRATION:
            steps = declare_principals(graph, caps, steps, sink)
            validate_durable(graph, caps, steps, self.inputs.policy, sink)
        sink.extend(validate_effect_pairs(steps))
        sink.raise_if_errors()
        # Step 13: plan identity.
        reachable_subflows = {
            (n.element.flow, n.element.version)
            for n in graph.nodes.values()
            if n.kind is NodeKind.ELEMENT and isinstance(n.element, Subflow)
        }
        used_pins = {sp for k, sp in kids.plans.items() if k in reachable_subflows}
        requested = ExecutionProfile.BOUNDED_ATOMIC if flow.run_atomically else None
        if flow.trigger is not None and flow.trigger.timing is TriggerTiming.BEFORE_SAVE:
            requested = None
        plan = ExecutionPlan(
            compiler_version=self.compiler_version,
            flow=FlowIdentity(
                flow.api_name, flow.version, flow.process_type.value, flow.metadata_digest()
            ),
            binding=self.inputs.binding,
            catalog=self.inputs.catalog,
            trigger_binding_digest=trigger_binding_digest(flow.api_name, flow.version, subs),
            trigger_subscriptions=subs,
            policy_version=self.inputs.policy.version,
            policy_digest=self.inputs.policy.policy_digest(),
            profile=profile,
            requested_profile=requested,
            trigger=None if flow.trigger is None else flow.trigger.to_dict(),
            variables=_plan_variables(flow, ctx.types),
            start_step=start,
            steps=steps,
            nodes=_plan_nodes(graph),
            edges=tuple(PlanEdge(e.src, e.dst, e.kind, e.label) for e in graph.edges),
            loops=to_proofs(graph, loops),
            actions=tuple(sorted({p for c in caps.values() if (p := action_pin(c)) is not None})),
            subflows=tuple(sorted(used_pins)),
            bounds=summary,
            diagnostics=sink.diagnostics(),
        )
        payload_digest, plan_digest = plan.computed_digests()
        plan = replace(plan, payload_digest=payload_digest, plan_digest=plan_digest)
        compiled = _Compiled(flow, plan, children, pins)
        self.memo[key] = compiled
        return compiled


def compile_plan(
    flow_source: Mapping[str, Any] | str,
    inputs: CompilerInputs,
    *,
    compiler_version: str = COMPILER_VERSION,
) -> ExecutionPlan:
    """Compile one Flow version into an immutable :class:`~.plan.ExecutionPlan`.

    Args:
        flow_source: The Flow document as a mapping, or its JSON/YAML text.
        inputs: The bound catalog generation, metadata view, runtime policy and
            the sources of every Flow version a Subflow element may call.
        compiler_version: Compiler behaviour generation recorded in (and
            digested into) the plan; override only to test plan identity.

    Returns:
        The plan; equal inputs always give an equal plan and digest.

    Raises:
        PlanCompileError: with every blocking issue found.
    """
    return _Compiler(inputs, compiler_version).compile(flow_source).plan
