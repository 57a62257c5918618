"""Pure values of durable waits (§10.5, §10.6): the dependency and wake-signal state
machines, their decoded rows, and the fenced patches a wait transition applies.

Dependency (§10.5)::

    Pending ──► Resolved      a consumed signal or a satisfied reconciliation (§14.2)
            ├─► Expired       deadline: fault path / terminal failure (§14.3)
            ├─► Quarantined   deadline under the quarantine policy, missing producer
            └─► Cancelled     the root's cancellation transition (§11.1)

Wake signal (§10.6)::

    Unmatched ──► Consumed    by exactly one dependency, in its resolution transaction
              └─► Expired     retention bound passed unconsumed

Every arrow is a compare-and-swap on ``state_version`` plus the from-state; terminal
rows never change. Pure: no SQLAlchemy, no protos.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from runtime_svc.kernel.errors import IllegalTransitionError, TerminalStateError
from runtime_svc.kernel.states import CodedEnum

__all__ = [
    "DEPENDENCY_TRANSITIONS",
    "DependencyPatch",
    "DependencyRecord",
    "DependencyState",
    "ExpiryPolicyCode",
    "FaultSuccessor",
    "NewDependency",
    "NewSignal",
    "SignalPatch",
    "SignalRecord",
    "SignalState",
    "WorkScopeKey",
]


class DependencyState(CodedEnum):
    """``FlowDependency.State`` (numbers mirror ``common.v1.DependencyState``)."""

    PENDING = 1
    RESOLVED = 2
    EXPIRED = 3
    QUARANTINED = 4
    CANCELLED = 5


class SignalState(CodedEnum):
    """``FlowWakeSignal.ResolutionState`` (numbers mirror the proto enum)."""

    UNMATCHED = 1
    CONSUMED = 2
    EXPIRED = 3


class ExpiryPolicyCode(CodedEnum):
    """The stored expiry policy of a dependency (numbers mirror ``ExpiryPolicy``)."""

    FAULT_PATH = 1
    TERMINAL_FAILURE = 2
    QUARANTINE = 3


#: Dependency arrows; every non-Pending state is terminal.
DEPENDENCY_TRANSITIONS: dict[DependencyState, frozenset[DependencyState]] = {
    DependencyState.PENDING: frozenset(
        {
            DependencyState.RESOLVED,
            DependencyState.EXPIRED,
            DependencyState.QUARANTINED,
            DependencyState.CANCELLED,
        }
    ),
    **{s: frozenset() for s in DependencyState if s is not DependencyState.PENDING},
}
_SIGNAL_TRANSITIONS: dict[SignalState, frozenset[SignalState]] = {
    SignalState.UNMATCHED: frozenset({SignalState.CONSUMED, SignalState.EXPIRED}),
    SignalState.CONSUMED: frozenset(),
    SignalState.EXPIRED: frozenset(),
}


@dataclass(frozen=True)
class WorkScopeKey:
    """The complete trusted Runtime work scope of a row (§10.0): all four components."""

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    runtime_work_binding_digest: str


@dataclass(frozen=True)
class DependencyRecord:
    """One ``flow_dependencies`` row, decoded."""

    scope: WorkScopeKey
    dependency_id: str
    flow_run_id: str
    step_execution_id: str
    producer_kind: str
    producer_key: str
    condition_digest: str
    state: DependencyState
    state_version: int
    wake_version: int | None
    wake_token: str | None
    deadline: datetime
    next_probe_at: datetime | None
    expiry_policy: ExpiryPolicyCode
    resolved_at: datetime | None
    resolution_receipt: str | None
    created_at: datetime
    updated_at: datetime
    reconciliation_attempts: int
    wake_signal_id: str | None

    @property
    def org_id(self) -> str:
        return self.scope.org_id


@dataclass(frozen=True)
class SignalRecord:
    """One ``flow_wake_signals`` row, decoded (the evidence JSON is safe by contract)."""

    scope: WorkScopeKey
    wake_signal_id: str
    producer_kind: str
    producer_key: str
    wake_token: str
    wake_version: int | None
    evidence_digest: str
    evidence_reference: str | None
    evidence_json: str | None
    received_at: datetime
    expires_at: datetime
    state: SignalState
    dependency_id: str | None
    state_version: int
    next_match_at: datetime | None
    consumed_at: datetime | None
    #: The producer's W3C trace context (``services.telemetry`` JSON): diagnostics only.
    trace_context: str | None = None


@dataclass(frozen=True)
class NewDependency:
    """A ``Pending`` dependency inserted with the wait transition (§14.2 step 3).

    Attributes:
        next_probe_at: a timer's due time, or the first reconciliation probe.
    """

    dependency_id: str
    flow_run_id: str
    step_execution_id: str
    producer_kind: str
    producer_key: str
    condition_digest: str
    deadline: datetime
    next_probe_at: datetime | None
    expiry_policy: ExpiryPolicyCode
    wake_version: int | None = None


@dataclass(frozen=True)
class NewSignal:
    """A producer notification to insert (idempotent on scope, kind, key, token)."""

    wake_signal_id: str
    producer_kind: str
    producer_key: str
    wake_token: str
    wake_version: int | None
    evidence_digest: str
    evidence_reference: str | None
    evidence_json: str | None = field(default=None, repr=False)
    expires_at: datetime | None = None


@dataclass(frozen=True)
class FaultSuccessor:
    """The precompiled fault-path successor a fault-path expiry activates (§14.3)."""

    step_execution_id: str
    plan_step_key: str
    step_kind: str
    queue_class: str
    invocation_ordinal: int


def _check(
    table: dict[Any, frozenset[Any]], kind: str, from_state: CodedEnum, to_state: CodedEnum
) -> None:
    if not table[from_state]:
        raise TerminalStateError(kind, from_state.name, to_state.name)
    if to_state not in table[from_state]:
        raise IllegalTransitionError(kind, from_state.name, to_state.name)


@dataclass(frozen=True)
class DependencyPatch:
    """A fenced change of one dependency: ``Pending -> to_state`` at ``expected_version``.

    ``values`` are the columns it sets besides state/version (receipt, wake identity,
    resolution time, the freed active slot).
    """

    dependency_id: str
    expected_version: int
    to_state: DependencyState
    values: dict[str, Any]
    from_state: DependencyState = DependencyState.PENDING

    def __post_init__(self) -> None:
        _check(DEPENDENCY_TRANSITIONS, "dependency", self.from_state, self.to_state)


@dataclass(frozen=True)
class SignalPatch:
    """A fenced consume (or expiry) of one signal in its work scope."""

    scope: WorkScopeKey
    wake_signal_id: str
    expected_version: int
    to_state: SignalState
    values: dict[str, Any]
    from_state: SignalState = SignalState.UNMATCHED

    def __post_init__(self) -> None:
        _check(_SIGNAL_TRANSITIONS, "wake_signal", self.from_state, self.to_state)
