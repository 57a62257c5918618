"""Effect-owner domain errors (subclasses of ``services.errors``; mapped to gRPC there).

All three handoff refusals are ``FAILED_PRECONDITION`` with a stable ``reason``; a
mismatch says nothing about the row it failed against (no cross-scope disclosure).
"""

from __future__ import annotations

from services.errors import FailedPreconditionError

__all__ = ["HandoffMismatchError", "HandoffRejectedError", "OwnerKindNotServedError"]


class HandoffRejectedError(FailedPreconditionError):
    """The key carries a durable REJECTED tombstone: it can never be accepted (§10.7)."""

    reason = "handoff_rejected"

    def __init__(self) -> None:
        super().__init__(
            "the handoff key was durably rejected by RejectIfUnaccepted; it can never be accepted"
        )


class HandoffMismatchError(FailedPreconditionError):
    """The request's scope, payload digest or outbox identity does not match the
    owner's durable fence for the key (or the key was not minted for the caller's
    scope). Fails closed; the same answer whether or not a row exists."""

    reason = "handoff_mismatch"

    def __init__(self) -> None:
        super().__init__(
            "the handoff does not match the owner's durable fence for this key; it was "
            "refused and recorded for operator review"
        )


class OwnerKindNotServedError(FailedPreconditionError):
    """This effect owner has no provider for the envelope's effect owner kind."""

    reason = "effect_owner_kind_not_served"

    def __init__(self, kind: str) -> None:
        super().__init__(
            f"this effect owner does not serve effect owner kind {kind!r}",
            attributes={"effect_owner_kind": kind},
        )
