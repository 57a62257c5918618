"""Pure mirrors of the lifecycle enums of ``nexus.flow.common.v1`` (§10-§11, §18.2).

Every member's integer value equals the proto enum number, so the API layer maps
``RunState(proto_value)`` and ``int(state)`` 1:1 without a lookup table; the proto's
``*_UNSPECIFIED = 0`` is deliberately absent (it is never stored or decided). The
``code`` of a member is the spec's PascalCase name, which is what the storage columns
hold (``flow_runs.runtime_state = "Running"``); :meth:`from_code` reads it back.

Pure: no proto or SQLAlchemy import (CONTRIBUTING "Code").
"""

from __future__ import annotations

from enum import IntEnum
from typing import TypeVar, cast

__all__ = [
    "ACTIVE_RUN_STATES",
    "TERMINAL_ATTEMPT_OUTCOMES",
    "TERMINAL_RUN_STATES",
    "TERMINAL_STEP_STATES",
    "AttemptOutcome",
    "CodedEnum",
    "CompatibilityStatus",
    "ExecutionOwner",
    "FailureClass",
    "RetryDecision",
    "RunState",
    "StepState",
]

_E = TypeVar("_E", bound="CodedEnum")

#: Each member's code by (enum class, value) — an ``IntEnum`` member hashes as its int, so
#: members of two enums with one value must not share a key — and each class's members
#: by code; filled on first use (the codes are read and decoded on every stored row).
_CODES: dict[tuple[type[CodedEnum], int], str] = {}
_BY_CODE: dict[type[CodedEnum], dict[str, CodedEnum]] = {}


class CodedEnum(IntEnum):
    """An ``IntEnum`` with the storage code (spec PascalCase name) of each member."""

    @property
    def code(self) -> str:
        """The stored code: ``TERMINAL_FAILED`` → ``TerminalFailed``."""
        key = (type(self), int(self))
        code = _CODES.get(key)
        if code is None:
            code = _CODES[key] = "".join(part.capitalize() for part in self.name.split("_"))
        return code

    @classmethod
    def from_code(cls: type[_E], code: str) -> _E:
        """The member whose :attr:`code` is ``code``.

        Raises:
            ValueError: no member has that code (a row written by something else).
        """
        members = _BY_CODE.get(cls)
        if members is None:
            members = _BY_CODE[cls] = {member.code: member for member in cls}
        member = members.get(code)
        if member is None:
            raise ValueError(f"{code!r} is not a {cls.__name__} code")
        return cast(_E, member)


class RunState(CodedEnum):
    """Canonical FlowRun lifecycle (§11.1)."""

    ACCEPTED = 1
    RUNNABLE = 2
    RUNNING = 3
    WAITING = 4
    SUCCEEDED = 5
    TERMINAL_FAILED = 6
    QUARANTINED = 7
    CANCEL_REQUESTED = 8
    CANCELLED = 9


class StepState(CodedEnum):
    """Canonical FlowStepExecution lifecycle (§11.2)."""

    PENDING = 1
    CLAIMED = 2
    RUNNING = 3
    SUCCEEDED = 4
    WAITING = 5
    RETRY_SCHEDULED = 6
    FAILED = 7
    QUARANTINED = 8
    CANCEL_REQUESTED = 9
    CANCELLED = 10


class AttemptOutcome(CodedEnum):
    """FlowStepAttempt transaction outcome (§11.3): ``Started`` then one terminal value."""

    STARTED = 1
    COMMITTED = 2
    ROLLED_BACK = 3
    COMMIT_UNKNOWN = 4
    ROLLBACK_UNKNOWN = 5
    PRE_TRANSACTION_FAILED = 6
    FENCED = 7
    CANCELLED = 8
    ABANDONED = 9


class RetryDecision(CodedEnum):
    """What an attempt's terminal outcome decided about the next attempt (§10.3)."""

    NONE = 1
    SCHEDULED = 2
    TERMINAL = 3
    QUARANTINED = 4


class FailureClass(CodedEnum):
    """Stable, safe failure classification of a step or attempt (§10.2, §10.3)."""

    RETRYABLE = 1
    TERMINAL = 2
    AMBIGUOUS = 3
    FENCED = 4
    CANCELLED = 5


class CompatibilityStatus(CodedEnum):
    """Legacy interview status derived from the canonical state (§18.2)."""

    RUNNING = 1
    PAUSED = 2
    FINISHED = 3
    ERROR = 4


class ExecutionOwner(CodedEnum):
    """Which scheduler owns a run's writes (§10.1, §20.6)."""

    LEGACY_INTERPRETER = 1
    FLOW_RUNTIME_V2 = 2


#: Run states with no outgoing arrow (§11.1 ``--> [*]``).
TERMINAL_RUN_STATES = frozenset(
    {RunState.SUCCEEDED, RunState.TERMINAL_FAILED, RunState.QUARANTINED, RunState.CANCELLED}
)
#: Run states a cancellation/delete request can fence (§10.1 step 2).
ACTIVE_RUN_STATES = frozenset(
    {RunState.ACCEPTED, RunState.RUNNABLE, RunState.RUNNING, RunState.WAITING}
)
#: Step states with no outgoing arrow (§11.2).
TERMINAL_STEP_STATES = frozenset(
    {StepState.SUCCEEDED, StepState.FAILED, StepState.QUARANTINED, StepState.CANCELLED}
)
#: Every attempt outcome except ``Started`` is terminal and immutable (§10.3).
TERMINAL_ATTEMPT_OUTCOMES = frozenset(o for o in AttemptOutcome if o is not AttemptOutcome.STARTED)
