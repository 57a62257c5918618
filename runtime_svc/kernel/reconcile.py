"""Operator reconciliation of a commit-unknown quarantine (pure).

A worker whose COMMIT (or ROLLBACK) outcome was lost quarantines attempt, step and root
(§5.2.6: "commit-unknown … are terminal or quarantined outcomes; never blind retries").
§11.3 leaves what comes next to "quarantine or a dedicated reconciliation workflow";
this module is that workflow's decision, taken by an operator after reading the marker:

1. **Read the marker** the lost transaction would have written — a ``Committed``
   attempt of the step, an output checkpoint created by the quarantined attempt,
   business events written by it (:class:`QuarantineEvidence`). By construction none can
   exist: the quarantine's own root/step/attempt compare-and-swap would have failed
   against a commit that landed, and a commit arriving later fails its fence. A marker
   that does show a commit is refused (the run needs support, not a retry).
2. **Decide** (:class:`Resolution`): ``retry`` — the step becomes ``RetryScheduled``
   (due now) and the root ``Runnable``; the next claim starts a new attempt from the
   same immutable input checkpoint, within the attempt budget — or ``fail`` — step
   ``Failed``, root ``TerminalFailed``.

For every automatic path ``Quarantined`` stays terminal (:mod:`~runtime_svc.kernel.tables`);
:data:`RECONCILIATION_ARROWS` are the only exits, taken only by
:mod:`~runtime_svc.kernel.store_reconcile` on an explicit, audited operator decision.
The quarantined attempt itself is never rewritten: its ``CommitUnknown`` /
``RollbackUnknown`` outcome stays the record of what happened.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from runtime_svc.kernel.model import AttemptRecord, RunRecord, StepRecord
from runtime_svc.kernel.states import AttemptOutcome, RunState, StepState

__all__ = [
    "CAUSE_QUARANTINE_FAILED",
    "RECONCILIATION_ARROWS",
    "QuarantineEvidence",
    "ReconcileDecision",
    "ReconcileRefused",
    "Resolution",
    "decide_reconcile",
]

#: Terminal cause code of a run an operator failed after reconciliation.
CAUSE_QUARANTINE_FAILED = "quarantine_resolved_failed"

_UNKNOWN = frozenset({AttemptOutcome.COMMIT_UNKNOWN, AttemptOutcome.ROLLBACK_UNKNOWN})


class Resolution(StrEnum):
    """The operator's decision for a reconciled quarantine."""

    RETRY = "retry"
    FAIL = "fail"


#: The only ways out of ``Quarantined`` (root, step), by resolution.
RECONCILIATION_ARROWS: dict[Resolution, tuple[RunState, StepState]] = {
    Resolution.RETRY: (RunState.RUNNABLE, StepState.RETRY_SCHEDULED),
    Resolution.FAIL: (RunState.TERMINAL_FAILED, StepState.FAILED),
}


@dataclass(frozen=True)
class QuarantineEvidence:
    """What the marker read found for the quarantined attempt."""

    committed_attempts: int
    checkpoints_by_attempt: int
    business_events_by_attempt: int

    @property
    def shows_commit(self) -> bool:
        return bool(
            self.committed_attempts
            or self.checkpoints_by_attempt
            or self.business_events_by_attempt
        )


@dataclass(frozen=True)
class ReconcileDecision:
    """Apply: root ``Quarantined -> run_state``, step ``Quarantined -> step_state``."""

    resolution: Resolution
    run_state: RunState
    step_state: StepState
    attempt_id: str


@dataclass(frozen=True)
class ReconcileRefused:
    """Nothing may change; ``reason`` is a stable code."""

    reason: str


def decide_reconcile(
    root: RunRecord,
    step: StepRecord | None,
    attempt: AttemptRecord | None,
    evidence: QuarantineEvidence | None,
    resolution: Resolution,
    *,
    max_attempts: int,
) -> ReconcileDecision | ReconcileRefused:
    """Whether ``resolution`` may be applied to the quarantined run (see module docstring).

    Refusal codes: ``not_quarantined``, ``deleted``, ``not_commit_unknown`` (a quarantine
    of another cause, e.g. a dependency's), ``marker_shows_commit``,
    ``attempt_budget_spent`` (retry only).
    """
    if root.state is not RunState.QUARANTINED:
        return ReconcileRefused("not_quarantined")
    if root.is_deleted or root.delete_requested_at is not None:
        return ReconcileRefused("deleted")
    if (
        step is None
        or step.state is not StepState.QUARANTINED
        or step.step_execution_id != root.current_step_execution_id
    ):
        return ReconcileRefused("not_quarantined")
    if attempt is None or attempt.outcome not in _UNKNOWN or evidence is None:
        return ReconcileRefused("not_commit_unknown")
    if evidence.shows_commit:
        return ReconcileRefused("marker_shows_commit")
    if resolution is Resolution.RETRY and step.attempt_count >= max_attempts:
        return ReconcileRefused("attempt_budget_spent")
    run_state, step_state = RECONCILIATION_ARROWS[resolution]
    return ReconcileDecision(resolution, run_state, step_state, attempt.attempt_id)
