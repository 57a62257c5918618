"""Errors of the orchestration kernel, all inside the one ``services.errors`` hierarchy::

    FailedPreconditionError
    ├── IllegalTransitionError      an arrow that §11 does not draw
    │   └── TerminalStateError      any write that would change a terminal state/outcome
    ├── TransitionInputError        typed transition input rejected before any SQL
    └── StateVersionMismatchError   a caller's expected root version is not the stored one
    ConflictError
    └── FenceLostError              (services.errors) decided by row count or revalidation

:func:`fence_lost` builds the :class:`~services.errors.FenceLostError` of a failed
revalidation (locked row no longer matches the caller's fence) with a stable
``fence_reason`` attribute, so a stale worker sees the same error whether the conditional
UPDATE or the revalidation of the locked row caught it.
"""

from __future__ import annotations

from services.errors import FailedPreconditionError, FenceLostError

__all__ = [
    "IllegalTransitionError",
    "StateVersionMismatchError",
    "TerminalStateError",
    "TransitionInputError",
    "fence_lost",
]


class IllegalTransitionError(FailedPreconditionError):
    """A state change that the §11 state machines do not allow."""

    reason = "illegal_transition"

    def __init__(self, kind: str, from_state: str, to_state: str) -> None:
        self.kind, self.from_state, self.to_state = kind, from_state, to_state
        super().__init__(
            f"illegal {kind} transition {from_state} -> {to_state}",
            attributes={"kind": kind, "from": from_state, "to": to_state},
        )


class TerminalStateError(IllegalTransitionError):
    """A write that would leave (or rewrite) a terminal run/step state or attempt outcome."""

    reason = "terminal_state_immutable"


class TransitionInputError(FailedPreconditionError):
    """A typed transition was called without a valid owner/epoch/version fence; nothing
    was sent to the database (§10.1 "rejected before SQL execution")."""

    reason = "transition_input_rejected"

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message, field_path=field)


class StateVersionMismatchError(FailedPreconditionError):
    """A caller-supplied expected root ``state_version`` (``DeleteRun``/``CancelRun``) is
    not the version the transition's compare-and-swap found; nothing was written."""

    reason = "state_version_mismatch"

    def __init__(self, expected: int, found: int | None) -> None:
        shown = "absent" if found is None else str(found)
        super().__init__(
            f"expected_state_version {expected} is stale (current {shown})",
            field_path="expected_state_version",
            attributes={"expected_version": str(expected), "found_version": shown},
        )


def fence_lost(
    entity: str, key: str, expected_version: int, found_version: int | None, reason: str
) -> FenceLostError:
    """A :class:`FenceLostError` carrying the revalidation ``reason`` as ``fence_reason``."""
    err = FenceLostError(entity, key, expected_version, found_version)
    err.attributes["fence_reason"] = reason
    return err
