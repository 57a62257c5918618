"""Steps 3-4 of §7.2: the control-flow graph, loop bodies and cycle rejection.

Subflows are inlined: a Subflow element becomes an entry node that binds the
child's inputs, followed by the child's own nodes (ids prefixed with
``<subflow element>/``) and a ``<subflow element>/$return`` node that binds
outputs back. Capabilities and bounds therefore propagate transitively with no
special cases, and every node knows its nesting (``scope``) so a diagnostic can
name the exact chain (``Subflow notify → ActionCall send_email``).

Node ids are built from element api names, never list positions, which is
what keeps step keys stable under element reordering. Synthetic nodes start
with ``$``, which element names cannot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

from services.invariants import InvariantError

from .diagnostics import IssueSink, Severity
from .kinds import EdgeKind
from .language import (
    Decision,
    Element,
    ElementType,
    End,
    Fault,
    FlowDef,
    Loop,
    Subflow,
    Wait,
)

__all__ = ["END", "FAILED", "Edge", "FlowGraph", "Frame", "Node", "NodeKind", "build_graph"]

END = "$end"
FAILED = "$failed"
RETURN = "$return"

_IMPLICIT_FAULT = frozenset(
    {
        ElementType.GET_RECORDS,
        ElementType.CREATE_RECORD,
        ElementType.UPDATE_RECORD,
        ElementType.DELETE_RECORD,
        ElementType.ACTION_CALL,
    }
)


class NodeKind(StrEnum):
    """What a CFG node stands for."""

    ELEMENT = "element"
    END = "end"
    FAILED = "failed"
    RETURN = "subflow_return"


@dataclass(frozen=True)
class Frame:
    """One level of subflow nesting: the calling element and the called Flow version."""

    element: str
    flow: str
    version: int


@dataclass(frozen=True)
class Node:
    """A CFG node; ``flow`` is the Flow whose variables the node reads and writes."""

    id: str
    kind: NodeKind
    element: Element | None = None
    flow: FlowDef | None = None
    scope: tuple[Frame, ...] = ()

    @property
    def prefix(self) -> str:
        """Id prefix of the Flow the node's variables live in (``""`` at top level)."""
        return "".join(f"{f.element}/" for f in self.scope)

    @property
    def label(self) -> str:
        """``"<Type> <api_name>"`` for elements, a fixed text for synthetic nodes."""
        if self.kind is NodeKind.END:
            return "End of run"
        if self.kind is NodeKind.FAILED:
            return "Terminal failure"
        if self.element is None:
            raise InvariantError("an element node without its element")
        if self.kind is NodeKind.RETURN:
            return f"Subflow {self.element.api_name} (return)"
        return f"{self.element.type.value} {self.element.api_name}"

    def chain(self) -> tuple[str, ...]:
        """Transitive blocker chain from the top-level element down to this node."""
        return (*(f"Subflow {f.element}" for f in self.scope), self.label)

    def issue_path(self) -> str:
        """Source path of the top-level element responsible for this node."""
        if self.scope:
            return f"elements[{self.scope[0].element}]"
        if self.element is not None:
            return f"elements[{self.element.api_name}]"
        return "flow"

    @property
    def element_type(self) -> ElementType | None:
        """The element type, ``None`` for synthetic nodes and subflow returns."""
        if self.kind is not NodeKind.ELEMENT or self.element is None:
            return None
        return self.element.type


@dataclass(frozen=True, order=True)
class Edge:
    """A directed CFG edge."""

    src: str
    dst: str
    kind: EdgeKind
    label: str


