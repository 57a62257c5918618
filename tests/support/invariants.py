"""The invariant checkers of the soaks (kernel soak, worker soak, cluster soak).

**Exactly once** (:func:`check_exactly_once`): what the database must look like after any
mix of claims, commits, lease recoveries, kills and cancellations of Durable Orchestration
runs of one org.

* root and current step never diverge (§18.2); every run is terminal;
* at most one ``Committed`` attempt per step, and every ``Succeeded`` step has one;
* every business event belongs to a ``Committed`` attempt of its own step, one per step;
* a terminal attempt outcome is never rewritten (:class:`TerminalAttempts` snapshots).

**No stranded run** (:func:`stranded_runs`, pure; issue 10, item 4): every run ends
terminal or quarantined, or still has a future transition that some process will make.
A non-terminal run is *stranded* when nothing can ever move it:

* ``Runnable`` — its current step must be claimable (``Pending``/``RetryScheduled``) with
  a due time; a retry whose attempt budget is spent under the policy in force is claimed
  into a terminal failure, so after a drain of due work none may remain (a ``Pending``
  step — also one resumed after its wait — is claimable whatever its attempt count);
* ``Running`` — its current step must hold a lease with a deadline (the worker commits or
  lease recovery fences it when the deadline passes);
* ``CancelRequested`` — the cancellation cleanup sweep completes it;
* ``Waiting`` — its current step must be ``Waiting`` on a ``Pending`` dependency (which
  resolves or expires at its deadline);
* ``Accepted`` — nothing admits it any more: always stranded.

An operator-paused run (``operator_paused_at``, ``PauseRun``) is legitimately idle: its
structure is still checked (root and current step as above), but not that some process
will claim it — the operator's ``ResumeRun`` is its future transition.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import RunState, StepState
from runtime_svc.kernel.tables import root_step_consistent
from runtime_svc.schema import business_events, flow_runs, flow_step_attempts, flow_step_executions
from tests.integration.kernel.helpers import rows

__all__ = [
    "TERMINAL_OUTCOMES",
    "SoakSummary",
    "TerminalAttempts",
    "check_exactly_once",
    "stranded_runs",
]

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


# --- stranded runs ---------------------------------------------------------------------

_TERMINAL = frozenset(s.code for s in _TERMINAL_RUNS)
_CLAIMABLE = frozenset({"Pending", "RetryScheduled"})
_LEASED = frozenset({"Claimed", "Running"})
#: Reasons that only say "no process will claim it" — expected of a paused run.
_IDLE_WHILE_PAUSED = frozenset({"no_due_time", "attempt_budget_spent"})


def stranded_runs(
    runs: Iterable[Mapping[str, Any]],
    steps: Mapping[str, Mapping[str, Any]],
    *,
    max_attempts: int,
    drained: bool = False,
    dependencies: Iterable[Mapping[str, Any]] = (),
) -> list[tuple[str, str]]:
    """``(flow_run_id, why)`` of every stranded run (see the module docstring).

    Args:
        runs: ``flow_runs`` rows.
        steps: ``flow_step_executions`` rows by step id.
        max_attempts: the attempt budget of the policy in force.
        drained: every due candidate was offered to a claim since the policy took
            effect, so a ``Runnable`` step with a spent budget is stranded, not pending
            its terminal claim.
        dependencies: ``flow_dependencies`` rows (a ``Waiting`` run needs a pending one).
    """
    pending_deps = {d["step_execution_id"] for d in dependencies if d.get("state") == "Pending"}
    out: list[tuple[str, str]] = []
    for run in runs:
        state = run["runtime_state"]
        if state in _TERMINAL or state == "CancelRequested":
            continue
        step = steps.get(run["current_step_execution_id"] or "")
        why = _why(state, step, pending_deps, max_attempts, drained)
        if why in _IDLE_WHILE_PAUSED and run.get("operator_paused_at") is not None:
            why = None
        if why is not None:
            out.append((run["flow_run_id"], why))
    return out


def _why(
    state: str,
    step: Mapping[str, Any] | None,
    pending_deps: set[str],
    max_attempts: int,
    drained: bool,
) -> str | None:
    if state == "Accepted":
        return "accepted_never_admitted"
    if step is None:
        return "no_current_step"
    if state == "Runnable":
        if step["state"] not in _CLAIMABLE:
            return f"runnable_with_{step['state']}_step"
        if step["run_after"] is None:
            return "no_due_time"
        # Only a retry needs budget left (a resumed or first Pending step is claimable).
        retry = step["state"] == "RetryScheduled"
        if drained and retry and step["attempt_count"] >= max_attempts:
            return "attempt_budget_spent"
        return None
    if state == "Running":
        if step["state"] not in _LEASED or step["lease_until"] is None:
            return "running_without_lease"
        return None
    if state == "Waiting":
        if step["state"] != "Waiting" or step["step_execution_id"] not in pending_deps:
            return "waiting_without_pending_dependency"
        return None
    return f"unknown_state_{state}"
