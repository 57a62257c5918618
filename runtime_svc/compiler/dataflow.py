"""Which qualified variables each CFG node reads and writes.

Names are qualified by the node's subflow prefix (``notify/recipient``) so
inlined child variables never collide with the parent's. The result drives
checkpoint schemas (what a step's input checkpoint must contain and what it
adds) and snapshot verification (which ``VerifiedSnapshotRead`` steps a later
mutation must re-verify, §7.5).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.invariants import InvariantError

from .expressions import Expr, references
from .graph import FlowGraph, Node, NodeKind
from .language import (
    ActionCall,
    Assignment,
    CreateRecord,
    Decision,
    DeleteRecord,
    EventWait,
    FlowDef,
    GetRecords,
    Loop,
    ReadMode,
    RecordWait,
    Subflow,
    TimeWait,
    UpdateRecord,
    Variable,
    VarType,
    Wait,
)

__all__ = ["Access", "access", "snapshot_origins", "variable_types"]


@dataclass(frozen=True)
class Access:
    """Qualified variable names a node reads and writes."""

    reads: frozenset[str]
    writes: frozenset[str]


def _roots(prefix: str, exprs: list[Expr | None]) -> set[str]:
    out: set[str] = set()
    for e in exprs:
        if e is None:
            continue
        for r in references(e):
            if r.root == "$Event":
                continue
            out.add(r.root if r.root.startswith("$") else prefix + r.root)
    return out


def _node_access(node: Node) -> Access:
    el, p = node.element, node.prefix
    reads: set[str] = set()
    writes: set[str] = set()
    if el is None:
        return Access(frozenset(), frozenset())
    if node.kind is NodeKind.RETURN:
        if not isinstance(el, Subflow):
            raise InvariantError("a RETURN node without its Subflow")
        child = f"{p}{el.api_name}/"
        return Access(
            frozenset(child + c for _, c in el.outputs),
            frozenset(p + parent for parent, _ in el.outputs),
        )
    if isinstance(el, Assignment):
        for item in el.items:
            reads |= _roots(p, [item.value])
            t = item.target
            writes.add(t.root if t.root.startswith("$") else p + t.root)
            if t.path or item.op.value != "set":
                reads.add(t.root if t.root.startswith("$") else p + t.root)
    elif isinstance(el, Decision):
        reads |= _roots(p, [r.condition for r in el.rules])
    elif isinstance(el, Loop):
        reads.add(p + el.collection)
        writes.add(p + el.item_variable)
    elif isinstance(el, GetRecords):
        reads |= _roots(p, [f.value for f in el.filters])
        if el.output_variable:
            writes.add(p + el.output_variable)
    elif isinstance(el, CreateRecord):
        reads |= _roots(p, [v for _, v in el.fields])
        if el.from_variable:
            reads.add(p + el.from_variable)
        if el.output_variable:
            writes.add(p + el.output_variable)
    elif isinstance(el, UpdateRecord | DeleteRecord):
        reads |= _roots(p, [f.value for f in el.filters])
        if isinstance(el, UpdateRecord):
            reads |= _roots(p, [v for _, v in el.fields])
        if el.record == "$Record":
            reads.add("$Record")
            if isinstance(el, UpdateRecord):
                writes.add("$Record")
        elif el.record is not None:
            reads.add(p + el.record)
    elif isinstance(el, ActionCall):
        reads |= _roots(p, [v for _, v in el.inputs])
        if el.output_variable:
            writes.add(p + el.output_variable)
    elif isinstance(el, Subflow):
        reads |= _roots(p, [v for _, v in el.inputs])
        writes |= {f"{p}{el.api_name}/{k}" for k, _ in el.inputs}
    elif isinstance(el, Wait):
        w = el.wait
        if isinstance(w, TimeWait):
            reads |= _roots(p, [w.until])
        elif isinstance(w, EventWait):
            reads |= _roots(p, [w.key, w.condition])
        elif isinstance(w, RecordWait):
            reads |= _roots(p, [w.record_id, w.condition])
    return Access(frozenset(reads), frozenset(writes))


def access(graph: FlowGraph) -> dict[str, Access]:
    """Reads and writes of every node."""
    return {nid: _node_access(n) for nid, n in graph.nodes.items()}


def _type_name(v: Variable) -> str:
    base = f"record<{v.object}>" if v.type is VarType.RECORD else v.type.value
    return f"list<{base}>" if v.collection else base


def variable_types(graph: FlowGraph, top: FlowDef) -> dict[str, str]:
    """Qualified variable name → type name, for every Flow in the graph."""
    out: dict[str, str] = {}
    if top.trigger is not None:
        out["$Record"] = f"record<{top.trigger.object}>"
        out["$Record__Prior"] = f"record<{top.trigger.object}>"
    seen: set[str] = set()
    for node in graph.nodes.values():
        if node.flow is None or node.kind is not NodeKind.ELEMENT or node.prefix in seen:
            continue
        seen.add(node.prefix)
        for v in node.flow.variables:
            out[node.prefix + v.name] = _type_name(v)
    return out


def snapshot_origins(graph: FlowGraph, acc: Mapping[str, Access]) -> dict[str, frozenset[str]]:
    """For each qualified variable, the snapshot-read nodes its value may derive from."""
    origin: dict[str, set[str]] = {}
    for nid, node in graph.nodes.items():
        el = node.element
        if (
            node.kind is NodeKind.ELEMENT
            and isinstance(el, GetRecords)
            and el.read_mode is ReadMode.SNAPSHOT
            and el.output_variable
        ):
            origin.setdefault(node.prefix + el.output_variable, set()).add(nid)
    # Monotone fixed point over a finite lattice: terminates within |vars| rounds.
    for _ in range(len(acc) + 1):
        changed = False
        for a in acc.values():
            incoming: set[str] = set()
            for r in a.reads:
                incoming |= origin.get(r, set())
            if not incoming:
                continue
            for w in a.writes:
                cur = origin.setdefault(w, set())
                if not incoming <= cur:
                    cur |= incoming
                    changed = True
        if not changed:
            break
    return {k: frozenset(v) for k, v in origin.items()}
