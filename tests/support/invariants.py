"""Database invariants the soak checkers assert (issue 10, item 4): every run ends terminal
or quarantined, or still has a future transition that some process will make.

A non-terminal run is *stranded* when nothing can ever move it:

* ``Runnable`` — its current step must be claimable (``Pending``/``RetryScheduled``) with
  a due time; a step whose attempt budget is spent under the policy in force is claimed
  into a terminal failure, so after a drain of due work none may remain;
* ``Running`` — its current step must hold a lease with a deadline (the worker commits or
  lease recovery fences it when the deadline passes);
* ``CancelRequested`` — the cancellation cleanup sweep completes it;
* ``Waiting`` — its current step must be ``Waiting`` on a ``Pending`` dependency (which
  resolves or expires at its deadline);
* ``Accepted`` — nothing admits it any more: always stranded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["stranded_runs"]

_TERMINAL = frozenset({"Succeeded", "TerminalFailed", "Quarantined", "Cancelled"})
_CLAIMABLE = frozenset({"Pending", "RetryScheduled"})
_LEASED = frozenset({"Claimed", "Running"})


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
        if drained and step["attempt_count"] >= max_attempts:
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
