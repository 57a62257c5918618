"""Steps 10-11 of §7.2: select the execution profile by §9 and reject unsafe requests.

Eligibility is expressed as *blockers*: each names the exact node (with its
transitive subflow chain) and the reason it cannot run under a profile. A
profile is eligible when its blocker list is empty; the lists themselves are
the diagnostics.

Selection rules (one per line, also in ``docs/flow-language.md``):

1. a ``before_save`` Flow runs Embedded Before-Save, or is rejected with every
   embedded blocker (it has no other profile: it runs inside the caller's save);
2. a ``run_atomically`` request on a before-save Flow is rejected;
3. ``run_atomically: true`` selects Bounded Atomic when it has no blocker;
   otherwise activation fails naming every blocker — unless the policy's
   versioned ``legacy_atomic_mapping`` says ``durable_orchestration``, which
   selects Durable Orchestration with a warning per blocker;
4. otherwise Bounded Atomic is selected when provably safe;
5. otherwise Durable Orchestration (with an info diagnostic per blocker).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .bounds import Bound
from .capabilities import NodeCaps
from .catalog_inputs import ExecutionClass, ReplayPolicy, TransactionPolicy
from .diagnostics import IssueSink, Severity, format_chain
from .graph import FlowGraph, NodeKind
from .inputs import LegacyAtomicMapping, ProfileBounds, RuntimePolicy
from .kinds import ExecutionProfile
from .language import FlowDef, TriggerTiming
from .plan import BoundSummary

__all__ = ["Blocker", "atomic_blockers", "embedded_blockers", "select_profile"]

# Both in-transaction profiles run actions inside one transaction they do not
# let the action own: the caller's (embedded) or the root step's (atomic).
_IN_TX_OK = (TransactionPolicy.CALLER_TRANSACTION, TransactionPolicy.PROFILE_DEPENDENT)
_REPLAY_OK = (ReplayPolicy.DETERMINISTIC_REPLAY, ReplayPolicy.IDEMPOTENT_BY_KEY)


@dataclass(frozen=True, order=True)
class Blocker:
    """Why one node (or the whole Flow) cannot run under a profile."""

    path: str
    chain: tuple[str, ...]
    kind: str
    reason: str

    def text(self) -> str:
        """``"Subflow X → ActionCall Y: reason"``."""
        return f"{format_chain(self.chain)}: {self.reason}" if self.chain else self.reason


def _node_blockers(graph: FlowGraph, caps: Mapping[str, NodeCaps], embedded: bool) -> list[Blocker]:
    out: list[Blocker] = []
    for nid, node in graph.nodes.items():
        if node.kind is not NodeKind.ELEMENT:
            continue
        c = caps[nid]
        path, chain = node.issue_path(), node.chain()

        def add(kind: str, reason: str, path: str = path, chain: tuple[str, ...] = chain) -> None:
            out.append(Blocker(path, chain, kind, reason))

        if c.execution_class is ExecutionClass.WAIT:
            add("wait", "a wait cannot be held inside one transaction")
        if c.external:
            add(
                "external_effect",
                f"execution class {c.execution_class.value} "
                f"(effect owner {c.effect_owner.kind.value}) "
                "needs an external call outside any Flow transaction",
            )
        if embedded and c.mutates:
            add("writes_other_records", "writes records other than the trigger record")
        # An effect's or a wait's own blocker already says it all.
        if c.entry is not None and not c.external and c.execution_class is not ExecutionClass.WAIT:
            if (
                c.transaction_policy not in _IN_TX_OK
                and c.transaction_policy is not TransactionPolicy.UNKNOWN
            ):
                add("transaction_policy", f"transaction policy {c.transaction_policy.value}")
            if c.replay_policy not in _REPLAY_OK and c.replay_policy is not ReplayPolicy.UNKNOWN:
                add(
                    "replay_policy",
                    f"replay policy {c.replay_policy.value} is not safe under a whole-step retry",
                )
            for f in c.unknown:
                add("unknown_capability", f"capability {f} is unknown (fails closed)")
        if (
            c.reads is None
            or c.writes is None
            or (c.fanout is None and c.execution_class is not ExecutionClass.PURE_COMPUTE)
        ):
            add("unbounded_fanout", f"row bound unknown ({c.row_source})")
    return out


def _loop_blockers(graph: FlowGraph, loops: Mapping[str, Bound]) -> list[Blocker]:
    out = []
    for lid, b in sorted(loops.items()):
        if b.value is None:
            node = graph.nodes[lid]
            out.append(
                Blocker(
                    node.issue_path(),
                    node.chain(),
                    "unbounded_loop",
                    f"loop bound unknown ({b.source})",
                )
            )
    return out


def _bound_blockers(
    graph: FlowGraph,
    caps: Mapping[str, NodeCaps],
    summary: BoundSummary,
    bounds: ProfileBounds,
    profile: ExecutionProfile,
    policy: RuntimePolicy,
) -> list[Blocker]:
    out = []
    for metric, value, limit in (
        ("element executions", summary.max_steps, bounds.max_steps),
        ("reads", summary.max_reads, bounds.max_reads),
        ("writes", summary.max_writes, bounds.max_writes),
        ("fan-out", summary.max_fanout, bounds.max_fanout),
    ):
        if value is not None and value > limit:
            out.append(
                Blocker(
                    "flow",
                    (),
                    "exceeds_policy",
                    f"maximum {metric} {value} exceeds the {profile.value} bound {limit} "
                    f"(policy v{policy.version})",
                )
            )
    allowed = set(bounds.lock_classes)
    for nid, node in graph.nodes.items():
        for rc in caps[nid].lock_classes:
            if rc not in allowed:
                out.append(
                    Blocker(
                        node.issue_path(),
                        node.chain(),
                        "lock_class",
                        f"lock class {rc} is not allowed for {profile.value} "
                        f"(policy v{policy.version})",
                    )
                )
    return out


def embedded_blockers(
    graph: FlowGraph,
    caps: Mapping[str, NodeCaps],
    loops: Mapping[str, Bound],
    summary: BoundSummary,
    policy: RuntimePolicy,
) -> list[Blocker]:
    """Everything that keeps a before-save Flow out of Embedded Before-Save (§9.1)."""
    p = ExecutionProfile.EMBEDDED_BEFORE_SAVE
    return sorted(
        set(
            _node_blockers(graph, caps, embedded=True)
            + _loop_blockers(graph, loops)
            + _bound_blockers(graph, caps, summary, policy.bounds_for(p), p, policy)
        )
    )


def atomic_blockers(
    graph: FlowGraph,
    caps: Mapping[str, NodeCaps],
    loops: Mapping[str, Bound],
    summary: BoundSummary,
    policy: RuntimePolicy,
) -> list[Blocker]:
    """Everything that keeps a Flow out of Bounded Atomic (§9.2)."""
    p = ExecutionProfile.BOUNDED_ATOMIC
    return sorted(
        set(
            _node_blockers(graph, caps, embedded=False)
            + _loop_blockers(graph, loops)
            + _bound_blockers(graph, caps, summary, policy.bounds_for(p), p, policy)
        )
    )


def select_profile(
    flow: FlowDef,
    graph: FlowGraph,
    caps: Mapping[str, NodeCaps],
    loops: Mapping[str, Bound],
    summary: BoundSummary,
    policy: RuntimePolicy,
    sink: IssueSink,
) -> ExecutionProfile | None:
    """Apply the selection rules of the module docstring; ``None`` after reporting errors."""
    trig = flow.trigger
    if trig is not None and trig.timing is TriggerTiming.BEFORE_SAVE:
        if flow.run_atomically:
            sink.error(
                "flow.run_atomically",
                "profile.atomic_request_before_save",
                "run_atomically cannot apply to a before-save Flow: "
                "it always runs in the caller's transaction",
            )
        blockers = embedded_blockers(graph, caps, loops, summary, policy)
        for b in blockers:
            sink.error(
                b.path,
                f"before_save_ineligible.{b.kind}",
                f"a before-save Flow must run as Embedded Before-Save: {b.text()}",
                b.chain,
            )
        return None if blockers or flow.run_atomically else ExecutionProfile.EMBEDDED_BEFORE_SAVE
    blockers = atomic_blockers(graph, caps, loops, summary, policy)
    if not blockers:
        return ExecutionProfile.BOUNDED_ATOMIC
    if flow.run_atomically:
        if policy.legacy_atomic_mapping is LegacyAtomicMapping.DURABLE_ORCHESTRATION:
            for b in blockers:
                sink.note(
                    Severity.WARNING,
                    b.path,
                    "profile.atomic_mapped_to_durable",
                    "run_atomically mapped to durable_orchestration by "
                    f"policy v{policy.version}: {b.text()}",
                    b.chain,
                )
            return ExecutionProfile.DURABLE_ORCHESTRATION
        for b in blockers:
            sink.error(
                b.path,
                f"atomic_unsafe.{b.kind}",
                f"run_atomically cannot be proven safe: {b.text()}",
                b.chain,
            )
        return None
    for b in blockers:
        sink.note(
            Severity.INFO,
            b.path,
            f"profile.not_atomic.{b.kind}",
            f"Bounded Atomic not provable, Durable Orchestration selected: {b.text()}",
            b.chain,
        )
    return ExecutionProfile.DURABLE_ORCHESTRATION
