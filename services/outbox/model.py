"""Pure delivery state machine of the transactional outbox (spec §10.7, §15.1, §15.4).

No I/O: the dispatcher asks these functions what a delivery or reconciliation result
means for the row and applies the returned :class:`Transition` with one fenced update::

    Pending ──claim──► Delivering(lease) ──Delivered──────────────────► Delivered
       ▲                   │  │
       │ RetryLater        │  └─RetryLater / lease expired─► Retrying(backoff) ──claim──┐
       └───────────────────┘                                                        │
                   budget exhausted or Refused (family with a reconciler) ◄─────────┘
                               ▼
                   AcceptanceReconciling(lease while in flight)
                     │ Accepted ──────────────────────────────► Delivered (repaired)
                     │ Rejected ─► AcceptanceRejected ─finalizer─► HandoffRejected
                     │ Unknown / reconcile budget or deadline exhausted
                     └─────────► AcceptanceUnknown ──finalizer──► DeadLettered

``AcceptanceRejected`` and ``AcceptanceUnknown`` are *pre-finalization* states: the owner's
durable receipt is persisted, but the message becomes terminal non-delivery only inside
the family finalizer's own transaction (root-first, §15.4), so no terminal non-delivery
state can coexist with an unconverged Flow. A family without a reconciler goes from an
exhausted budget to ``AcceptanceUnknown`` when it has a finalizer, else straight to
``DeadLettered`` (nothing else depends on it).

Retry delays are bounded exponential with jitter (uniform in ``[cap/2, cap]``), taken
from the database clock by the caller (``now``), so replicas agree.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

__all__ = [
    "DUE_STATES",
    "LIVE_STATES",
    "PRE_FINAL_STATES",
    "TERMINAL_STATES",
    "AcceptedReceipt",
    "Delivered",
    "DeliveryPolicy",
    "DeliveryResult",
    "DeliveryState",
    "Disposition",
    "ReconcileResult",
    "Refused",
    "RejectedReceipt",
    "RetryLater",
    "Transition",
    "UnknownReceipt",
    "backoff_delay",
    "decide_after_delivery",
    "decide_after_reconcile",
    "terminal_state_for",
]


class DeliveryState(StrEnum):
    """``delivery_state`` codes (``common.v1.OutboxDeliveryState`` in PascalCase)."""

    PENDING = "Pending"
    DELIVERING = "Delivering"
    RETRYING = "Retrying"
    DELIVERED = "Delivered"
    RECONCILING = "AcceptanceReconciling"
    REJECTED = "AcceptanceRejected"
    UNKNOWN = "AcceptanceUnknown"
    HANDOFF_REJECTED = "HandoffRejected"
    DEAD_LETTERED = "DeadLettered"


#: States a dispatcher claims when ``next_attempt_at`` is due.
DUE_STATES = frozenset({DeliveryState.PENDING, DeliveryState.RETRYING, DeliveryState.RECONCILING})
#: Owner receipt persisted, family finalizer not yet applied (repair-sweep candidates).
PRE_FINAL_STATES = frozenset({DeliveryState.REJECTED, DeliveryState.UNKNOWN})
#: Transport delivery is over; nothing moves a terminal row again.
TERMINAL_STATES = frozenset(
    {DeliveryState.DELIVERED, DeliveryState.HANDOFF_REJECTED, DeliveryState.DEAD_LETTERED}
)
LIVE_STATES = frozenset(DeliveryState) - TERMINAL_STATES


class Disposition(StrEnum):
    """What a finalizer converges: proven rejection, or acceptance unknown."""

    REJECTED = "rejected"
    UNKNOWN = "unknown"


# --- results a family returns ---------------------------------------------------------


@dataclass(frozen=True)
class Delivered:
    """The consumer durably acknowledged the message (e.g. an accepted owner receipt that
    matched scope, key, outbox identity and payload digest)."""

    code: str = "delivered"


@dataclass(frozen=True)
class RetryLater:
    """Transient failure (unavailable, timeout, lost response): retry the same message."""

    code: str


@dataclass(frozen=True)
class Refused:
    """The consumer refused the message; retrying the same bytes cannot help."""

    code: str


DeliveryResult = Delivered | RetryLater | Refused


@dataclass(frozen=True)
class AcceptedReceipt:
    """Reconciliation found a durable acceptance: delivery is repaired."""

    code: str = "accepted"


@dataclass(frozen=True)
class RejectedReceipt:
    """Reconciliation recorded/found a durable rejection tombstone."""

    code: str = "rejected"


@dataclass(frozen=True)
class UnknownReceipt:
    """Reconciliation cannot prove either (digest conflict, fence refused)."""

    code: str


ReconcileResult = AcceptedReceipt | RejectedReceipt | UnknownReceipt | RetryLater


@dataclass(frozen=True)
class DeliveryPolicy:
    """Delivery budget, backoff and lease of one message family.

    Attributes:
        max_attempts: delivery attempts before the budget is exhausted.
        base_delay_ms: first retry delay cap.
        max_delay_ms: retry delay cap.
        lease_ms: how long a claim fences the row (a delivery call must end before).
        reconcile_max_attempts: reconciliation attempts before ``AcceptanceUnknown``.
    """

    max_attempts: int = 8
    base_delay_ms: int = 500
    max_delay_ms: int = 60_000
    lease_ms: int = 30_000
    reconcile_max_attempts: int = 10

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.reconcile_max_attempts < 1:
            raise ValueError("attempt budgets must be >= 1")
        if not 1 <= self.base_delay_ms <= self.max_delay_ms:
            raise ValueError("need 1 <= base_delay_ms <= max_delay_ms")
        if self.lease_ms < 1:
            raise ValueError("lease_ms must be >= 1")


@dataclass(frozen=True)
class Transition:
    """What to write after one delivery or reconciliation."""

    state: DeliveryState
    attempts: int
    next_attempt_at: datetime
    error_code: str | None
    delivered: bool = False


def backoff_delay(policy: DeliveryPolicy, retry: int, rng: random.Random) -> timedelta:
    """Jittered delay before retry number ``retry`` (1-based): uniform in [cap/2, cap]."""
    cap = min(policy.max_delay_ms, policy.base_delay_ms * 2 ** max(retry - 1, 0))
    return timedelta(milliseconds=rng.uniform(cap / 2, cap))


def _exhausted(
    attempts: int, code: str, now: datetime, *, reconciles: bool, finalizes: bool
) -> Transition:
    if reconciles:
        return Transition(DeliveryState.RECONCILING, attempts, now, code)
    if finalizes:
        return Transition(DeliveryState.UNKNOWN, attempts, now, code)
    return Transition(DeliveryState.DEAD_LETTERED, attempts, now, code)


def decide_after_delivery(
    attempts_before: int,
    result: DeliveryResult,
    policy: DeliveryPolicy,
    *,
    reconciles: bool,
    finalizes: bool,
    now: datetime,
    deadline: datetime | None,
    rng: random.Random,
) -> Transition:
    """The transition after one delivery attempt (or an expired delivery lease, which is
    a :class:`RetryLater` whose outcome nobody saw)."""
    attempts = attempts_before + 1
    match result:
        case Delivered(code):
            return Transition(DeliveryState.DELIVERED, attempts, now, None, delivered=True)
        case Refused(code):
            return _exhausted(attempts, code, now, reconciles=reconciles, finalizes=finalizes)
        case RetryLater(code):
            past_deadline = deadline is not None and now >= deadline
            if attempts >= policy.max_attempts or past_deadline:
                exhausted_code = "delivery_deadline_passed" if past_deadline else code
                return _exhausted(
                    attempts, exhausted_code, now, reconciles=reconciles, finalizes=finalizes
                )
            when = now + backoff_delay(policy, attempts, rng)
            return Transition(DeliveryState.RETRYING, attempts, when, code)
    raise TypeError(f"not a delivery result: {result!r}")


def decide_after_reconcile(
    attempts_before: int,
    result: ReconcileResult,
    policy: DeliveryPolicy,
    *,
    now: datetime,
    deadline: datetime | None,
    rng: random.Random,
) -> Transition:
    """The transition after one acceptance-reconciliation call (§15.4).

    A lost response retries the idempotent fence; an exhausted reconciliation budget or
    a passed convergence deadline is ``AcceptanceUnknown`` — never proven rejection.
    """
    attempts = attempts_before + 1
    match result:
        case AcceptedReceipt(code):
            return Transition(DeliveryState.DELIVERED, attempts, now, None, delivered=True)
        case RejectedReceipt(code):
            return Transition(DeliveryState.REJECTED, attempts, now, code)
        case UnknownReceipt(code):
            return Transition(DeliveryState.UNKNOWN, attempts, now, code)
        case RetryLater(code):
            budget = policy.max_attempts + policy.reconcile_max_attempts
            if attempts >= budget or (deadline is not None and now >= deadline):
                return Transition(DeliveryState.UNKNOWN, attempts, now, "reconciliation_exhausted")
            retry = max(1, attempts - policy.max_attempts)
            when = now + backoff_delay(policy, retry, rng)
            return Transition(DeliveryState.RECONCILING, attempts, when, code)
    raise TypeError(f"not a reconcile result: {result!r}")


def terminal_state_for(state: DeliveryState) -> DeliveryState:
    """The terminal state a finalizer moves a pre-finalization state to.

    Raises:
        ValueError: ``state`` is not a pre-finalization state.
    """
    if state is DeliveryState.REJECTED:
        return DeliveryState.HANDOFF_REJECTED
    if state is DeliveryState.UNKNOWN:
        return DeliveryState.DEAD_LETTERED
    raise ValueError(f"{state} is not a pre-finalization state")
