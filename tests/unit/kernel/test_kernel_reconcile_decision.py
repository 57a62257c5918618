"""``decide_reconcile`` (pure): which operator resolutions a quarantine allows."""

from __future__ import annotations

from datetime import timedelta

import pytest

from runtime_svc.kernel.model import AttemptRecord
from runtime_svc.kernel.reconcile import (
    RECONCILIATION_ARROWS,
    QuarantineEvidence,
    ReconcileDecision,
    ReconcileRefused,
    Resolution,
    decide_reconcile,
)
from runtime_svc.kernel.states import AttemptOutcome, RunState, StepState
from tests.unit.kernel.factories import ORG, T0, run, step

CLEAN = QuarantineEvidence(0, 0, 0)


def _attempt(outcome: AttemptOutcome = AttemptOutcome.COMMIT_UNKNOWN) -> AttemptRecord:
    return AttemptRecord(
        org_id=ORG,
        attempt_id="att_1",
        step_execution_id="step_1",
        attempt_number=1,
        lease_token_digest="d",
        ownership_epoch=1,
        root_state_version_at_claim=1,
        started_at=T0,
        finished_at=T0 + timedelta(seconds=1),
        outcome=outcome,
        failure_class=None,
        safe_error_code=None,
        retry_decision=None,
        retry_policy_digest="p",
        recovery_backoff_floor_ms=0,
        attempt_state_version=1,
        plan_digest="plan",
        lock_plan_digest="lock",
        trace_id=None,
    )


def _quarantined() -> tuple[object, object]:
    return (
        run(state=RunState.QUARANTINED, run_after=None),
        step(state=StepState.QUARANTINED, attempt_count=1),
    )


@pytest.mark.parametrize("resolution", list(Resolution))
def test_a_clean_commit_unknown_quarantine_can_be_retried_or_failed(
    resolution: Resolution,
) -> None:
    root, s = _quarantined()
    for outcome in (AttemptOutcome.COMMIT_UNKNOWN, AttemptOutcome.ROLLBACK_UNKNOWN):
        decision = decide_reconcile(
            root,  # type: ignore[arg-type]
            s,  # type: ignore[arg-type]
            _attempt(outcome),
            CLEAN,
            resolution,
            max_attempts=3,
        )
        assert isinstance(decision, ReconcileDecision)
        assert (decision.run_state, decision.step_state) == RECONCILIATION_ARROWS[resolution]
        assert decision.attempt_id == "att_1"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"root": run(state=RunState.RUNNABLE)}, "not_quarantined"),
        ({"root": run(state=RunState.QUARANTINED, is_deleted=True)}, "deleted"),
        ({"step": step(state=StepState.FAILED, attempt_count=1)}, "not_quarantined"),
        ({"attempt": _attempt(AttemptOutcome.FENCED)}, "not_commit_unknown"),
        ({"attempt": None}, "not_commit_unknown"),
        ({"evidence": QuarantineEvidence(1, 0, 0)}, "marker_shows_commit"),
        ({"evidence": QuarantineEvidence(0, 1, 0)}, "marker_shows_commit"),
        ({"evidence": QuarantineEvidence(0, 0, 1)}, "marker_shows_commit"),
        ({"max_attempts": 1}, "attempt_budget_spent"),
    ],
)
def test_refusals(change: dict[str, object], reason: str) -> None:
    root, s = _quarantined()
    args: dict[str, object] = {
        "root": root,
        "step": s,
        "attempt": _attempt(),
        "evidence": CLEAN,
        "max_attempts": 3,
        **change,
    }
    decision = decide_reconcile(
        args["root"],  # type: ignore[arg-type]
        args["step"],  # type: ignore[arg-type]
        args["attempt"],  # type: ignore[arg-type]
        args["evidence"],  # type: ignore[arg-type]
        Resolution.RETRY,
        max_attempts=args["max_attempts"],  # type: ignore[arg-type]
    )
    assert decision == ReconcileRefused(reason)


def test_an_exhausted_budget_may_still_be_failed() -> None:
    root, s = _quarantined()
    decision = decide_reconcile(
        root,  # type: ignore[arg-type]
        s,  # type: ignore[arg-type]
        _attempt(),
        CLEAN,
        Resolution.FAIL,
        max_attempts=1,
    )
    assert isinstance(decision, ReconcileDecision)
    assert decision.run_state is RunState.TERMINAL_FAILED