@dataclass(frozen=True)
class FlowGraph:
    """The reachable CFG of one Flow with its subflows inlined."""

    start: str
    nodes: Mapping[str, Node]
    edges: tuple[Edge, ...]
    loops: Mapping[str, frozenset[str]] = field(default_factory=dict)

    @cached_property
    def _by_src(self) -> dict[str, tuple[Edge, ...]]:
        out: dict[str, list[Edge]] = {}
        for e in self.edges:
            out.setdefault(e.src, []).append(e)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def _by_dst(self) -> dict[str, tuple[Edge, ...]]:
        out: dict[str, list[Edge]] = {}
        for e in self.edges:
            out.setdefault(e.dst, []).append(e)
        return {k: tuple(v) for k, v in out.items()}

    def out_edges(self, node_id: str) -> tuple[Edge, ...]:
        """Edges leaving ``node_id``, sorted."""
        return self._by_src.get(node_id, ())

    def in_edges(self, node_id: str) -> tuple[Edge, ...]:
        """Edges entering ``node_id``, sorted."""
        return self._by_dst.get(node_id, ())

    def enclosing_loops(self, node_id: str) -> tuple[str, ...]:
        """Loop nodes whose body contains ``node_id`` (sorted)."""
        return tuple(sorted(lid for lid, body in self.loops.items() if node_id in body))


class _Builder:
    def __init__(self, children: Mapping[tuple[str, int], FlowDef]) -> None:
        self.children = children
        self.nodes: dict[str, Node] = {}
        self.edges: list[Edge] = []

    def edge(self, src: str, dst: str, kind: EdgeKind, label: str) -> None:
        if kind is EdgeKind.SUCCESS:
            target = self.nodes.get(dst)
            ends_run = (
                target is not None
                and target.kind is NodeKind.ELEMENT
                and isinstance(target.element, End)
                and not target.scope  # a child's End returns to the parent
            )
            if dst == END or ends_run:
                kind = EdgeKind.TERMINAL
        self.edges.append(Edge(src, dst, kind, label))

    def add_flow(
        self, flow: FlowDef, scope: tuple[Frame, ...], exit_ok: str, exit_fault: str
    ) -> str:
        prefix = "".join(f"{f.element}/" for f in scope)
        for el in flow.elements:
            nid = prefix + el.api_name
            self.nodes[nid] = Node(nid, NodeKind.ELEMENT, el, flow, scope)
        for el in flow.elements:
            self.connect(flow, el, prefix, scope, exit_ok, exit_fault)
        return prefix + flow.start

    def connect(
        self,
        flow: FlowDef,
        el: Element,
        prefix: str,
        scope: tuple[Frame, ...],
        exit_ok: str,
        exit_fault: str,
    ) -> None:
        nid = prefix + el.api_name

        def target(name: str | None) -> str:
            return exit_ok if name is None else prefix + name

        if isinstance(el, End):
            if scope:
                self.edge(nid, exit_ok, EdgeKind.SUCCESS, "end")
            return
        if isinstance(el, Fault):
            self.edge(nid, exit_fault, EdgeKind.FAULT, "raise")
            return
        if isinstance(el, Subflow):
            child = self.children[(el.flow, el.version)]
            frame = Frame(el.api_name, el.flow, el.version)
            ret = f"{nid}/{RETURN}"
            self.nodes[ret] = Node(ret, NodeKind.RETURN, el, flow, scope)
            handler = exit_fault if el.fault is None else prefix + el.fault
            child_start = self.add_flow(child, (*scope, frame), ret, handler)
            self.edge(nid, child_start, EdgeKind.SUCCESS, "call")
            self.edge(ret, target(el.next), EdgeKind.SUCCESS, "next")
            return
        if isinstance(el, Decision):
            for rule in el.rules:
                self.edge(nid, target(rule.next), EdgeKind.SUCCESS, rule.name)
            self.edge(nid, target(el.next), EdgeKind.SUCCESS, "default")
            return
        if isinstance(el, Loop):
            if el.each is not None:
                self.edge(nid, prefix + el.each, EdgeKind.SUCCESS, "each")
            self.edge(nid, target(el.next), EdgeKind.SUCCESS, "done")
            return
        if isinstance(el, Wait):
            self.edge(nid, target(el.next), EdgeKind.WAIT, "resume")
            if el.fault is not None:
                self.edge(nid, prefix + el.fault, EdgeKind.FAULT, "expired")
            return
        self.edge(nid, target(el.next), EdgeKind.SUCCESS, "next")
        if el.fault is not None:
            self.edge(nid, prefix + el.fault, EdgeKind.FAULT, "fault")
        elif el.type in _IMPLICIT_FAULT:
            self.edge(nid, exit_fault, EdgeKind.FAULT, "unhandled")


