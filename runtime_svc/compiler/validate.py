"""Step 9 of §7.2: validate transaction, checkpoint and effect boundaries of built steps.

These checks run on the *output* of step construction, so they also guard
against a future change in grouping silently producing an unsafe shape:

* no Durable transaction crosses an unknown fan-out or exceeds the policy
  (§5.2 rules 2-3);
* every external effect has an owner (§8.4 EffectOwner, §15);
* every external-effect boundary is exactly one ``EffectSubmit`` →
  ``EffectCompletion`` pair with no self-wait and no return edge (§7.5).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

from .capabilities import NodeCaps
from .catalog_inputs import EffectOwnerKind
from .diagnostics import CompileIssue, IssueSink, Severity
from .graph import FlowGraph
from .inputs import RuntimePolicy
from .kinds import EdgeKind, StepKind
from .plan import PlanStep

__all__ = ["validate_durable", "validate_effect_pairs"]

_TXN_KINDS = (StepKind.BOUNDED_MUTATION, StepKind.CURRENT_READ, StepKind.VERIFIED_SNAPSHOT_READ)


def validate_durable(
    graph: FlowGraph,
    caps: Mapping[str, NodeCaps],
    steps: Iterable[PlanStep],
    policy: RuntimePolicy,
    sink: IssueSink,
) -> None:
    """Per-step transaction bounds of a Durable Orchestration plan."""
    bounds = policy.durable_orchestration
    for s in steps:
        node = graph.nodes[s.entry]
        path, chain, c = node.issue_path(), node.chain(), caps[s.entry]
        where = " → ".join(chain)
        if s.kind is StepKind.EFFECT_SUBMIT and c.effect_owner.kind in (
            EffectOwnerKind.NONE,
            EffectOwnerKind.UNKNOWN,
        ):
            sink.error(
                path,
                "effect.no_owner",
                f"{where}: an external effect needs a designated effect owner to own its outcome",
                chain,
            )
        if s.kind not in _TXN_KINDS:
            continue
        b = s.bounds
        if s.kind is StepKind.BOUNDED_MUTATION and b.max_writes is None:
            sink.error(
                path,
                "transaction.unbounded_mutation",
                f"{where}: a mutation transaction cannot cross unknown fan-out ({c.row_source}); "
                "add a limit or a bounded relationship filter, or iterate with a Loop",
                chain,
            )
        elif b.max_writes is not None and b.max_writes > bounds.max_writes:
            sink.error(
                path,
                "transaction.exceeds_policy",
                f"{where}: {b.max_writes} writes in one transaction exceed the durable bound "
                f"{bounds.max_writes} (policy v{policy.version})",
                chain,
            )
        if b.max_reads is None:
            sink.note(
                Severity.WARNING,
                path,
                "checkpoint.unbounded_read",
                f"{where}: read size unknown ({c.row_source}); "
                "the runtime enforces the checkpoint size bound",
                chain,
            )
        elif b.max_reads > bounds.max_reads:
            sink.error(
                path,
                "transaction.exceeds_policy",
                f"{where}: {b.max_reads} reads in one step exceed the durable bound "
                f"{bounds.max_reads} (policy v{policy.version})",
                chain,
            )
        for rc in b.lock_classes:
            if rc not in bounds.lock_classes:
                sink.error(
                    path,
                    "transaction.lock_class",
                    f"{where}: lock class {rc} is not allowed (policy v{policy.version})",
                    chain,
                )


def _issue(step: PlanStep, code: str, message: str) -> CompileIssue:
    return CompileIssue(f"steps[{step.key}]", code, message)


def _is_loop_boundary(step: PlanStep) -> bool:
    # A loop head starts a new invocation ordinal, so reaching the same submit
    # again through it is a new effect, not a return to the old one.
    return step.checkpoint is not None and bool(step.checkpoint.cursor)


def validate_effect_pairs(steps: Iterable[PlanStep]) -> list[CompileIssue]:
    """Check the §7.5 pairing rules; return every violation (empty when valid)."""
    by_key = {s.key: s for s in steps}
    out: list[CompileIssue] = []
    for s in by_key.values():
        if s.kind in (StepKind.EFFECT_SUBMIT, StepKind.DEPENDENCY_WAIT) and any(
            t.target == s.key for t in s.transitions
        ):
            out.append(_issue(s, "effect.self_wait", f"{s.key} waits on or resumes itself"))
        if s.kind is StepKind.EFFECT_SUBMIT:
            if s.effect is None:
                out.append(_issue(s, "effect.missing_link", f"{s.key} declares no effect link"))
                continue
            comps = [
                c
                for c in by_key.values()
                if c.kind is StepKind.EFFECT_COMPLETION
                and c.effect is not None
                and c.effect.submit_step == s.key
            ]
            if len(comps) != 1 or comps[0].key != s.effect.completion_step:
                out.append(
                    _issue(
                        s,
                        "effect.completion_count",
                        f"{s.key} must have exactly one completion step, has {len(comps)}",
                    )
                )
            if [(t.kind, t.target) for t in s.transitions] != [
                (EdgeKind.WAIT, s.effect.completion_step)
            ]:
                out.append(
                    _issue(
                        s,
                        "effect.submit_edges",
                        f"{s.key} may only wait for {s.effect.completion_step}",
                    )
                )
        elif s.kind is StepKind.EFFECT_COMPLETION:
            sub = by_key.get(s.effect.submit_step) if s.effect is not None else None
            if (
                s.effect is None
                or sub is None
                or sub.kind is not StepKind.EFFECT_SUBMIT
                or sub.effect is None
                or sub.effect.completion_step != s.key
            ):
                out.append(
                    _issue(
                        s,
                        "effect.orphan_completion",
                        f"{s.key} has no matching submit/link identity",
                    )
                )
                continue
            if s.dependency is None or s.dependency.key != f"handoff:{sub.key}":
                out.append(
                    _issue(
                        s,
                        "effect.dependency_target",
                        f"{s.key} must depend on the receipt of {sub.key}",
                    )
                )
            seen: set[str] = set()
            todo = deque(t.target for t in s.transitions)
            while todo:
                k = todo.popleft()
                if k == sub.key:
                    out.append(_issue(s, "effect.return_edge", f"{s.key} can return to {sub.key}"))
                    break
                nxt = by_key.get(k)
                if k in seen or nxt is None or _is_loop_boundary(nxt):
                    continue
                seen.add(k)
                todo.extend(t.target for t in nxt.transitions)
    return sorted(out)
