"""Step 7 of §7.2: prove loop and fan-out bounds, or mark them unknown.

A bound is *declared* (the author states a maximum the runtime enforces:
``Loop.bound.max`` or a collection variable's ``max_items``), *metadata*-derived
(a query ``limit``, ``first_only``, an ``Id`` equality, or a relationship whose
``max_children`` the metadata view publishes), or *unknown*. ``None`` always
means unknown; arithmetic with it stays unknown except that zero absorbs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.invariants import InvariantError

from .expressions import Ref
from .graph import FlowGraph
from .inputs import MetadataViewInput
from .language import Assignment, AssignOp, Filter, FlowDef, GetRecords, Loop, Subflow
from .plan import LoopProof

__all__ = [
    "Bound",
    "QueryBound",
    "add",
    "collection_bounds",
    "loop_proofs",
    "mul",
    "multiplicities",
    "query_bound",
    "to_proofs",
]


@dataclass(frozen=True)
class Bound:
    """A proven (or unknown) maximum with its proof kind and a human source."""

    value: int | None
    kind: str
    source: str


@dataclass(frozen=True)
class QueryBound:
    """Row bound of a query plus whether it was derived through a relationship."""

    value: int | None
    source: str
    relationship: str | None = None


def mul(a: int | None, b: int | None) -> int | None:
    """Product of two bounds (zero absorbs unknown)."""
    if a == 0 or b == 0:
        return 0
    return None if a is None or b is None else a * b


def add(values: Iterable[int | None]) -> int | None:
    """Sum of bounds (any unknown makes the sum unknown)."""
    total = 0
    for v in values:
        if v is None:
            return None
        total += v
    return total


def query_bound(
    obj: str,
    filters: tuple[Filter, ...],
    limit: int | None,
    first_only: bool,
    view: MetadataViewInput,
) -> QueryBound:
    """Maximum rows a query over ``obj`` can return, from its shape and the metadata view."""
    if first_only:
        return QueryBound(1, "first_only")
    if any(f.field == "Id" and f.op == "=" for f in filters):
        return QueryBound(1, "Id equality")
    cands: list[QueryBound] = []
    if limit is not None:
        cands.append(QueryBound(limit, f"limit {limit}"))
    for f in sorted(filters, key=lambda f: f.field):
        rel = view.relationship_for(obj, f.field) if f.op == "=" else None
        if rel is not None and rel.max_children is not None:
            cands.append(
                QueryBound(
                    rel.max_children,
                    f"relationship {rel.name} max_children {rel.max_children}",
                    rel.name,
                )
            )
    if cands:
        return min(cands, key=lambda q: (q.value if q.value is not None else 0, q.source))
    return QueryBound(None, f"query on {obj} has no limit and no bounded relationship filter")


def collection_bounds(
    flow: FlowDef, view: MetadataViewInput, children: Mapping[tuple[str, int], FlowDef]
) -> dict[str, Bound]:
    """Bound of every collection variable of ``flow`` (names unqualified)."""
    out: dict[str, Bound] = {}
    writers: dict[str, list[Bound | str]] = {v.name: [] for v in flow.variables if v.collection}
    for el in flow.elements:
        if isinstance(el, GetRecords) and el.output_variable in writers and not el.first_only:
            q = query_bound(el.object, el.filters, el.limit, el.first_only, view)
            writers[el.output_variable].append(
                Bound(
                    q.value,
                    "metadata" if q.value is not None else "unknown",
                    f"{el.api_name}: {q.source}",
                )
            )
        elif isinstance(el, Assignment):
            for item in el.items:
                if item.target.root not in writers or item.target.path:
                    continue
                if item.op is AssignOp.SET and isinstance(item.value, Ref) and not item.value.path:
                    writers[item.target.root].append(item.value.root)  # copy of another collection
                else:
                    writers[item.target.root].append(
                        Bound(
                            None, "unknown", f"{el.api_name}: {item.op.value} grows the collection"
                        )
                    )
        elif isinstance(el, Subflow):
            child = children.get((el.flow, el.version))
            for parent_var, child_var in el.outputs:
                if parent_var not in writers:
                    continue
                cv = None if child is None else child.variable(child_var)
                if cv is not None and cv.max_items is not None:
                    writers[parent_var].append(
                        Bound(cv.max_items, "declared", f"{el.flow}.{child_var} max_items")
                    )
                else:
                    writers[parent_var].append(
                        Bound(None, "unknown", f"{el.api_name}: subflow output {child_var}")
                    )
    # Resolve copies to a fixed point (bounded by the number of variables).
    for _ in range(len(writers) + 1):
        changed = False
        for name, ws in writers.items():
            var = flow.variable(name)
            if var is None:
                raise InvariantError(f"writer of an undeclared variable {name!r}")
            if var.max_items is not None:
                new = Bound(var.max_items, "declared", f"variable {name} max_items {var.max_items}")
            elif not ws:
                new = (
                    Bound(None, "unknown", f"input collection {name} declares no max_items")
                    if var.input
                    else Bound(0, "metadata", f"{name} is never filled")
                )
            else:
                parts: list[Bound] = []
                for w in ws:
                    if isinstance(w, str):
                        parts.append(out.get(w, Bound(None, "unknown", f"copy of {w}")))
                    else:
                        parts.append(w)
                unknown = [p for p in parts if p.value is None]
                if unknown:
                    new = Bound(None, "unknown", unknown[0].source)
                else:
                    best = max(parts, key=lambda p: (p.value or 0, p.source))
                    new = Bound(best.value, best.kind, best.source)
            if out.get(name) != new:
                out[name] = new
                changed = True
        if not changed:
            break
    return out


def _loop_bound(el: Loop, coll: Mapping[str, Bound], view: MetadataViewInput) -> Bound:
    if el.bound is not None and el.bound.max is not None:
        return Bound(el.bound.max, "declared", f"declared bound max {el.bound.max}")
    if el.bound is not None and el.bound.relationship is not None:
        rel = view.relationship(el.bound.relationship)
        if rel is not None and rel.max_children is not None:
            return Bound(
                rel.max_children,
                "metadata",
                f"relationship {rel.name} max_children {rel.max_children}",
            )
        return Bound(
            None, "unknown", f"relationship {el.bound.relationship} publishes no max_children"
        )
    return coll.get(
        el.collection, Bound(None, "unknown", f"collection {el.collection} has no proven bound")
    )


def loop_proofs(
    graph: FlowGraph, view: MetadataViewInput, children: Mapping[tuple[str, int], FlowDef]
) -> dict[str, Bound]:
    """Bound of every reachable loop node, keyed by node id."""
    cache: dict[int, dict[str, Bound]] = {}
    out: dict[str, Bound] = {}
    for lid in graph.loops:
        node = graph.nodes[lid]
        if not isinstance(node.element, Loop) or node.flow is None:
            raise InvariantError("a loop node without its Loop element or Flow")
        key = id(node.flow)
        if key not in cache:
            cache[key] = collection_bounds(node.flow, view, children)
        out[lid] = _loop_bound(node.element, cache[key], view)
    return out


def multiplicities(graph: FlowGraph, loops: Mapping[str, Bound]) -> dict[str, int | None]:
    """Maximum executions of each node per run (product of enclosing loop bounds).

    A loop head runs once more than its bound per entry (the final "done" test).
    """
    out: dict[str, int | None] = {}
    for nid in graph.nodes:
        m: int | None = 1
        for lid in graph.enclosing_loops(nid):
            m = mul(m, loops[lid].value)
        if nid in loops:
            b = loops[nid].value
            m = mul(m, None if b is None else b + 1)
        out[nid] = m
    return out


def to_proofs(graph: FlowGraph, loops: Mapping[str, Bound]) -> tuple[LoopProof, ...]:
    """Loop proofs as plan values (multiplicity = body executions per run)."""
    proofs = []
    for lid, b in sorted(loops.items()):
        outer: int | None = 1
        for enc in graph.enclosing_loops(lid):
            outer = mul(outer, loops[enc].value)
        proofs.append(LoopProof(lid, b.kind, b.value, b.source, mul(outer, b.value)))
    return tuple(proofs)
