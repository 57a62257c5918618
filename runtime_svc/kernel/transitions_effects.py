"""Pure transitions of an effect handoff's convergence (§15.4, §10.1, §11.1; STYLE 5).

Each function takes the rows its caller locked in the §12 order — root, the
``EffectCompletion`` step, the completion dependency and (for a receipt) the consumed
signal — and returns a :class:`~runtime_svc.kernel.transitions_waits.WaitTransition` or a
:class:`~runtime_svc.kernel.decisions.NoChange` naming why nothing applies. The caller
(``runtime_svc.effects``) applies it with the kernel's fenced updates, and — for the
outbox finalizer — makes the outbox message terminal *last* in the same transaction.

=============================  ==============================================================
function                       what it converges
=============================  ==============================================================
decide_handoff_rejected        owner's durable ``Rejected`` receipt: a ``Waiting`` root takes
                               the dependency's compiled expiry policy (fault path, terminal
                               failure, quarantine); a cancelling root completes its
                               cancellation (dependency, step, root ``Cancelled``)
decide_handoff_unknown         ``AcceptanceUnknown``: dependency, step and root
                               ``Quarantined`` (a cancelling root too — never "cancelled")
decide_cancelled_receipt       a cancelling root whose handoff the owner accepted: the
                               receipt is consumed and recorded on the dependency, step and
                               root end ``Cancelled`` with a cause saying the effect happened
                               (``OUTCOME_UNKNOWN``: ``Quarantined``)
decide_cancelled_unreported    a cancelling root whose accepted handoff never reported by the
                               dependency's deadline: quarantined (never "cancelled")
=============================  ==============================================================

Cancellation never pretends an accepted effect was rolled back (§10.1): the dependency
keeps the owner's receipt, and the root's terminal cause names what happened.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from runtime_svc.kernel.decisions import NoChange
from runtime_svc.kernel.model import RunRecord, StepRecord, Transition
from runtime_svc.kernel.patches import CAUSE_CANCELLED, NO_LEASE, patch_root, patch_step
from runtime_svc.kernel.states import FailureClass, RunState, StepState
from runtime_svc.kernel.transitions_waits import WaitTransition, decide_expiry, scope_of
from runtime_svc.kernel.wait_model import (
    DependencyPatch,
    DependencyRecord,
    DependencyState,
    FaultSuccessor,
    SignalPatch,
    SignalRecord,
    SignalState,
)
from services.digest import canonical_json

__all__ = [
    "CAUSE_ACCEPTANCE_UNKNOWN",
    "CAUSE_CANCELLED_AFTER_EFFECT",
    "CAUSE_EFFECT_FAILED",
    "CAUSE_EFFECT_OUTCOME_UNKNOWN",
    "CAUSE_EFFECT_RECEIPT_INVALID",
    "CAUSE_EFFECT_UNREPORTED",
    "CAUSE_HANDOFF_REJECTED",
    "decide_cancelled_receipt",
    "decide_cancelled_unreported",
    "decide_handoff_rejected",
    "decide_handoff_unknown",
]

#: The owner durably rejected the handoff (no command exists or can exist, §15.4).
CAUSE_HANDOFF_REJECTED = "effect_handoff_rejected"
#: Neither acceptance nor rejection could be proven (§15.4 ``AcceptanceUnknown``).
CAUSE_ACCEPTANCE_UNKNOWN = "effect_acceptance_unknown"
#: The owner reported ``FAILED`` and the effect has no fault path.
CAUSE_EFFECT_FAILED = "effect_failed"
#: The owner reported ``OUTCOME_UNKNOWN`` (§15.3) under a quarantine policy.
CAUSE_EFFECT_OUTCOME_UNKNOWN = "effect_outcome_unknown"
#: The completion receipt or the effect link does not validate (§15.2).
CAUSE_EFFECT_RECEIPT_INVALID = "effect_receipt_invalid"
#: A cancelled run: the owner had accepted the effect and it completed (§10.1).
CAUSE_CANCELLED_AFTER_EFFECT = "cancelled_after_effect"
#: A cancelled run whose accepted effect never reported before the deadline.
CAUSE_EFFECT_UNREPORTED = "effect_outcome_unreported"


def _receipt_values(now: datetime, receipt: Mapping[str, Any]) -> dict[str, Any]:
    # A terminal dependency leaves its active slot and stops being probed (as in waits).
    return {
        "active_slot": None,
        "next_probe_at": None,
        "resolved_at": now,
        "resolution_receipt": canonical_json(dict(receipt)).decode(),
        "updated_at": now,
    }


def _cancelling_on(root: RunRecord, step: StepRecord | None, dep: DependencyRecord) -> str | None:
    """Why ``root``/``step`` are not a cancelling run on ``dep`` (``None``: they are)."""
    checks: list[tuple[bool, str]] = [
        (scope_of(root) != dep.scope, "scope_mismatch"),
        (dep.flow_run_id != root.flow_run_id, "other_run"),
        (step is None or step.step_execution_id != dep.step_execution_id, "not_waiting_step"),
        (root.current_step_execution_id != dep.step_execution_id, "not_current_step"),
        (root.state is not RunState.CANCEL_REQUESTED, "root_not_cancelling"),
        (step is not None and step.state is not StepState.CANCEL_REQUESTED, "step_not_cancelling"),
    ]
    return next((why for failed, why in checks if failed), None)


def _end_cancelled(
    root: RunRecord, step: StepRecord, now: datetime, cause: str, *, quarantine: bool
) -> Transition:
    run_to = RunState.QUARANTINED if quarantine else RunState.CANCELLED
    step_to = StepState.QUARANTINED if quarantine else StepState.CANCELLED
    failure = FailureClass.AMBIGUOUS if quarantine else FailureClass.CANCELLED
    return Transition(
        run=patch_root(
            root,
            run_to,
            require_live=False,
            completed_at=now,
            terminal_cause_code=cause,
            run_after=None,
        ),
        step=patch_step(step, step_to, failure_class=failure, **NO_LEASE),
    )


def decide_handoff_rejected(
    root: RunRecord,
    step: StepRecord | None,
    dep: DependencyRecord,
    now: datetime,
    *,
    fault: FaultSuccessor | None = None,
) -> WaitTransition | NoChange:
    """§15.4 ``Rejected``: the dependency's compiled expiry policy for a waiting run, or
    the completion of a cancellation (§10.1: the pending handoff is cancelled only now)."""
    if dep.state is not DependencyState.PENDING:
        return NoChange(f"dependency_{dep.state.code.lower()}")
    if root.state is RunState.CANCEL_REQUESTED:
        reason = _cancelling_on(root, step, dep)
        if reason is not None or step is None:
            return NoChange(reason or "not_waiting_step")
        receipt = {"outcome": "cancelled", "handoff": "rejected"}
        dep_patch = DependencyPatch(
            dep.dependency_id,
            dep.state_version,
            DependencyState.CANCELLED,
            _receipt_values(now, receipt),
        )
        transition = _end_cancelled(root, step, now, CAUSE_CANCELLED, quarantine=False)
        return WaitTransition(transition, dep_patch, None, "cancelled", CAUSE_CANCELLED)
    return decide_expiry(root, step, dep, now, cause=CAUSE_HANDOFF_REJECTED, fault=fault)


def decide_handoff_unknown(
    root: RunRecord, step: StepRecord | None, dep: DependencyRecord, now: datetime
) -> WaitTransition | NoChange:
    """§15.4 ``AcceptanceUnknown``: quarantine dependency, step and root — whether the
    run waits or is being cancelled (an unknown receipt is never a cancellation)."""
    if dep.state is not DependencyState.PENDING:
        return NoChange(f"dependency_{dep.state.code.lower()}")
    if root.state is RunState.CANCEL_REQUESTED:
        return _cancel_quarantine(root, step, dep, now, CAUSE_ACCEPTANCE_UNKNOWN)
    return decide_expiry(
        root, step, dep, now, cause=CAUSE_ACCEPTANCE_UNKNOWN, fault=None, quarantine=True
    )


def _cancel_quarantine(
    root: RunRecord, step: StepRecord | None, dep: DependencyRecord, now: datetime, cause: str
) -> WaitTransition | NoChange:
    reason = _cancelling_on(root, step, dep)
    if reason is not None or step is None:
        return NoChange(reason or "not_waiting_step")
    dep_patch = DependencyPatch(
        dep.dependency_id,
        dep.state_version,
        DependencyState.QUARANTINED,
        _receipt_values(now, {"outcome": "quarantined", "cause": cause}),
    )
    transition = _end_cancelled(root, step, now, cause, quarantine=True)
    return WaitTransition(transition, dep_patch, None, "quarantined", cause)


def decide_cancelled_receipt(
    root: RunRecord,
    step: StepRecord | None,
    dep: DependencyRecord,
    signal: SignalRecord,
    now: datetime,
    *,
    outcome: str,
    receipt: Mapping[str, Any],
) -> WaitTransition | NoChange:
    """A cancelling run's accepted handoff reported (§10.1 "an accepted receipt continues
    owner outcome tracking"): consume the receipt onto the dependency; the run ends
    ``Cancelled`` — with :data:`CAUSE_CANCELLED_AFTER_EFFECT` when the effect happened —
    or ``Quarantined`` for ``OUTCOME_UNKNOWN``.

    Args:
        outcome: the receipt's validated outcome (``SUCCEEDED``/``FAILED``/``OUTCOME_UNKNOWN``).
        receipt: what the dependency records (command id, outcome version, outcome, …).
    """
    if dep.state is not DependencyState.PENDING:
        return NoChange(f"dependency_{dep.state.code.lower()}")
    reason = _cancelling_on(root, step, dep)
    if reason is not None or step is None:
        return NoChange(reason or "not_waiting_step")
    if (
        signal.scope != dep.scope
        or signal.producer_kind != dep.producer_kind
        or signal.producer_key != dep.producer_key
    ):
        return NoChange("signal_mismatch")
    if signal.state is not SignalState.UNMATCHED:
        return NoChange(f"signal_{signal.state.code.lower()}")
    values = _receipt_values(now, receipt)
    values.update(
        wake_version=signal.wake_version,
        wake_token=signal.wake_token,
        wake_signal_id=signal.wake_signal_id,
    )
    dep_patch = DependencyPatch(
        dep.dependency_id, dep.state_version, DependencyState.RESOLVED, values
    )
    signal_patch = SignalPatch(
        signal.scope,
        signal.wake_signal_id,
        signal.state_version,
        SignalState.CONSUMED,
        {"dependency_id": dep.dependency_id, "consumed_at": now, "next_match_at": None},
    )
    if outcome == "OUTCOME_UNKNOWN":
        cause, quarantine = CAUSE_EFFECT_OUTCOME_UNKNOWN, True
    elif outcome == "SUCCEEDED":
        cause, quarantine = CAUSE_CANCELLED_AFTER_EFFECT, False
    else:
        cause, quarantine = CAUSE_CANCELLED, False
    transition = _end_cancelled(root, step, now, cause, quarantine=quarantine)
    ended = "quarantined" if quarantine else "cancelled"
    return WaitTransition(transition, dep_patch, signal_patch, ended, cause)


def decide_cancelled_unreported(
    root: RunRecord, step: StepRecord | None, dep: DependencyRecord, now: datetime
) -> WaitTransition | NoChange:
    """A cancelling run whose accepted effect never reported by the dependency's deadline:
    the outcome is unknown to the Flow, so dependency, step and root are quarantined."""
    if dep.state is not DependencyState.PENDING:
        return NoChange(f"dependency_{dep.state.code.lower()}")
    if dep.deadline > now:
        return NoChange("not_due")
    return _cancel_quarantine(root, step, dep, now, CAUSE_EFFECT_UNREPORTED)