def _reach(
    starts: Iterable[str], succ: Mapping[str, list[str]], blocked: frozenset[str] = frozenset()
) -> set[str]:
    seen: set[str] = set()
    todo = deque(s for s in starts if s not in blocked)
    while todo:
        n = todo.popleft()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(m for m in succ.get(n, ()) if m not in seen and m not in blocked)
    return seen


def _find_cycle(nodes: Iterable[str], succ: Mapping[str, list[str]]) -> list[str] | None:
    """One cycle (as a node list) in the graph, found by iterative DFS, or ``None``."""
    color: dict[str, int] = {}
    for root in sorted(nodes):
        if color.get(root):
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        path: list[str] = []
        while stack:
            n, i = stack.pop()
            if i == 0:
                color[n] = 1
                path.append(n)
            kids = sorted(succ.get(n, ()))
            if i < len(kids):
                stack.append((n, i + 1))
                k = kids[i]
                if color.get(k) == 1:
                    return [*path[path.index(k) :], k]
                if not color.get(k):
                    stack.append((k, 0))
            else:
                color[n] = 2
                path.pop()
    return None


def build_graph(
    flow: FlowDef, children: Mapping[tuple[str, int], FlowDef], sink: IssueSink
) -> FlowGraph | None:
    """Build the reachable CFG of ``flow``; ``None`` after reporting a structural error.

    Args:
        flow: The resolved Flow.
        children: Every Flow version reachable through Subflow elements.
        sink: Receives ``graph.*`` and ``loop.*`` issues and unreachable-element warnings.
    """
    b = _Builder(children)
    b.nodes[END] = Node(END, NodeKind.END)
    b.nodes[FAILED] = Node(FAILED, NodeKind.FAILED)
    start = b.add_flow(flow, (), END, FAILED)
    succ: dict[str, list[str]] = {}
    for e in b.edges:
        succ.setdefault(e.src, []).append(e.dst)
    live = _reach([start], succ)
    for el in flow.elements:
        if el.api_name not in live:
            sink.note(
                Severity.WARNING,
                f"elements[{el.api_name}]",
                "graph.unreachable",
                f"{el.type.value} {el.api_name} can never run; it is left out of the plan",
            )
    nodes = {k: b.nodes[k] for k in sorted(live)}
    edges = tuple(sorted({e for e in b.edges if e.src in live}))
    succ = {}
    for e in edges:
        succ.setdefault(e.src, []).append(e.dst)
    loops: dict[str, frozenset[str]] = {}
    ok = True
    for lid, node in nodes.items():
        if not isinstance(node.element, Loop) or node.kind is not NodeKind.ELEMENT:
            continue
        each = next((e.dst for e in edges if e.src == lid and e.label == "each"), None)
        if each is None:
            continue  # reported by the resolver (loop.missing_body)
        if each == lid:
            sink.error(
                node.issue_path(),
                "loop.empty_body",
                f"{node.label}: 'each' points at the loop itself",
                node.chain(),
            )
            ok = False
            continue
        fwd = _reach([each], succ, frozenset({lid}))
        pred: dict[str, list[str]] = {}
        for e in edges:
            if e.src in fwd:
                pred.setdefault(e.dst, []).append(e.src)
        body = frozenset(_reach(pred.get(lid, ()), pred) & fwd)
        if each not in body:
            sink.error(
                node.issue_path(),
                "loop.body_does_not_return",
                f"{node.label}: the 'each' path never returns to the loop",
                node.chain(),
            )
            ok = False
            continue
        loops[lid] = body
    back = {(u, lid) for lid, body in loops.items() for u in body}
    forward: dict[str, list[str]] = {}
    for e in edges:
        if e.src == e.dst and e.label == "each":
            continue  # loop.empty_body, reported above
        if (e.src, e.dst) not in back:
            forward.setdefault(e.src, []).append(e.dst)
    cycle = _find_cycle(nodes, forward)
    if cycle is not None:
        first = nodes[cycle[0]]
        sink.error(
            first.issue_path(),
            "graph.cycle",
            "connectors form a cycle that is not a Loop (unbounded repetition): "
            + " → ".join(cycle),
            first.chain(),
        )
        ok = False
    return FlowGraph(start, nodes, edges, loops) if ok else None
