"""Operator pause and resume of a Flow run (issue 14 item 5; §11, §18.2, §19). Pure.

``PauseRun`` and ``ResumeRun`` are fenced and audited like ``CancelRun``, but they are
**no §11 arrow**: the pause is an overlay (``flow_runs.operator_paused_at``) on the
canonical state, decided here and applied by :mod:`runtime_svc.kernel.store_operator`.

Semantics:

* **Pause** an active run (``Accepted``, ``Runnable``, ``Running``, ``Waiting``): set
  ``operator_paused_at``. Nothing else changes — in particular the root ``state_version``
  is *not* bumped (the conditional UPDATE compares it but leaves it), so a step already
  running keeps its claim fence and its commit, rollback or recovery stays legal and
  lands as usual. What changes is the claim: :func:`~runtime_svc.kernel.transitions.decide_claim`
  refuses a paused root (``paused``), its UPDATE carries ``operator_paused_at IS NULL``,
  and the candidate scans skip paused runs. So the step after the running one is
  committed ``Pending`` but not claimed; a wait that resolves while paused makes its step
  ``Pending`` / the root ``Runnable`` but it is not claimed; an expired lease is recovered
  to ``RetryScheduled`` but not re-claimed. Cancellation and delete still win over a
  pause (an operator can always stop a paused run). An active paused run projects as
  §18.2 ``Paused``. Pausing a paused run is a no-op answer (idempotent); a terminal run
  is refused ``run_terminal`` and a ``CancelRequested`` one ``run_cancelling``.
* **Resume**: clear ``operator_paused_at``; the run is claimable again at once if its
  step is due (its due time is kept, so a run paused for long is first in its lane —
  the eligible scan orders by due time). Resuming a run that is not paused is a no-op
  answer (idempotent), whatever its state.

* **Restart from a checkpoint** (``RestartFromCheckpoint``, :func:`decide_restart`): only
  a ``TerminalFailed`` V2 run, from one of its *own* checkpoints that was the input of a
  step execution. The root takes the operator-only arrow ``TerminalFailed -> Runnable``
  (:mod:`runtime_svc.kernel.tables`) and points at a **new** ``Pending`` execution of that
  step (next invocation ordinal, the checkpoint as its immutable input, due now); its
  terminal cause and completion time are cleared. Nothing old is rewritten or deleted:
  the failed step, every attempt and checkpoint keep their terminal facts and stay in
  the support read. Steps after the checkpoint run again — their business writes and
  effects are applied again, which is what the operator asks for — so the store refuses
  while an effect of the run has no known owner outcome. Refused: ``run_quarantined``
  (reconcile with ``RetryQuarantinedRun`` first), ``run_not_failed`` (any other state:
  an active run would need its in-flight step fenced — cancel it first; ``Succeeded`` /
  ``Cancelled`` are final), ``checkpoint_not_a_step_input`` (e.g. the output of the
  last step). A run paused before it failed stays paused after the restart.

All compare an optional caller ``expected_state_version`` with the locked root *and* in
the conditional UPDATE (``StateVersionMismatchError``), like ``CancelRun``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from runtime_svc.kernel.model import NewStep, RunRecord, StepRecord, Transition
from runtime_svc.kernel.patches import patch_root
from runtime_svc.kernel.states import (
    ACTIVE_RUN_STATES,
    TERMINAL_RUN_STATES,
    ExecutionOwner,
    RunState,
)

__all__ = [
    "OperatorNoChange",
    "OperatorRefused",
    "PauseChange",
    "Restart",
    "decide_pause",
    "decide_restart",
    "decide_resume",
]


@dataclass(frozen=True)
class PauseChange:
    """Set (``paused_at`` a time) or clear (``None``) the root's operator pause, fenced
    on the root's ``expected_version``, ``state`` and ``epoch`` and on the pause flag
    being currently ``not paused`` (pause) or ``paused`` (resume)."""

    flow_run_id: str
    expected_version: int
    state: RunState
    epoch: int
    paused_at: datetime | None


@dataclass(frozen=True)
class OperatorNoChange:
    """Already in the requested pause state: nothing is written (idempotent)."""

    reason: str


@dataclass(frozen=True)
class OperatorRefused:
    """The run cannot take the operation; ``reason`` is a stable code
    (``legacy_owned_run``, ``run_terminal``, ``run_cancelling``, ``deleted``)."""

    reason: str


def _refusal(root: RunRecord) -> OperatorRefused | None:
    if root.execution_owner is not ExecutionOwner.FLOW_RUNTIME_V2:
        return OperatorRefused("legacy_owned_run")
    if root.is_deleted:  # (``delete_requested_at`` alone is a cancellation's time)
        return OperatorRefused("deleted")
    return None


def decide_pause(
    root: RunRecord, now: datetime
) -> PauseChange | OperatorNoChange | OperatorRefused:
    """Pause ``root`` (see the module docstring)."""
    refused = _refusal(root)
    if refused is not None:
        return refused
    if root.state in TERMINAL_RUN_STATES:
        return OperatorRefused("run_terminal")
    if root.state not in ACTIVE_RUN_STATES:
        return OperatorRefused("run_cancelling")
    if root.operator_paused_at is not None:
        return OperatorNoChange("already_paused")
    return PauseChange(root.flow_run_id, root.state_version, root.state, root.ownership_epoch, now)


def decide_resume(root: RunRecord) -> PauseChange | OperatorNoChange | OperatorRefused:
    """Resume ``root`` (see the module docstring)."""
    refused = _refusal(root)
    if refused is not None:
        return refused
    if root.operator_paused_at is None:
        return OperatorNoChange("not_paused")
    return PauseChange(root.flow_run_id, root.state_version, root.state, root.ownership_epoch, None)


@dataclass(frozen=True)
class Restart:
    """Apply ``transition`` (root ``TerminalFailed -> Runnable``, new ``Pending`` step)."""

    transition: Transition
    step_execution_id: str
    source_step_execution_id: str


def decide_restart(
    root: RunRecord,
    checkpoint_id: str,
    source: StepRecord | None,
    *,
    new_step_execution_id: str,
    invocation_ordinal: int,
    now: datetime,
) -> Restart | OperatorRefused:
    """Restart ``root`` from ``checkpoint_id``, whose consumer was the step execution
    ``source`` (``None``: no step of the run took it as input). See the module docstring.
    """
    refused = _refusal(root)
    if refused is not None:
        return refused
    if root.state is RunState.QUARANTINED:
        return OperatorRefused("run_quarantined")
    if root.state is not RunState.TERMINAL_FAILED:
        return OperatorRefused("run_not_failed")
    if (
        source is None
        or source.flow_run_id != root.flow_run_id
        or source.input_checkpoint_id != checkpoint_id
    ):
        return OperatorRefused("checkpoint_not_a_step_input")
    run = patch_root(
        root,
        RunState.RUNNABLE,
        operator=True,
        expect_current_step=root.current_step_execution_id,
        current_step_execution_id=new_step_execution_id,
        current_checkpoint_id=checkpoint_id,
        current_element=source.plan_step_key,
        run_after=now,
        completed_at=None,
        terminal_cause_code=None,
    )
    step = NewStep(
        step_execution_id=new_step_execution_id,
        flow_run_id=root.flow_run_id,
        plan_step_key=source.plan_step_key,
        invocation_ordinal=invocation_ordinal,
        step_kind=source.step_kind,
        input_checkpoint_id=checkpoint_id,
        ownership_epoch=root.ownership_epoch,
        run_after=now,
        queue_class=source.queue_class,
    )
    transition = Transition(run=run, new_step=step)
    return Restart(transition, new_step_execution_id, source.step_execution_id)
