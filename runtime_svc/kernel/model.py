"""Pure domain values of the orchestration kernel: row snapshots, the worker's lease
fence, and the *patches* a transition decision asks the store to apply.

A patch names the row, the version and state it expects (the compare-and-swap input)
and the fields it changes; :data:`KEEP` marks a field left as it is. Field names are the
§10 field names in snake_case, which are also the column names, so the store turns a
patch into one conditional UPDATE without a per-decision mapping. Constructing a patch
checks its arrow against the transition tables, so an illegal or terminal-overwriting
patch cannot even be built.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, Final

from runtime_svc.kernel.errors import IllegalTransitionError, TerminalStateError
from runtime_svc.kernel.policy import lease_token_digest
from runtime_svc.kernel.states import (
    TERMINAL_RUN_STATES,
    TERMINAL_STEP_STATES,
    AttemptOutcome,
    ExecutionOwner,
    FailureClass,
    RetryDecision,
    RunState,
    StepState,
)
from runtime_svc.kernel.tables import check_operator_transition, check_transition

__all__ = [
    "KEEP",
    "AttemptPatch",
    "AttemptRecord",
    "CheckpointInput",
    "CheckpointMeta",
    "Keep",
    "LeaseFence",
    "NewAttempt",
    "NewStep",
    "RunPatch",
    "RunRecord",
    "StepPatch",
    "StepRecord",
    "Transition",
    "patch_changes",
]


class Keep(enum.Enum):
    """Sentinel type of :data:`KEEP`."""

    KEEP = "keep"


#: "Leave this field unchanged" in a patch (``None`` means "set to NULL").
KEEP: Final = Keep.KEEP


# --- row snapshots -----------------------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    """One ``flow_runs`` row (§10.1), decoded."""

    org_id: str
    flow_run_id: str
    app_installation_id: str
    runtime_capability_id: str
    runtime_work_binding_digest: str
    flow_version_id: str
    #: ``""`` on a LegacyInterpreter-owned run (no compiled plan).
    plan_id: str
    execution_profile: str
    execution_owner: ExecutionOwner
    state: RunState
    state_version: int
    ownership_epoch: int
    current_step_execution_id: str | None
    current_checkpoint_id: str | None
    run_after: datetime | None
    queue_class: str
    priority: int
    terminal_cause_code: str | None
    is_deleted: bool
    delete_requested_at: datetime | None
    started_at: datetime | None
    completed_at: datetime | None
    idempotency_key: str | None
    request_digest: str | None
    interview_status: str
    current_element: str | None
    paused_at: datetime | None
    created_at: datetime
    updated_at: datetime
    #: The run's W3C trace context (``services.telemetry`` JSON): diagnostics only.
    trace_context: str | None = None
    #: When an operator paused the run (``PauseRun``); ``None`` when not paused. An
    #: overlay on :attr:`state`: no claim picks a paused run (issue 14 item 5).
    operator_paused_at: datetime | None = None


@dataclass(frozen=True)
class StepRecord:
    """One ``flow_step_executions`` row (§10.2), decoded. ``lease_token_digest`` is the
    ``lease_token`` column: only the digest of a lease token is ever stored."""

    org_id: str
    step_execution_id: str
    flow_run_id: str
    plan_step_key: str
    invocation_ordinal: int
    step_kind: str
    state: StepState
    input_checkpoint_id: str | None
    output_checkpoint_id: str | None
    state_version: int
    attempt_count: int
    lease_owner: str | None
    lease_token_digest: str | None
    lease_until: datetime | None
    ownership_epoch: int
    run_after: datetime | None
    queue_class: str
    failure_class: FailureClass | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class AttemptRecord:
    """One ``flow_step_attempts`` row (§10.3), decoded."""

    org_id: str
    attempt_id: str
    step_execution_id: str
    attempt_number: int
    lease_token_digest: str
    ownership_epoch: int
    root_state_version_at_claim: int
    started_at: datetime
    finished_at: datetime | None
    outcome: AttemptOutcome
    failure_class: FailureClass | None
    safe_error_code: str | None
    retry_decision: RetryDecision | None
    retry_policy_digest: str
    recovery_backoff_floor_ms: int
    attempt_state_version: int
    plan_digest: str
    lock_plan_digest: str
    trace_id: str | None


@dataclass(frozen=True)
class CheckpointMeta:
    """Checkpoint metadata without its payload (what support reads may show, §19)."""

    checkpoint_id: str
    flow_run_id: str
    sequence: int
    context_schema_version: int
    context_digest: str
    created_by_attempt_id: str | None
    created_at: datetime


@dataclass(frozen=True)
class CheckpointInput:
    """What a caller supplies for a new immutable checkpoint (§10.4).

    Attributes:
        context: the resumable Flow context (validated by ``checkpoint_guard``).
        plan_cursor: next compiled step and control-flow position.
        context_schema_version: decoder generation of ``context``.
        read_verification_set: optional snapshot verification tokens.
    """

    context: Any
    plan_cursor: Any = field(default_factory=dict)
    context_schema_version: int = 1
    read_verification_set: Any = None


@dataclass(frozen=True)
class LeaseFence:
    """The claim a worker holds: everything its later transitions must compare.

    The raw ``lease_token`` exists only here (never stored, never in ``repr``).
    """

    org_id: str
    flow_run_id: str
    step_execution_id: str
    attempt_id: str
    attempt_number: int
    lease_owner: str
    lease_token: str = field(repr=False)
    ownership_epoch: int
    root_state_version: int
    step_state_version: int
    attempt_state_version: int
    input_checkpoint_id: str | None
    lease_until: datetime

    @functools.cached_property
    def token_digest(self) -> str:
        """The stored digest of :attr:`lease_token` (computed once per fence: the claim,
        the commit's revalidation and its patches all compare it)."""
        return lease_token_digest(self.lease_token)


# --- patches -----------------------------------------------------------------------------

_META = frozenset(
    {
        "flow_run_id",
        "step_execution_id",
        "attempt_id",
        "expected_version",
        "from_state",
        "to_state",
        "expect_epoch",
        "expect_lease_token_digest",
        "expect_current_step",
        "require_not_paused",
        "operator",
        "expect_input_checkpoint_id",
        "expect_root_state_version_at_claim",
        "require_live",
    }
)


#: The value fields (not :data:`_META`) of each patch class, in declaration order.
_VALUE_FIELDS: dict[type, tuple[str, ...]] = {}


def patch_changes(patch: RunPatch | StepPatch | AttemptPatch) -> dict[str, Any]:
    """The changed fields of ``patch`` (field name → value), :data:`KEEP` ones left out."""
    names = _VALUE_FIELDS.get(type(patch))
    if names is None:
        names = tuple(f.name for f in fields(patch) if f.name not in _META)
        _VALUE_FIELDS[type(patch)] = names
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(patch, name)
        if value is not KEEP:
            out[name] = value
    return out


@dataclass(frozen=True)
class RunPatch:
    """A fenced change of one root row.

    Predicates: org, id, ``state_version = expected_version``, ``runtime_state =
    from_state``, owner FlowRuntimeV2, ``ownership_epoch = expect_epoch``; with
    ``require_live`` also ``is_deleted = false AND delete_requested_at IS NULL``; with
    ``expect_current_step`` also the current-step pointer; with ``require_not_paused``
    also ``operator_paused_at IS NULL`` (a claim never takes a paused run).
    """

    flow_run_id: str
    expected_version: int
    from_state: RunState
    to_state: RunState
    expect_epoch: int
    require_live: bool = True
    expect_current_step: str | None = None
    require_not_paused: bool = False
    #: An operator-only arrow (``tables.check_operator_transition``), never automatic.
    operator: bool = False
    current_step_execution_id: str | Keep | None = KEEP
    current_checkpoint_id: str | Keep | None = KEEP
    run_after: datetime | Keep | None = KEEP
    started_at: datetime | Keep = KEEP
    completed_at: datetime | Keep | None = KEEP
    terminal_cause_code: str | Keep | None = KEEP
    is_deleted: bool | Keep = KEEP
    delete_requested_at: datetime | Keep = KEEP
    current_element: str | Keep | None = KEEP
    paused_at: datetime | Keep | None = KEEP

    def __post_init__(self) -> None:
        if self.operator:
            check_operator_transition("run", self.from_state, self.to_state)
        elif self.from_state is self.to_state:
            _check_same_state("run", self.from_state, self)
        else:
            check_transition("run", self.from_state, self.to_state)


@dataclass(frozen=True)
class StepPatch:
    """A fenced change of one step row: version, state, epoch and (when given) the lease
    token digest and input checkpoint are compared."""

    step_execution_id: str
    expected_version: int
    from_state: StepState
    to_state: StepState
    expect_epoch: int
    expect_lease_token_digest: str | None = None
    expect_input_checkpoint_id: str | None = None
    lease_owner: str | Keep | None = KEEP
    lease_token_digest: str | Keep | None = KEEP
    lease_until: datetime | Keep | None = KEEP
    run_after: datetime | Keep | None = KEEP
    attempt_count: int | Keep = KEEP
    output_checkpoint_id: str | Keep = KEEP
    failure_class: FailureClass | Keep | None = KEEP

    def __post_init__(self) -> None:
        if self.from_state is self.to_state:
            _check_same_state("step", self.from_state, self)
        else:
            check_transition("step", self.from_state, self.to_state)


@dataclass(frozen=True)
class AttemptPatch:
    """The one terminal transition of an attempt: ``Started -> to_state``, compared on
    ``attempt_state_version``, lease token digest, epoch and (when given) the root
    version at claim (§11.3)."""

    attempt_id: str
    expected_version: int
    to_state: AttemptOutcome
    expect_lease_token_digest: str
    expect_epoch: int
    expect_root_state_version_at_claim: int | None = None
    failure_class: FailureClass | Keep | None = KEEP
    safe_error_code: str | Keep | None = KEEP
    retry_decision: RetryDecision | Keep = KEEP
    finished_at: datetime | Keep = KEEP
    #: Safe evidence of the attempt (canonical JSON): the lock plan it committed with,
    #: or the resource-class mismatch and expanded plan of a late discovery (§13.3).
    metrics_summary: str | Keep | None = KEEP
    from_state: AttemptOutcome = AttemptOutcome.STARTED

    def __post_init__(self) -> None:
        check_transition("attempt", self.from_state, self.to_state)


@dataclass(frozen=True)
class NewStep:
    """A new step row (the next step of an advancing root, or the first): ``Pending``,
    or ``Waiting`` for the ``EffectCompletion`` step an ``EffectSubmit`` commit creates
    (§15.1 step 5)."""

    step_execution_id: str
    flow_run_id: str
    plan_step_key: str
    invocation_ordinal: int
    step_kind: str
    input_checkpoint_id: str
    ownership_epoch: int
    run_after: datetime | None
    queue_class: str
    state: StepState = StepState.PENDING

    def __post_init__(self) -> None:
        if self.state not in (StepState.PENDING, StepState.WAITING):
            raise IllegalTransitionError("step", "NEW", self.state.name)


@dataclass(frozen=True)
class NewAttempt:
    """A new ``Started`` attempt row with its immutable claim inputs (§12.1 step 5)."""

    attempt_id: str
    step_execution_id: str
    attempt_number: int
    lease_token_digest: str
    ownership_epoch: int
    root_state_version_at_claim: int
    started_at: datetime
    retry_policy_digest: str
    recovery_backoff_floor_ms: int
    plan_digest: str
    lock_plan_digest: str
    trace_id: str | None


@dataclass(frozen=True)
class Transition:
    """Everything one decision writes, applied by the store in §12 lock order:
    root, step, attempt, then inserts (a new attempt, a new next step)."""

    run: RunPatch | None = None
    step: StepPatch | None = None
    attempt: AttemptPatch | None = None
    new_attempt: NewAttempt | None = None
    new_step: NewStep | None = None


#: Fields a same-state patch may touch: a terminal root only gains the soft-delete fact
#: (§10.1 step 4); a live row may move only its lease/timing fields.
_TERMINAL_SAME_STATE_FIELDS = frozenset({"is_deleted", "delete_requested_at"})


def _check_same_state(kind: str, state: enum.IntEnum, patch: RunPatch | StepPatch) -> None:
    terminal = state in (TERMINAL_RUN_STATES if kind == "run" else TERMINAL_STEP_STATES)
    changed = set(patch_changes(patch))
    if terminal and not changed <= _TERMINAL_SAME_STATE_FIELDS:
        raise TerminalStateError(kind, state.name, state.name)
