"""The soak checkers' "no run can never finish" invariant (``tests/support/invariants``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from tests.support.invariants import stranded_runs

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _run(state: str) -> dict[str, Any]:
    return {"flow_run_id": "r", "runtime_state": state, "current_step_execution_id": "s"}


def _step(state: str, **kw: Any) -> dict[str, Any]:
    row = {
        "step_execution_id": "s",
        "state": state,
        "run_after": NOW,
        "attempt_count": 0,
        "lease_until": None,
    }
    row.update(kw)
    return row


@pytest.mark.parametrize(
    ("run", "step", "deps", "drained", "why"),
    [
        ("Runnable", _step("Pending"), [], True, None),
        ("Runnable", _step("RetryScheduled", attempt_count=1), [], True, None),
        ("Runnable", _step("Pending", run_after=None), [], False, "no_due_time"),
        ("Runnable", _step("RetryScheduled", attempt_count=3), [], False, None),
        ("Runnable", _step("RetryScheduled", attempt_count=3), [], True, "attempt_budget_spent"),
        # A step resumed after its wait is Pending: claimable whatever its attempt count.
        ("Runnable", _step("Pending", attempt_count=3), [], True, None),
        ("Runnable", _step("Waiting"), [], False, "runnable_with_Waiting_step"),
        ("Running", _step("Running", lease_until=NOW), [], False, None),
        ("Running", _step("Running"), [], False, "running_without_lease"),
        ("Running", _step("Pending"), [], False, "running_without_lease"),
        (
            "Waiting",
            _step("Waiting"),
            [{"step_execution_id": "s", "state": "Pending"}],
            False,
            None,
        ),
        ("Waiting", _step("Waiting"), [], False, "waiting_without_pending_dependency"),
        ("Accepted", _step("Pending"), [], False, "accepted_never_admitted"),
        ("CancelRequested", _step("CancelRequested"), [], True, None),
        ("TerminalFailed", _step("Failed"), [], True, None),
    ],
)
def test_stranded_runs(
    run: str, step: dict[str, Any], deps: list[dict[str, Any]], drained: bool, why: str | None
) -> None:
    found = stranded_runs(
        [_run(run)], {"s": step}, max_attempts=3, drained=drained, dependencies=deps
    )
    assert found == ([] if why is None else [("r", why)])


def test_a_paused_run_is_idle_not_stranded_but_still_structurally_checked() -> None:
    paused = {**_run("Runnable"), "operator_paused_at": NOW}
    spent = _step("RetryScheduled", attempt_count=3)
    assert stranded_runs([paused], {"s": spent}, max_attempts=3, drained=True) == []
    assert stranded_runs([paused], {"s": _step("Pending", run_after=None)}, max_attempts=3) == []
    assert stranded_runs([paused], {"s": _step("Waiting")}, max_attempts=3) == [
        ("r", "runnable_with_Waiting_step")
    ]
    unpaused = _run("Runnable")
    assert stranded_runs([unpaused], {"s": spent}, max_attempts=3, drained=True) == [
        ("r", "attempt_budget_spent")
    ]
