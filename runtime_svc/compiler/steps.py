"""Steps 8-9 and 12 of §7.2: group nodes into steps and declare their contracts.

Embedded Before-Save and Bounded Atomic plans have one transaction step
(``$embedded`` / ``$atomic``) plus the ``$end`` / ``$failed`` terminals.
Durable Orchestration plans have one step per node, except that a pure node
with a single pure predecessor joins that predecessor's step, and an
external-effect action expands into ``<node>#submit`` → ``<node>#completion``.

Step keys are node ids (element api names with subflow prefixes), so they do
not change when the source is reformatted or its elements are reordered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.digest import versioned_digest
from services.invariants import InvariantError

from .bounds import mul
from .capabilities import NodeCaps, summarize
from .catalog_inputs import ExecutionClass, ReadContract
from .dataflow import Access
from .expressions import unparse
from .graph import END, FAILED, FlowGraph, Node, NodeKind
from .kinds import (
    EFFECT_COMPLETION_PRODUCER,
    RECORD_CHANGE_PRODUCER,
    TIMER_PRODUCER,
    EdgeKind,
    ExecutionProfile,
    ExpiryPolicy,
    QueueClass,
    StepKind,
    TerminalOutcome,
)
from .language import End, EventWait, Fault, FlowDef, Loop, RecordWait, TimeWait, Wait
from .plan import (
    ActionPin,
    BoundSummary,
    CheckpointField,
    CheckpointSchema,
    DependencyDecl,
    EffectDecl,
    PlanStep,
    ResourceDecl,
    Transition,
)

__all__ = ["StepContext", "action_pin", "build_steps"]

ATOMIC_STEP = "$atomic"
EMBEDDED_STEP = "$embedded"


@dataclass(frozen=True)
class StepContext:
    """Everything step construction reads (all computed by earlier phases)."""

    flow: FlowDef
    graph: FlowGraph
    caps: Mapping[str, NodeCaps]
    access: Mapping[str, Access]
    types: Mapping[str, str]
    origins: Mapping[str, frozenset[str]]
    mult: Mapping[str, int | None]
    summary: BoundSummary


def action_pin(c: NodeCaps) -> ActionPin | None:
    """The catalog pin of an action node, or ``None``."""
    e = c.entry
    if e is None:
        return None
    return ActionPin(e.action_type, e.entry_digest, e.binding_fingerprint, e.capabilities.digest())


def _fields(names: set[str], types: Mapping[str, str]) -> tuple[CheckpointField, ...]:
    return tuple(CheckpointField(n, types.get(n, "unknown")) for n in sorted(names))


def _merge_resources(items: list[ResourceDecl]) -> tuple[ResourceDecl, ...]:
    merged: dict[tuple[str, str, str | None, str], int | None] = {}
    for r in items:
        k = (r.resource_class, r.object, r.parent_relationship, r.key_source)
        if k in merged:
            a, b = merged[k], r.bound
            merged[k] = None if a is None or b is None else a + b
        else:
            merged[k] = r.bound
    return tuple(sorted(ResourceDecl(k[0], k[1], k[2], k[3], v) for k, v in merged.items()))


def _pins(ctx: StepContext, nodes: list[str]) -> tuple[ActionPin, ...]:
    return tuple(sorted({p for n in nodes if (p := action_pin(ctx.caps[n])) is not None}))


def _terminals() -> list[PlanStep]:
    """``$end`` and ``$failed`` of a one-transaction plan (commit or roll back)."""
    empty = BoundSummary(0, 0, 0, 0, ())
    return [
        PlanStep(key, StepKind.TERMINAL, key, (key,), (), None, empty, outcome=outcome)
        for key, outcome in ((END, TerminalOutcome.SUCCEEDED), (FAILED, TerminalOutcome.FAILED))
    ]


def _single_step(ctx: StepContext, profile: ExecutionProfile) -> tuple[tuple[PlanStep, ...], str]:
    g = ctx.graph
    nodes = [n for n, node in g.nodes.items() if node.kind in (NodeKind.ELEMENT, NodeKind.RETURN)]
    embedded = profile is ExecutionProfile.EMBEDDED_BEFORE_SAVE
    key = EMBEDDED_STEP if embedded else ATOMIC_STEP
    if embedded:
        kind = StepKind.EMBEDDED_TRANSFORM
    elif any(ctx.caps[n].mutates for n in nodes):
        kind = StepKind.BOUNDED_MUTATION
    elif any(ctx.caps[n].reads for n in nodes):
        kind = StepKind.CURRENT_READ
    else:
        kind = StepKind.PURE_COMPUTE
    resources = _merge_resources(
        [
            ResourceDecl(
                r.resource_class,
                r.object,
                r.parent_relationship,
                r.key_source,
                mul(ctx.mult[n], r.bound),
            )
            for n in nodes
            for r in ctx.caps[n].resources
        ]
    )
    checkpoint = None
    if not embedded:
        ins = {v.name for v in ctx.flow.variables if v.input}
        if ctx.flow.trigger is not None:
            ins.add("$Record")
        outs = {v.name for v in ctx.flow.variables if v.output}
        checkpoint = CheckpointSchema(_fields(ins, ctx.types), _fields(outs, ctx.types))
    transitions = (
        Transition(EdgeKind.FAULT, "rollback", key, FAILED),
        Transition(EdgeKind.TERMINAL, "commit", key, END),
    )
    step = PlanStep(
        key=key,
        kind=kind,
        entry=g.start,
        nodes=tuple(sorted(nodes)),
        transitions=transitions,
        queue_class=QueueClass.EMBEDDED_FOREGROUND
        if embedded
        else QueueClass.BOUNDED_ATOMIC_FOREGROUND,
        bounds=ctx.summary,
        resources=resources,
        checkpoint=checkpoint,
        actions=_pins(ctx, nodes),
    )
    return (step, *_terminals()), key


def _is_pure(node: Node, c: NodeCaps) -> bool:
    if node.kind is NodeKind.RETURN:
        return True
    if node.kind is not NodeKind.ELEMENT or isinstance(node.element, Loop | End | Fault):
        return False
    return c.execution_class is ExecutionClass.PURE_COMPUTE and not c.external


def _heads(ctx: StepContext) -> dict[str, str]:
    """Map each node to the node that heads its durable step."""
    g = ctx.graph
    mergeable: dict[str, str] = {}
    for nid, node in g.nodes.items():
        ins = g.in_edges(nid)
        if nid == g.start or len(ins) != 1 or not _is_pure(node, ctx.caps[nid]):
            continue
        e = ins[0]
        p = g.nodes[e.src]
        if (
            e.kind is EdgeKind.SUCCESS
            and _is_pure(p, ctx.caps[e.src])
            and len(g.out_edges(e.src)) == 1
        ):
            mergeable[nid] = e.src
    heads: dict[str, str] = {}
    for nid in g.nodes:
        h = nid
        while h in mergeable:  # acyclic: cycles outside loops were rejected, loop heads never merge
            h = mergeable[h]
        heads[nid] = h
    return heads


def _kind(node: Node, c: NodeCaps) -> StepKind:
    if node.kind in (NodeKind.END, NodeKind.FAILED) or (
        node.kind is NodeKind.ELEMENT and isinstance(node.element, End)
    ):
        return StepKind.TERMINAL
    if node.kind is NodeKind.ELEMENT and isinstance(node.element, Fault):
        return StepKind.EXPLICIT_FAULT
    if c.execution_class is ExecutionClass.WAIT:
        return StepKind.DEPENDENCY_WAIT
    if c.mutates:
        return StepKind.BOUNDED_MUTATION
    if c.execution_class is ExecutionClass.RECORD_READ:
        if c.read_contract is ReadContract.VERIFIED_SNAPSHOT:
            return StepKind.VERIFIED_SNAPSHOT_READ
        return StepKind.CURRENT_READ
    return StepKind.PURE_COMPUTE


_QUEUE = {
    StepKind.DEPENDENCY_WAIT: QueueClass.DEPENDENCY_WAKEUP,
    StepKind.EFFECT_COMPLETION: QueueClass.EFFECT_COMPLETION,
    StepKind.TERMINAL: None,
}


def _condition_digest(
    producer: str, key: str, condition: str | None, obj: str | None = None
) -> str:
    rule: dict[str, str | None] = {"producer_kind": producer, "key": key, "condition": condition}
    if obj is not None:
        rule["object"] = obj
    return versioned_digest("dependency-condition", rule)


def _wait_dependency(node: Node, fault_step: str | None) -> DependencyDecl:
    el = node.element
    if not isinstance(el, Wait):
        raise InvariantError("a wait dependency of a non-Wait element")
    w = el.wait
    obj: str | None = None
    if isinstance(w, TimeWait):
        producer, cond = TIMER_PRODUCER, None
        if w.duration is not None:
            key = f"duration:{w.duration}"
        else:
            if w.until is None:
                raise InvariantError("a time wait with neither duration nor until")
            key = f"until:{unparse(w.until)}"
    elif isinstance(w, RecordWait):
        producer, key, cond, obj = (
            RECORD_CHANGE_PRODUCER,
            unparse(w.record_id),
            unparse(w.condition),
            w.object,
        )
    else:
        if not isinstance(w, EventWait):
            raise InvariantError("a wait that is neither a time nor an event wait")
        producer, key = w.producer_kind, unparse(w.key)
        cond = None if w.condition is None else unparse(w.condition)
    return DependencyDecl(
        producer_kind=producer,
        key=key,
        condition=cond,
        condition_digest=_condition_digest(producer, key, cond, obj),
        deadline=el.deadline,
        deadline_seconds=el.deadline_seconds,
        expiry_policy=el.expiry_policy,
        fault_successor=fault_step if el.expiry_policy is ExpiryPolicy.FAULT_PATH else None,
        object=obj,
    )


def _durable(ctx: StepContext) -> tuple[tuple[PlanStep, ...], str]:
    g = ctx.graph
    heads = _heads(ctx)
    effects = {
        n for n, node in g.nodes.items() if node.kind is NodeKind.ELEMENT and ctx.caps[n].external
    }

    def entry_key(nid: str) -> str:
        return f"{nid}#submit" if nid in effects else heads[nid]

    members: dict[str, list[str]] = {}
    for nid in g.nodes:
        members.setdefault(heads[nid], []).append(nid)
    steps: list[PlanStep] = []
    for head, nodes in sorted(members.items()):
        node, c = g.nodes[head], ctx.caps[head]
        nodes = sorted(nodes)
        transitions = tuple(
            sorted(
                Transition(e.kind, e.label, e.src, entry_key(e.dst))
                for n in nodes
                for e in g.out_edges(n)
                if heads[e.dst] != head or e.dst == head
            )
        )
        bounds = summarize(g, ctx.caps, nodes, {n: 1 for n in nodes})
        resources = _merge_resources([r for n in nodes for r in ctx.caps[n].resources])
        reads = set().union(*(ctx.access[n].reads for n in nodes))
        writes = set().union(*(ctx.access[n].writes for n in nodes))
        cursor = (
            (f"{head}.index",)
            if isinstance(node.element, Loop) and node.kind is NodeKind.ELEMENT
            else ()
        )
        kind = _kind(node, c)
        checkpoint = None
        if kind is not StepKind.TERMINAL:
            checkpoint = CheckpointSchema(
                _fields(reads, ctx.types), _fields(writes, ctx.types), cursor
            )
        verifies: tuple[str, ...] = ()
        if kind is StepKind.BOUNDED_MUTATION:
            srcs = {o for r in reads for o in ctx.origins.get(r, frozenset())}
            verifies = tuple(sorted({heads[o] for o in srcs} - {head}))
        if head in effects:
            steps.extend(_effect_pair(ctx, head, transitions, bounds, resources, checkpoint))
            continue
        fault_step = next((t.target for t in transitions if t.kind is EdgeKind.FAULT), None)
        outcome = None
        if kind is StepKind.TERMINAL:
            outcome = (
                TerminalOutcome.FAILED
                if node.kind is NodeKind.FAILED
                else TerminalOutcome.SUCCEEDED
            )
        dep = None
        if kind is StepKind.DEPENDENCY_WAIT:
            if isinstance(node.element, Wait):
                dep = _wait_dependency(node, fault_step)
            else:
                # A wait-class action: its owner resolves the dependency; without a
                # declared deadline an unresolved one can only be quarantined.
                if c.entry is None:
                    raise InvariantError("a wait-class action without its catalog entry")
                producer, key = f"action:{c.entry.action_type}", f"action:{head}"
                dep = DependencyDecl(
                    producer_kind=producer,
                    key=key,
                    condition=None,
                    condition_digest=_condition_digest(producer, key, None),
                    deadline=None,
                    deadline_seconds=None,
                    expiry_policy=ExpiryPolicy.QUARANTINE,
                    fault_successor=None,
                )
        steps.append(
            PlanStep(
                key=head,
                kind=kind,
                entry=head,
                nodes=tuple(nodes),
                transitions=transitions,
                queue_class=_QUEUE.get(kind, QueueClass.DURABLE_MUTATION),
                bounds=bounds,
                resources=resources,
                checkpoint=checkpoint,
                dependency=dep,
                actions=_pins(ctx, nodes),
                verifies=verifies,
                outcome=outcome,
                fault_code=node.element.code if isinstance(node.element, Fault) else None,
            )
        )
    return tuple(sorted(steps, key=lambda s: s.key)), entry_key(g.start)


def _effect_pair(
    ctx: StepContext,
    nid: str,
    transitions: tuple[Transition, ...],
    bounds: BoundSummary,
    resources: tuple[ResourceDecl, ...],
    checkpoint: CheckpointSchema | None,
) -> list[PlanStep]:
    c = ctx.caps[nid]
    if c.entry is None:
        raise InvariantError("an effect action without its catalog entry")
    submit, completion = f"{nid}#submit", f"{nid}#completion"
    owner = c.effect_owner
    effect = EffectDecl(
        action_type=c.entry.action_type,
        owner_kind=owner.kind.value,
        owner_id=owner.owner_id,
        submit_step=submit,
        completion_step=completion,
        handoff_key=f"{{run_id}}/{submit}/{{invocation_ordinal}}",
        idempotency_key_shape=c.entry.capabilities.idempotency.key_shape,
        idempotency_scope=c.entry.capabilities.idempotency.scope,
    )
    handled = next(
        (t for t in transitions if t.kind is EdgeKind.FAULT and t.label == "fault"), None
    )
    producer = f"{EFFECT_COMPLETION_PRODUCER}:{owner.kind.value}/{owner.owner_id or '-'}"
    dep_key = f"handoff:{submit}"
    dep = DependencyDecl(
        producer_kind=producer,
        key=dep_key,
        condition="owner_receipt",
        condition_digest=_condition_digest(producer, dep_key, "owner_receipt"),
        deadline=None,
        deadline_seconds=None,
        # OUTCOME_UNKNOWN is never retried blindly (§15.3): without an explicit
        # fault path the completion quarantines.
        expiry_policy=ExpiryPolicy.FAULT_PATH if handled else ExpiryPolicy.QUARANTINE,
        fault_successor=handled.target if handled else None,
    )
    pins = _pins(ctx, [nid])
    inputs = checkpoint.inputs if checkpoint else ()
    outputs = checkpoint.outputs if checkpoint else ()
    return [
        PlanStep(
            key=submit,
            kind=StepKind.EFFECT_SUBMIT,
            entry=nid,
            nodes=(nid,),
            transitions=(Transition(EdgeKind.WAIT, "handoff", nid, completion),),
            queue_class=QueueClass.DURABLE_MUTATION,
            bounds=bounds,
            resources=resources,
            checkpoint=CheckpointSchema(inputs, ()),
            effect=effect,
            actions=pins,
        ),
        PlanStep(
            key=completion,
            kind=StepKind.EFFECT_COMPLETION,
            entry=nid,
            nodes=(nid,),
            transitions=transitions,
            queue_class=QueueClass.EFFECT_COMPLETION,
            bounds=BoundSummary(1, 0, 0, 1, ()),
            checkpoint=CheckpointSchema((), outputs),
            dependency=dep,
            effect=effect,
            actions=pins,
        ),
    ]


def build_steps(ctx: StepContext, profile: ExecutionProfile) -> tuple[tuple[PlanStep, ...], str]:
    """Steps of the plan for ``profile`` and the key of the start step."""
    if profile is ExecutionProfile.DURABLE_ORCHESTRATION:
        return _durable(ctx)
    return _single_step(ctx, profile)
