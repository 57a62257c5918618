"""Pure transition functions of durable waits (§14.2 step 6, §14.3, §11.1; STYLE 5).

Each function takes the rows a wait transition locked — root, waiting step, dependency
and (for a resolution) the consumed signal, in that §12 order — plus the database clock,
and returns a :class:`WaitTransition` (root/step patches checked against the §11 tables,
a dependency patch, a signal patch) or a :class:`NoChange` naming why nothing applies.
The store applies the patches as compare-and-swap UPDATEs whose row counts must be 1, so
resolution, expiry, cancellation and repair that race on one dependency serialize on the
root's version: exactly one wins and the losers re-read the terminal fact.

=====================  =====================================================================
function               arrows
=====================  =====================================================================
decide_resolution      dependency Pending→Resolved; signal Unmatched→Consumed (if any);
                       step Waiting→Pending; root Waiting→Runnable (§18.2 projection)
decide_expiry          fault path: dependency →Expired, step →Failed, successor →Pending,
                       root →Runnable on it; terminal: →Expired, →Failed, root
                       →TerminalFailed; quarantine: dependency, step, root →Quarantined
cancel_dependency      dependency Pending→Cancelled (inside the root cancellation)
decide_repair          a terminal dependency under a Waiting root: the root-first
                       finalizer of its outcome, without touching the dependency
=====================  =====================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from runtime_svc.kernel.decisions import NoChange, WaitExpired, WaitResolved
from runtime_svc.kernel.errors import IllegalTransitionError
from runtime_svc.kernel.model import LeaseFence, NewStep, RunRecord, StepRecord, Transition
from runtime_svc.kernel.patches import patch_root, patch_step
from runtime_svc.kernel.states import FailureClass, RunState, StepState
from runtime_svc.kernel.store_reads import Candidate
from runtime_svc.kernel.transitions_recovery import (
    decide_cancel,
    decide_resolve_wait,
    decide_wait_expired,
)
from runtime_svc.kernel.wait_model import (
    DependencyPatch,
    DependencyRecord,
    DependencyState,
    ExpiryPolicyCode,
    FaultSuccessor,
    SignalPatch,
    SignalRecord,
    SignalState,
    WorkScopeKey,
)
from services.digest import canonical_json
from services.invariants import InvariantError

__all__ = [
    "CAUSE_PRODUCER_DELETED",
    "CAUSE_PRODUCER_MISSING",
    "CAUSE_WAIT_EXPIRED",
    "WaitTransition",
    "cancel_dependency",
    "decide_expiry",
    "decide_repair",
    "decide_resolution",
    "scope_of",
]

#: The deadline passed (terminal failure and quarantine policies).
CAUSE_WAIT_EXPIRED = "dependency_expired"
#: The dependency's producer kind is not registered with this runtime (§10.5).
CAUSE_PRODUCER_MISSING = "dependency_producer_missing"
#: The producer's existence check failed (a watched record was deleted).
CAUSE_PRODUCER_DELETED = "dependency_producer_deleted"


@dataclass(frozen=True)
class WaitTransition:
    """Everything one wait transition writes, in §12 order: root, step (and a new
    successor step), then the dependency, then the signal.

    Attributes:
        outcome: ``resolved``, ``fault_path``, ``terminal_failure``, ``quarantined``,
            ``cancel_requested`` — what the run's wait ended in.
        cause_code: the run's safe terminal cause, when the run ended.
    """

    transition: Transition
    dependency: DependencyPatch | None
    signal: SignalPatch | None
    outcome: str
    cause_code: str | None = None
    #: Set by the store after a resolution committed: the resumed step as the claim
    #: candidate that transaction left (the versions it wrote), so a worker of this
    #: process claims it without a discovery read. Never compared by anything but the
    #: claim's own fence (a stale candidate loses the claim).
    resumed: Candidate | None = None
    #: Set by the store when the resolution's own transaction also claimed the resumed
    #: step and made it ``Running`` for a local worker (the pre-claimed wake,
    #: ``docs/adr/0007-pre-claimed-wake.md``): that worker's fence, valid once the
    #: transaction committed. The root is then ``Running``, not ``Runnable``.
    preclaimed: LeaseFence | None = None


def scope_of(root: RunRecord) -> WorkScopeKey:
    """The complete work scope of a run root."""
    return WorkScopeKey(
        root.org_id,
        root.app_installation_id,
        root.runtime_capability_id,
        root.runtime_work_binding_digest,
    )


def _waiting_on(root: RunRecord, step: StepRecord | None, dep: DependencyRecord) -> str | None:
    """Why ``root``/``step`` are not waiting on ``dep`` (``None``: they are)."""
    checks: list[tuple[bool, str]] = [
        (scope_of(root) != dep.scope, "scope_mismatch"),
        (dep.flow_run_id != root.flow_run_id, "other_run"),
        (step is None or step.step_execution_id != dep.step_execution_id, "not_waiting_step"),
        (root.current_step_execution_id != dep.step_execution_id, "not_current_step"),
        (root.is_deleted or root.delete_requested_at is not None, "deleted"),
        (root.state is not RunState.WAITING, "root_not_waiting"),
        (step is not None and step.state is not StepState.WAITING, "step_not_waiting"),
    ]
    return next((why for failed, why in checks if failed), None)


def _freed(now: datetime, receipt: Mapping[str, Any]) -> dict[str, Any]:
    # A terminal dependency leaves its active slot, so the step's next wait (never the
    # same step execution) is not blocked, and stops being probed.
    return {
        "active_slot": None,
        "next_probe_at": None,
        "resolved_at": now,
        "resolution_receipt": canonical_json(dict(receipt)).decode(),
        "updated_at": now,
    }


def _resume(root: RunRecord, step: StepRecord, now: datetime) -> Transition:
    # Step Waiting -> Pending with root Waiting -> Runnable (the kernel's one decision).
    resumed = decide_resolve_wait(root, step, now)
    if not isinstance(resumed, WaitResolved):  # the caller checked _waiting_on
        raise IllegalTransitionError("run", root.state.name, RunState.RUNNABLE.name)
    return resumed.transition


def decide_resolution(
    root: RunRecord,
    step: StepRecord | None,
    dep: DependencyRecord,
    signal: SignalRecord | None,
    now: datetime,
    *,
    receipt: Mapping[str, Any],
    wake_version: int | None = None,
) -> WaitTransition | NoChange:
    """§14.2 step 6: consume ``signal`` (when given) and resolve ``dep``; the waiting step
    becomes ``Pending`` and the root ``Runnable``, every version advancing together.

    A signal of another scope, producer or key, an already consumed one, or one whose
    wake version is not above the dependency's is refused (``NoChange``), as is a
    dependency that is no longer ``Pending`` or a root/step no longer waiting on it.
    """
    if dep.state is not DependencyState.PENDING:
        return NoChange(f"dependency_{dep.state.code.lower()}")
    reason = _waiting_on(root, step, dep)
    if reason is not None or step is None:
        return NoChange(reason or "not_waiting_step")
    signal_patch: SignalPatch | None = None
    values = _freed(now, receipt)
    if signal is not None:
        if (
            signal.scope != dep.scope
            or signal.producer_kind != dep.producer_kind
            or signal.producer_key != dep.producer_key
        ):
            return NoChange("signal_mismatch")
        if signal.state is not SignalState.UNMATCHED:
            return NoChange(f"signal_{signal.state.code.lower()}")
        version = signal.wake_version
        if version is not None and dep.wake_version is not None and version <= dep.wake_version:
            return NoChange("stale_signal")
        signal_patch = SignalPatch(
            signal.scope,
            signal.wake_signal_id,
            signal.state_version,
            SignalState.CONSUMED,
            {"dependency_id": dep.dependency_id, "consumed_at": now, "next_match_at": None},
        )
        values.update(
            wake_version=version,
            wake_token=signal.wake_token,
            wake_signal_id=signal.wake_signal_id,
        )
    elif wake_version is not None:
        values["wake_version"] = wake_version
    dep_patch = DependencyPatch(
        dep.dependency_id, dep.state_version, DependencyState.RESOLVED, values
    )
    return WaitTransition(_resume(root, step, now), dep_patch, signal_patch, "resolved")


def _fault_path(
    root: RunRecord, step: StepRecord, fault: FaultSuccessor, now: datetime
) -> Transition:
    if root.current_checkpoint_id is None:
        raise InvariantError("a waiting run without a current checkpoint")
    new_step = NewStep(
        step_execution_id=fault.step_execution_id,
        flow_run_id=root.flow_run_id,
        plan_step_key=fault.plan_step_key,
        invocation_ordinal=fault.invocation_ordinal,
        step_kind=fault.step_kind,
        # The wait's resume point is the fault path's input: nothing ran since.
        input_checkpoint_id=root.current_checkpoint_id,
        ownership_epoch=root.ownership_epoch,
        run_after=now,
        queue_class=fault.queue_class,
    )
    return Transition(
        run=patch_root(
            root,
            RunState.RUNNABLE,
            expect_current_step=step.step_execution_id,
            current_step_execution_id=fault.step_execution_id,
            current_element=fault.plan_step_key,
            run_after=now,
            paused_at=None,
        ),
        step=patch_step(step, StepState.FAILED, failure_class=FailureClass.TERMINAL),
        new_step=new_step,
    )


def _ended(
    root: RunRecord, step: StepRecord, now: datetime, cause: str, *, quarantine: bool
) -> Transition:
    # Terminal failure (Failed/TerminalFailed) or quarantine, with ``cause``.
    ended = decide_wait_expired(root, step, now, quarantine=quarantine, cause=cause)
    if not isinstance(ended, WaitExpired):  # the caller checked _waiting_on
        raise IllegalTransitionError("run", root.state.name, "ended")
    return ended.transition


def _ending(
    root: RunRecord,
    step: StepRecord,
    policy: ExpiryPolicyCode,
    now: datetime,
    cause: str,
    fault: FaultSuccessor | None,
) -> tuple[Transition, str, str | None]:
    """The root/step transition of an expiry under ``policy`` (a fault path without a
    resolvable successor, or with no resume checkpoint, quarantines: never a guess)."""
    if policy is ExpiryPolicyCode.FAULT_PATH and fault is not None and root.current_checkpoint_id:
        return _fault_path(root, step, fault, now), "fault_path", None
    if policy is ExpiryPolicyCode.TERMINAL_FAILURE:
        return _ended(root, step, now, cause, quarantine=False), "terminal_failure", cause
    return _ended(root, step, now, cause, quarantine=True), "quarantined", cause


def decide_expiry(
    root: RunRecord,
    step: StepRecord | None,
    dep: DependencyRecord,
    now: datetime,
    *,
    cause: str = CAUSE_WAIT_EXPIRED,
    fault: FaultSuccessor | None = None,
    quarantine: bool = False,
) -> WaitTransition | NoChange:
    """§14.3: apply the dependency's compiled expiry policy in one root-first transition.

    ``cause`` distinguishes a passed deadline from a deleted producer; ``quarantine``
    forces the quarantine outcome (a missing producer: §10.5). Only a dependency whose
    deadline has passed expires on ``CAUSE_WAIT_EXPIRED``.
    """
    if dep.state is not DependencyState.PENDING:
        return NoChange(f"dependency_{dep.state.code.lower()}")
    reason = _waiting_on(root, step, dep)
    if reason is not None or step is None:
        return NoChange(reason or "not_waiting_step")
    if cause == CAUSE_WAIT_EXPIRED and dep.deadline > now:
        return NoChange("not_due")
    policy = ExpiryPolicyCode.QUARANTINE if quarantine else dep.expiry_policy
    transition, outcome, run_cause = _ending(root, step, policy, now, cause, fault)
    to = DependencyState.QUARANTINED if outcome == "quarantined" else DependencyState.EXPIRED
    dep_patch = DependencyPatch(
        dep.dependency_id,
        dep.state_version,
        to,
        _freed(now, {"outcome": outcome, "cause": cause}),
    )
    return WaitTransition(transition, dep_patch, None, outcome, run_cause)


def cancel_dependency(dep: DependencyRecord, now: datetime) -> DependencyPatch | None:
    """The dependency side of a root cancellation (§11.1, §14.3 "cancellation"):
    ``Pending -> Cancelled``; ``None`` when it already ended."""
    if dep.state is not DependencyState.PENDING:
        return None
    return DependencyPatch(
        dep.dependency_id,
        dep.state_version,
        DependencyState.CANCELLED,
        _freed(now, {"outcome": "cancelled"}),
    )


def decide_repair(
    root: RunRecord,
    step: StepRecord | None,
    dep: DependencyRecord,
    now: datetime,
    *,
    fault: FaultSuccessor | None = None,
) -> WaitTransition | NoChange:
    """§14.3 repair: a terminal dependency paired with a ``Waiting`` root is invariant
    corruption; replay the root-first finalizer of the dependency's outcome (the
    dependency row itself is already terminal and is not rewritten)."""
    if dep.state is DependencyState.PENDING:
        return NoChange("dependency_pending")
    reason = _waiting_on(root, step, dep)
    if reason is not None or step is None:
        return NoChange(reason or "not_waiting_step")
    if dep.state is DependencyState.RESOLVED:
        return WaitTransition(_resume(root, step, now), None, None, "resolved")
    if dep.state is DependencyState.CANCELLED:
        cancel = decide_cancel(root, step, None, now, delete=False)
        if isinstance(cancel, NoChange):
            return cancel
        return WaitTransition(cancel.transition, None, None, "cancel_requested")
    policy = (
        ExpiryPolicyCode.QUARANTINE
        if dep.state is DependencyState.QUARANTINED
        else dep.expiry_policy
    )
    transition, outcome, cause = _ending(root, step, policy, now, CAUSE_WAIT_EXPIRED, fault)
    return WaitTransition(transition, None, None, outcome, cause)
