"""Steps 5-6 of §7.2: annotate every CFG node with its capabilities.

Built-in elements have fixed, fully known capabilities; an ActionCall takes its
capabilities from its pinned catalog entry, unknown fields included. Because
subflows are inlined into the CFG and loop multiplicities multiply per-node
rows, capabilities propagate transitively through subflows and loops by
construction: :func:`summarize` over any node set is the transitive summary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from services.invariants import InvariantError

from .bounds import Bound, add, collection_bounds, mul, query_bound
from .catalog_inputs import (
    CapabilityEntryView,
    EffectOwner,
    EffectOwnerKind,
    ExecutionClass,
    FanoutKind,
    LockPlanKind,
    OutputDurability,
    ReadContract,
    ReplayPolicy,
    TransactionPolicy,
)
from .graph import FlowGraph, Node, NodeKind
from .inputs import MetadataViewInput
from .language import (
    ActionCall,
    Assignment,
    CreateRecord,
    DeleteRecord,
    FlowDef,
    GetRecords,
    Loop,
    ReadMode,
    TriggerTiming,
    UpdateRecord,
    Wait,
)
from .plan import BoundSummary, ResourceDecl

__all__ = ["NodeCaps", "annotate", "summarize"]


@dataclass(frozen=True)
class NodeCaps:
    """Capabilities of one node per execution (rows are per execution, not per run)."""

    execution_class: ExecutionClass = ExecutionClass.PURE_COMPUTE
    transaction_policy: TransactionPolicy = TransactionPolicy.CALLER_TRANSACTION
    replay_policy: ReplayPolicy = ReplayPolicy.DETERMINISTIC_REPLAY
    read_contract: ReadContract = ReadContract.CHECKPOINT_ONLY
    lock_kind: LockPlanKind = LockPlanKind.STATIC_KEYS
    effect_owner: EffectOwner = field(default_factory=lambda: EffectOwner(EffectOwnerKind.NONE))
    output_durability: OutputDurability = OutputDurability.EPHEMERAL
    reads: int | None = 0
    writes: int | None = 0
    fanout: int | None = 1
    row_source: str = ""
    resources: tuple[ResourceDecl, ...] = ()
    unknown: tuple[str, ...] = ()
    trigger_transform: bool = False
    entry: CapabilityEntryView | None = None

    @property
    def external(self) -> bool:
        """True for an external effect (a remote call owned by an effect owner)."""
        return self.execution_class is ExecutionClass.EXTERNAL_EFFECT or self.effect_owner.kind in (
            EffectOwnerKind.INTEGRATION_WORK,
            EffectOwnerKind.RUNTIME_DELIVERY,
            EffectOwnerKind.REGISTERED_OWNER,
        )

    @property
    def mutates(self) -> bool:
        """True when the node writes business records in a transaction."""
        return self.execution_class is ExecutionClass.RECORD_MUTATION and not self.trigger_transform

    @property
    def lock_classes(self) -> tuple[str, ...]:
        """Sorted resource classes this node locks."""
        return tuple(sorted({r.resource_class for r in self.resources}))


_PURE = NodeCaps()


def _record_resources(
    view: MetadataViewInput, obj: str, key_source: str, rows: int | None
) -> tuple[ResourceDecl, ...]:
    out = [ResourceDecl("record", obj, None, key_source, rows)]
    for rel in sorted(view.relationships, key=lambda r: r.name):
        if rel.child_object == obj and rel.lock_parent:
            out.append(
                ResourceDecl(
                    "parent_record", rel.parent_object, rel.name, f"field:{rel.field}", rows
                )
            )
    o = view.object(obj)
    if o is not None and o.history_tracked:
        out.append(ResourceDecl("history_sequence", obj, None, key_source, rows))
    return tuple(sorted(out))


def _mutation(node: Node, view: MetadataViewInput, coll: Mapping[str, Bound]) -> NodeCaps:
    el = node.element
    if not isinstance(el, CreateRecord | UpdateRecord | DeleteRecord):
        raise InvariantError("a mutation node without a record element")
    flow = node.flow
    if flow is None:
        raise InvariantError("a mutation node outside any Flow")
    base = NodeCaps(
        execution_class=ExecutionClass.RECORD_MUTATION,
        transaction_policy=TransactionPolicy.PROFILE_DEPENDENT,
        output_durability=OutputDurability.CHECKPOINTED,
    )
    if isinstance(el, CreateRecord):
        if el.from_variable is not None:
            b = coll.get(el.from_variable, Bound(None, "unknown", f"{el.from_variable} unbounded"))
            rows, key, src = b.value, f"variable:{node.prefix}{el.from_variable}", b.source
        else:
            rows, key, src = 1, "created", "one record"
        return replace(
            base,
            writes=rows,
            fanout=rows,
            row_source=src,
            resources=_record_resources(view, el.object, key, rows),
        )
    if el.record == "$Record":
        trig = flow.trigger
        if (
            isinstance(el, UpdateRecord)
            and trig is not None
            and trig.timing is TriggerTiming.BEFORE_SAVE
        ):
            # Before-save: an in-memory change the caller saves in its own transaction.
            return replace(_PURE, trigger_transform=True)
        return replace(
            base,
            writes=1,
            row_source="trigger record",
            resources=_record_resources(view, el.object, "trigger_record", 1),
        )
    if el.record is not None:
        var = flow.variable(el.record)
        if var is not None and var.collection:
            b = coll.get(el.record, Bound(None, "unknown", f"{el.record} unbounded"))
            rows, src = b.value, b.source
        else:
            rows, src = 1, f"variable {el.record}"
        return replace(
            base,
            writes=rows,
            fanout=rows,
            row_source=src,
            resources=_record_resources(
                view, el.object, f"variable:{node.prefix}{el.record}", rows
            ),
        )
    q = query_bound(el.object, el.filters, el.limit, False, view)
    lock = LockPlanKind.METADATA_DERIVED if q.relationship else LockPlanKind.LATE_DISCOVERY_ALLOWED
    return replace(
        base,
        reads=q.value,
        writes=q.value,
        fanout=q.value,
        row_source=q.source,
        lock_kind=lock,
        read_contract=ReadContract.CURRENT_TRANSACTIONAL,
        resources=_record_resources(view, el.object, "query", q.value),
    )


def _action(node: Node, entry: CapabilityEntryView, view: MetadataViewInput) -> NodeCaps:
    d = entry.capabilities
    fb = d.fanout_bound
    if fb.kind is FanoutKind.STATIC:
        fan, src = fb.max, f"static fan-out {fb.max}"
    elif fb.kind is FanoutKind.METADATA_DERIVED:
        rel = view.relationship(fb.relationship or "")
        fan = None if rel is None else rel.max_children
        src = f"relationship {fb.relationship} max_children {fan}"
    else:
        fan, src = None, "fan-out unknown"
    reads = fan if d.execution_class is ExecutionClass.RECORD_READ else 0
    writes = fan if d.execution_class is ExecutionClass.RECORD_MUTATION else 0
    if not isinstance(node.element, ActionCall):
        raise InvariantError("an action node without its ActionCall")
    resources = tuple(
        sorted(
            ResourceDecl(rc, obj, None, f"action:{entry.action_type}", fan)
            for rc in d.lock_plan.resource_classes
            for obj in d.lock_plan.objects
        )
    )
    return NodeCaps(
        execution_class=d.execution_class,
        transaction_policy=d.transaction_policy,
        replay_policy=d.replay_policy,
        read_contract=d.read_contract,
        lock_kind=d.lock_plan.kind,
        effect_owner=d.effect_owner,
        output_durability=d.output_durability,
        reads=reads,
        writes=writes,
        fanout=fan,
        row_source=src,
        resources=resources,
        unknown=d.unknown_fields(),
        entry=entry,
    )


def _node_caps(
    node: Node,
    view: MetadataViewInput,
    pins: Mapping[str, CapabilityEntryView],
    coll: Mapping[str, Bound],
) -> NodeCaps:
    el = node.element
    if node.kind is not NodeKind.ELEMENT or el is None:
        return _PURE
    if isinstance(el, Assignment):
        return replace(_PURE, trigger_transform=any(i.target.root == "$Record" for i in el.items))
    if isinstance(el, GetRecords):
        q = query_bound(el.object, el.filters, el.limit, el.first_only, view)
        mode = (
            ReadContract.CURRENT_TRANSACTIONAL
            if el.read_mode is ReadMode.CURRENT
            else ReadContract.VERIFIED_SNAPSHOT
        )
        return NodeCaps(
            execution_class=ExecutionClass.RECORD_READ,
            transaction_policy=TransactionPolicy.PROFILE_DEPENDENT,
            read_contract=mode,
            output_durability=OutputDurability.CHECKPOINTED,
            reads=q.value,
            fanout=q.value,
            row_source=q.source,
        )
    if isinstance(el, CreateRecord | UpdateRecord | DeleteRecord):
        return _mutation(node, view, coll)
    if isinstance(el, ActionCall):
        return _action(node, pins[el.action_type], view)
    if isinstance(el, Wait):
        return NodeCaps(
            execution_class=ExecutionClass.WAIT,
            transaction_policy=TransactionPolicy.TRANSACTION_FORBIDDEN,
            output_durability=OutputDurability.CHECKPOINTED,
        )
    return _PURE


def annotate(
    graph: FlowGraph,
    view: MetadataViewInput,
    pins: Mapping[tuple[str, int], Mapping[str, CapabilityEntryView]],
    children: Mapping[tuple[str, int], FlowDef],
) -> dict[str, NodeCaps]:
    """Capabilities of every node; ``pins`` maps each Flow version to its resolved entries."""
    coll_cache: dict[tuple[str, int], dict[str, Bound]] = {}
    out: dict[str, NodeCaps] = {}
    for nid, node in graph.nodes.items():
        flow = node.flow
        if flow is None:
            out[nid] = _PURE
            continue
        key = (flow.api_name, flow.version)
        if key not in coll_cache:
            coll_cache[key] = collection_bounds(flow, view, children)
        out[nid] = _node_caps(node, view, pins.get(key, {}), coll_cache[key])
    return out


def summarize(
    graph: FlowGraph,
    caps: Mapping[str, NodeCaps],
    node_ids: Iterable[str],
    mult: Mapping[str, int | None],
    loop_unknown: Iterable[str] = (),
) -> BoundSummary:
    """Bounds of executing ``node_ids`` with the given per-node multiplicities."""
    ids = sorted(node_ids)
    elements = [n for n in ids if graph.nodes[n].kind in (NodeKind.ELEMENT, NodeKind.RETURN)]
    unknown: set[str] = set(loop_unknown)
    for n in ids:
        c, node = caps[n], graph.nodes[n]
        for f in c.unknown:
            unknown.add(f"{' → '.join(node.chain())}: capability {f} unknown")
        if (
            c.reads is None
            or c.writes is None
            or (c.fanout is None and c.execution_class is not ExecutionClass.PURE_COMPUTE)
        ):
            unknown.add(f"{' → '.join(node.chain())}: row bound unknown ({c.row_source})")
    fanouts: list[int | None] = []
    for n in ids:
        c = caps[n]
        if isinstance(graph.nodes[n].element, Loop) and graph.nodes[n].kind is NodeKind.ELEMENT:
            continue  # its body nodes carry the fan-out; the head's extra "done" test is not one
        rows: int | None = 1
        if c.execution_class is not ExecutionClass.PURE_COMPUTE:
            rows = None if c.fanout is None else max(1, c.fanout)
        fanouts.append(mul(mult.get(n, 1), rows))
    return BoundSummary(
        max_steps=add(mult.get(n, 1) for n in elements),
        max_reads=add(mul(mult.get(n, 1), caps[n].reads) for n in ids),
        max_writes=add(mul(mult.get(n, 1), caps[n].writes) for n in ids),
        max_fanout=None
        if any(f is None for f in fanouts)
        else max([1, *(f for f in fanouts if f is not None)]),
        lock_classes=tuple(sorted({rc for n in ids for rc in caps[n].lock_classes})),
        unknown=tuple(sorted(unknown)),
    )
