"""The exactly-once invariant checker of the soaks (worker soak, cluster soak): what the
database must look like after any mix of claims, commits, lease recoveries, kills and
cancellations of Durable Orchestration runs of one org.

* root and current step never diverge (§18.2); every run is terminal;
* at most one ``Committed`` attempt per step, and every ``Succeeded`` step has one;
* every business event belongs to a ``Committed`` attempt of its own step, one per step;
* a terminal attempt outcome is never rewritten (:class:`TerminalAttempts` snapshots).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import RunState, StepState
from runtime_svc.kernel.tables import root_step_consistent
from runtime_svc.schema import business_events, flow_runs, flow_step_attempts, flow_step_executions
from tests.integration.kernel.helpers import rows

__all__ = ["TERMINAL_OUTCOMES", "SoakSummary", "TerminalAttempts", "check_exactly_once"]

TERMINAL_OUTCOMES = frozenset(
    {
        "Committed",
        "RolledBack",
        "CommitUnknown",
        "RollbackUnknown",
        "Fenced",
        "Cancelled",
        "Abandoned",
        "PreTransactionFailed",
    }
)
_TERMINAL_RUNS = frozenset(
    {RunState.SUCCEEDED, RunState.TERMINAL_FAILED, RunState.QUARANTINED, RunState.CANCELLED}
)


@dataclass
class TerminalAttempts:
    """Snapshots of terminal attempts; a later change of one is a rewrite."""

    seen: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    async def snapshot(self, engine: AsyncEngine, org: str) -> None:
        for a in await rows(engine, flow_step_attempts, org_id=org):
            if a["transaction_outcome"] in TERMINAL_OUTCOMES:
                now = (a["transaction_outcome"], a["attempt_state_version"], a["finished_at"])
                before = self.seen.setdefault(a["attempt_id"], now)
                assert before == now, (
                    f"terminal attempt {a['attempt_id']} rewritten: {before} -> {now}"
                )


@dataclass(frozen=True)
class SoakSummary:
    """What the checker read (for the test's own further assertions)."""

    runs: dict[str, dict[str, Any]]
    steps: dict[str, dict[str, Any]]
    attempts: dict[str, dict[str, Any]]
    events: list[dict[str, Any]]

    def states(self) -> Counter[RunState]:
        return Counter(RunState.from_code(r["runtime_state"]) for r in self.runs.values())


async def check_exactly_once(
    engine: AsyncEngine,
    org: str,
    *,
    expected_runs: Iterable[str],
    cancelled: Iterable[str] = (),
    terminal: TerminalAttempts | None = None,
) -> SoakSummary:
    """Assert the invariants of the module docstring over ``org``; runs not in
    ``cancelled`` must have ``Succeeded``."""
    runs = {r["flow_run_id"]: r for r in await rows(engine, flow_runs, org_id=org)}
    steps = {
        s["step_execution_id"]: s for s in await rows(engine, flow_step_executions, org_id=org)
    }
    attempts = {a["attempt_id"]: a for a in await rows(engine, flow_step_attempts, org_id=org)}
    events = await rows(engine, business_events, org_id=org)
    assert set(runs) == set(expected_runs)
    may_cancel = set(cancelled)

    for run in runs.values():
        state = RunState.from_code(run["runtime_state"])
        current = steps.get(run["current_step_execution_id"])
        step_state = None if current is None else StepState.from_code(current["state"])
        assert root_step_consistent(state, step_state), (run, current)
        assert state in _TERMINAL_RUNS, run
        if run["flow_run_id"] not in may_cancel:
            assert state is RunState.SUCCEEDED, run
    committed = Counter(
        a["step_execution_id"] for a in attempts.values() if a["transaction_outcome"] == "Committed"
    )
    assert all(n == 1 for n in committed.values()), committed
    for s in steps.values():
        if s["state"] == "Succeeded":
            assert committed[s["step_execution_id"]] == 1, s
    per_step = Counter(e["step_execution_id"] for e in events)
    for e in events:
        attempt = attempts[e["attempt_id"]]
        assert attempt["transaction_outcome"] == "Committed", (e, attempt)
        assert attempt["step_execution_id"] == e["step_execution_id"]
    assert all(n == 1 for n in per_step.values()), per_step
    if terminal is not None:
        await terminal.snapshot(engine, org)
    return SoakSummary(runs, steps, attempts, events)
