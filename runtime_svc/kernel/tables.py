"""The §11 state machines as data, the one transition guard, and the §18.2 projection.

Every arrow of §11.1 (FlowRun), §11.2 (FlowStepExecution) and §11.3 (FlowStepAttempt)
is one entry below; :func:`check_transition` is the only place that says whether a
state change is legal, and it raises :class:`~runtime_svc.kernel.errors.TerminalStateError`
for any change out of a terminal state/outcome, so a terminal fact can never be
overwritten. Pure.

Documented extensions of §11 (every run must end terminal or quarantined, never sit
non-terminal with no transition left, issue 10 item 4):

* ``Claimed -> Failed`` (§11.2). §12.3 requires that "repeated lease expiry becomes a
  terminal policy signal, not infinite churn", but §11.2 only lets a step fail from
  ``Running`` or ``Waiting``; a worker that keeps dying between claim and
  ``Claimed -> Running`` would otherwise cycle ``Claimed -> RetryScheduled`` forever.
  Recovery uses the extension only when the lease-expiry or attempt budget is spent.
* ``RetryScheduled -> Failed`` (§11.2) with root ``Runnable -> TerminalFailed`` (§11.1).
  A due retry whose attempt budget is already spent — the retry policy was lowered after
  it was scheduled — can never be claimed again; the claim that finds it ends the step
  and the run (``retry_exhausted``) in the same root→step transaction instead of leaving
  it ``Runnable`` and unclaimable for ever. (A ``Pending`` step — a first execution or a
  step resumed after its wait — is always claimable: the budget bounds retries, §13.4.)
* ``CancelRequested -> Quarantined`` on both machines. §10.1 says a cancelled run's
  pending effect handoff is cancelled only after the owner's durable ``Rejected`` receipt
  and that "an unknown receipt quarantines"; §11.1 draws only
  ``CancelRequested -> Cancelled``, which would claim a cancellation whose external
  effect may have happened. The effect finalizer and the handoff disposition sweep
  (``runtime_svc.effects``) use it only for ``AcceptanceUnknown`` / ``OUTCOME_UNKNOWN``.

Operator-only extensions (:data:`OPERATOR_RUN_ARROWS`, :data:`OPERATOR_STEP_ARROWS`;
issue 14 item 5, ``RetryQuarantinedRun`` and ``python -m runtime_svc.ops quarantine``).
They are deliberately **not** in :data:`RUN_TRANSITIONS`/:data:`STEP_TRANSITIONS`, so
:func:`check_transition` keeps refusing every exit from ``Quarantined`` and no automatic
path (worker, recovery, wait engine, effect finalizer) can ever take them; only
:func:`check_operator_transition`, called by the one reconciliation store method
(:mod:`runtime_svc.kernel.store_reconcile`) on an explicit, authorized, audited operator
decision, admits them:

* ``Quarantined -> Runnable`` (run) with ``Quarantined -> RetryScheduled`` (its current
  step). §11.1 makes ``Quarantined`` terminal and §11.3 sends ``CommitUnknown`` /
  ``RollbackUnknown`` to "quarantine or a dedicated reconciliation workflow"; §5.2.6
  forbids *blind* retries. The retry is not blind: it is allowed only after the marker
  read proved the lost transaction did not commit (no ``Committed`` attempt, no
  checkpoint or business event of the quarantined attempt — which the quarantine's own
  fence already guarantees), with no effect link of the run whose outcome is pending or
  unknown, within the attempt budget, by a caller holding ``flow.runs.operate`` who
  gives a reason. The quarantined attempt's ``CommitUnknown`` outcome is never rewritten;
  the next claim starts a new attempt from the same immutable input checkpoint.
* ``Quarantined -> TerminalFailed`` (run) with ``Quarantined -> Failed`` (step): the
  operator's other resolution of the same reconciliation — the ambiguity is closed as a
  failure (``quarantine_resolved_failed``), so the run stops counting as quarantined.
* ``TerminalFailed -> Runnable`` (run only; ``RestartFromCheckpoint``). An operator
  restarts a failed run from one of its own checkpoints: the root points at a **new**
  ``Pending`` execution of the step that checkpoint was the input of; every old step,
  attempt and checkpoint keeps its terminal state (no step arrow is added, nothing is
  deleted). The failure was decided and recorded; restarting is a new, audited decision
  with its own cause, not a rewrite of the old one. Refused while any effect of the run
  has no known owner outcome, and never offered for ``Quarantined`` (ambiguity is
  reconciled first), ``Cancelled`` (the cancellation is final) or ``Succeeded``.

The operator pause (``PauseRun``) is no arrow: it is an overlay
(``flow_runs.operator_paused_at``) on a non-terminal state that only makes the claim
refuse (``runtime_svc.kernel.transitions_operator``); :func:`compatibility_status`
projects a paused active run as §18.2 ``Paused``.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum

from runtime_svc.kernel.errors import IllegalTransitionError, TerminalStateError
from runtime_svc.kernel.states import (
    ACTIVE_RUN_STATES,
    TERMINAL_ATTEMPT_OUTCOMES,
    TERMINAL_RUN_STATES,
    TERMINAL_STEP_STATES,
    AttemptOutcome,
    CompatibilityStatus,
    RunState,
    StepState,
)

__all__ = [
    "ATTEMPT_TRANSITIONS",
    "CONSISTENT_STEP_STATES",
    "OPERATOR_RUN_ARROWS",
    "OPERATOR_STEP_ARROWS",
    "RUN_EXTENSION_ARROWS",
    "RUN_TRANSITIONS",
    "STEP_EXTENSION_ARROWS",
    "STEP_TRANSITIONS",
    "TRANSITION_TABLES",
    "check_operator_transition",
    "check_transition",
    "compatibility_status",
    "is_allowed",
    "root_step_consistent",
]

_R, _S, _A = RunState, StepState, AttemptOutcome

#: §11.1 plus :data:`RUN_EXTENSION_ARROWS`. Running -> Runnable carries three labels in
#: the spec (next step committed,
#: expired attempt fenced, proven rollback scheduled); a table of pairs holds it once.
RUN_TRANSITIONS: Mapping[RunState, frozenset[RunState]] = {
    _R.ACCEPTED: frozenset({_R.RUNNABLE, _R.CANCEL_REQUESTED}),
    _R.RUNNABLE: frozenset({_R.RUNNING, _R.CANCEL_REQUESTED, _R.TERMINAL_FAILED}),
    _R.RUNNING: frozenset(
        {
            _R.RUNNABLE,
            _R.WAITING,
            _R.SUCCEEDED,
            _R.TERMINAL_FAILED,
            _R.QUARANTINED,
            _R.CANCEL_REQUESTED,
        }
    ),
    _R.WAITING: frozenset({_R.RUNNABLE, _R.TERMINAL_FAILED, _R.QUARANTINED, _R.CANCEL_REQUESTED}),
    _R.CANCEL_REQUESTED: frozenset({_R.CANCELLED, _R.QUARANTINED}),
    _R.SUCCEEDED: frozenset(),
    _R.TERMINAL_FAILED: frozenset(),
    _R.QUARANTINED: frozenset(),
    _R.CANCELLED: frozenset(),
}

#: The arrows added to §11.1 (see the module docstring).
RUN_EXTENSION_ARROWS: frozenset[tuple[RunState, RunState]] = frozenset(
    {(_R.RUNNABLE, _R.TERMINAL_FAILED), (_R.CANCEL_REQUESTED, _R.QUARANTINED)}
)
#: The arrows added to §11.2 (see the module docstring).
STEP_EXTENSION_ARROWS: frozenset[tuple[StepState, StepState]] = frozenset(
    {
        (_S.CLAIMED, _S.FAILED),
        (_S.RETRY_SCHEDULED, _S.FAILED),
        (_S.CANCEL_REQUESTED, _S.QUARANTINED),
    }
)

#: §11.2 plus :data:`STEP_EXTENSION_ARROWS`.
STEP_TRANSITIONS: Mapping[StepState, frozenset[StepState]] = {
    _S.PENDING: frozenset({_S.CLAIMED, _S.CANCELLED}),
    _S.RETRY_SCHEDULED: frozenset({_S.CLAIMED, _S.CANCELLED, _S.FAILED}),
    _S.CLAIMED: frozenset(
        {_S.RUNNING, _S.PENDING, _S.RETRY_SCHEDULED, _S.CANCEL_REQUESTED, _S.FAILED}
    ),
    _S.RUNNING: frozenset(
        {
            _S.SUCCEEDED,
            _S.WAITING,
            _S.RETRY_SCHEDULED,
            _S.FAILED,
            _S.QUARANTINED,
            _S.CANCEL_REQUESTED,
        }
    ),
    _S.WAITING: frozenset({_S.CANCEL_REQUESTED, _S.PENDING, _S.FAILED, _S.QUARANTINED}),
    _S.CANCEL_REQUESTED: frozenset({_S.CANCELLED, _S.QUARANTINED}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.QUARANTINED: frozenset(),
    _S.CANCELLED: frozenset(),
}

#: §11.3: ``Started`` to exactly one terminal outcome, once.
ATTEMPT_TRANSITIONS: Mapping[AttemptOutcome, frozenset[AttemptOutcome]] = {
    _A.STARTED: frozenset(TERMINAL_ATTEMPT_OUTCOMES),
    **{outcome: frozenset() for outcome in TERMINAL_ATTEMPT_OUTCOMES},
}

#: The tables by the ``kind`` :func:`check_transition` takes.
TRANSITION_TABLES: Mapping[str, Mapping[IntEnum, frozenset[IntEnum]]] = {
    "run": RUN_TRANSITIONS,  # type: ignore[dict-item]
    "step": STEP_TRANSITIONS,  # type: ignore[dict-item]
    "attempt": ATTEMPT_TRANSITIONS,  # type: ignore[dict-item]
}

_TERMINAL: Mapping[str, frozenset[IntEnum]] = {
    "run": frozenset(TERMINAL_RUN_STATES),
    "step": frozenset(TERMINAL_STEP_STATES),
    "attempt": frozenset(TERMINAL_ATTEMPT_OUTCOMES),
}


def is_allowed(kind: str, from_state: IntEnum, to_state: IntEnum) -> bool:
    """Whether ``from_state -> to_state`` is an arrow of the ``kind`` machine."""
    return to_state in TRANSITION_TABLES[kind].get(from_state, frozenset())


def check_transition(kind: str, from_state: IntEnum, to_state: IntEnum) -> None:
    """Raise unless ``from_state -> to_state`` is an arrow of the ``kind`` machine.

    Args:
        kind: ``"run"``, ``"step"`` or ``"attempt"``.

    Raises:
        TerminalStateError: ``from_state`` is terminal (nothing may leave or rewrite it).
        IllegalTransitionError: any other arrow the machine does not draw.
        KeyError: unknown ``kind``.
    """
    table = TRANSITION_TABLES[kind]
    if type(from_state) is not type(to_state) or from_state not in table:
        raise IllegalTransitionError(kind, from_state.name, to_state.name)
    if from_state in _TERMINAL[kind]:
        raise TerminalStateError(kind, from_state.name, to_state.name)
    if to_state not in table[from_state]:
        raise IllegalTransitionError(kind, from_state.name, to_state.name)


#: Operator-only exits of ``Quarantined`` (run), see the module docstring.
OPERATOR_RUN_ARROWS: frozenset[tuple[RunState, RunState]] = frozenset(
    {
        (_R.QUARANTINED, _R.RUNNABLE),
        (_R.QUARANTINED, _R.TERMINAL_FAILED),
        (_R.TERMINAL_FAILED, _R.RUNNABLE),
    }
)
#: Operator-only exits of ``Quarantined`` (step), see the module docstring.
OPERATOR_STEP_ARROWS: frozenset[tuple[StepState, StepState]] = frozenset(
    {(_S.QUARANTINED, _S.RETRY_SCHEDULED), (_S.QUARANTINED, _S.FAILED)}
)


def check_operator_transition(kind: str, from_state: IntEnum, to_state: IntEnum) -> None:
    """Raise unless ``from_state -> to_state`` is an operator-only arrow of ``kind``
    (``"run"`` or ``"step"``): the explicit reconciliation of a quarantine. Never called
    by an automatic path.

    Raises:
        IllegalTransitionError: not an operator arrow.
    """
    arrows: frozenset[tuple[IntEnum, IntEnum]] = (
        OPERATOR_RUN_ARROWS if kind == "run" else OPERATOR_STEP_ARROWS
    )
    if (from_state, to_state) not in arrows or type(from_state) is not type(to_state):
        raise IllegalTransitionError(f"operator {kind}", from_state.name, to_state.name)


#: For each root state, the states its *current* step may be in (§18.2 "root and step
#: projection never diverge"). ``TerminalFailed`` includes ``Succeeded``: a committed
#: ``Terminal(failed)`` or explicit-fault step ends the run as failed.
CONSISTENT_STEP_STATES: Mapping[RunState, frozenset[StepState]] = {
    _R.ACCEPTED: frozenset({_S.PENDING}),
    _R.RUNNABLE: frozenset({_S.PENDING, _S.RETRY_SCHEDULED}),
    _R.RUNNING: frozenset({_S.CLAIMED, _S.RUNNING}),
    _R.WAITING: frozenset({_S.WAITING}),
    _R.SUCCEEDED: frozenset({_S.SUCCEEDED}),
    _R.TERMINAL_FAILED: frozenset({_S.FAILED, _S.SUCCEEDED}),
    _R.QUARANTINED: frozenset({_S.QUARANTINED}),
    _R.CANCEL_REQUESTED: frozenset({_S.CANCEL_REQUESTED, _S.CANCELLED}),
    _R.CANCELLED: frozenset({_S.CANCELLED}),
}


def root_step_consistent(run_state: RunState, step_state: StepState | None) -> bool:
    """Whether a root in ``run_state`` may point at a current step in ``step_state``."""
    return step_state is None or step_state in CONSISTENT_STEP_STATES[run_state]


_COMPATIBILITY: Mapping[RunState, CompatibilityStatus] = {
    _R.ACCEPTED: CompatibilityStatus.RUNNING,
    _R.RUNNABLE: CompatibilityStatus.RUNNING,
    _R.RUNNING: CompatibilityStatus.RUNNING,
    _R.WAITING: CompatibilityStatus.PAUSED,
    _R.SUCCEEDED: CompatibilityStatus.FINISHED,
    _R.TERMINAL_FAILED: CompatibilityStatus.ERROR,
    _R.QUARANTINED: CompatibilityStatus.ERROR,
    # §18.2 maps Cancelled to Error "until a dedicated public cancellation value is
    # versioned"; CancelRequested is already irrevocably on its way there, and showing
    # it as Running would tell a legacy consumer the run is still progressing.
    _R.CANCEL_REQUESTED: CompatibilityStatus.ERROR,
    _R.CANCELLED: CompatibilityStatus.ERROR,
}


def compatibility_status(
    run_state: RunState, step_state: StepState | None = None, *, paused: bool = False
) -> CompatibilityStatus:
    """The legacy interview status of §18.2 for a root and its current step.

    ``paused``: an operator paused the run (``operator_paused_at``); an active run
    (Accepted, Runnable, Running, Waiting) then projects as ``Paused`` — it makes no
    progress until resumed. A terminal or cancelling run projects by its state.

    Raises:
        IllegalTransitionError: (kind ``"projection"``) the root and current step states
            diverge, so no projection may be published for them.
    """
    if step_state is not None and not root_step_consistent(run_state, step_state):
        raise IllegalTransitionError("projection", run_state.name, step_state.name)
    if paused and run_state in ACTIVE_RUN_STATES:
        return CompatibilityStatus.PAUSED
    return _COMPATIBILITY[run_state]
