"""Durable orchestration kernel (§10-§13): lifecycle enums, the §11 state machines as
data, pure transition decisions, checkpoint validation, and ``FlowRunStateStore`` — the
only write path for Flow run, step, attempt and checkpoint rows.

Pure modules (no SQLAlchemy, no protos): :mod:`.states`, :mod:`.tables`,
:mod:`.policy`, :mod:`.model`, :mod:`.decisions`, :mod:`.transitions`,
:mod:`.checkpoint_guard`. Storage: :mod:`.store` (public API), :mod:`.store_rows` and
:mod:`.store_reads` (its ``_txn`` helpers).
"""

from __future__ import annotations

from runtime_svc.kernel.checkpoint_guard import (
    DEFAULT_MAX_CHECKPOINT_BYTES,
    validate_checkpoint_payload,
)
from runtime_svc.kernel.decisions import (
    EnterWait,
    FailRun,
    FinishRun,
    NextStep,
    NoChange,
    NotEligible,
    StepFailure,
)
from runtime_svc.kernel.errors import (
    IllegalTransitionError,
    TerminalStateError,
    TransitionInputError,
)
from runtime_svc.kernel.model import CheckpointInput, LeaseFence, RunRecord
from runtime_svc.kernel.policy import DEFAULT_RETRY_POLICY, RetryPolicy
from runtime_svc.kernel.states import (
    AttemptOutcome,
    CompatibilityStatus,
    ExecutionOwner,
    FailureClass,
    RetryDecision,
    RunState,
    StepState,
)
from runtime_svc.kernel.store import (
    ClaimedStart,
    CommitResult,
    CommitTail,
    ContinueAs,
    FirstStep,
    FlowRunStateStore,
    StartRunRequest,
    StartRunResult,
)
from runtime_svc.kernel.store_reads import Candidate, RunCursor, RunFilters, RunPage, SupportView
from runtime_svc.kernel.tables import check_transition, compatibility_status

__all__ = [
    "DEFAULT_MAX_CHECKPOINT_BYTES",
    "DEFAULT_RETRY_POLICY",
    "AttemptOutcome",
    "Candidate",
    "CheckpointInput",
    "ClaimedStart",
    "CommitResult",
    "CommitTail",
    "CompatibilityStatus",
    "ContinueAs",
    "EnterWait",
    "ExecutionOwner",
    "FailRun",
    "FailureClass",
    "FinishRun",
    "FirstStep",
    "FlowRunStateStore",
    "IllegalTransitionError",
    "LeaseFence",
    "NextStep",
    "NoChange",
    "NotEligible",
    "RetryDecision",
    "RetryPolicy",
    "RunCursor",
    "RunFilters",
    "RunPage",
    "RunRecord",
    "RunState",
    "StartRunRequest",
    "StartRunResult",
    "StepFailure",
    "StepState",
    "SupportView",
    "TerminalStateError",
    "TransitionInputError",
    "check_transition",
    "compatibility_status",
    "validate_checkpoint_payload",
]
