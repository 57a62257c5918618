"""Pure lifecycle of an ``ExternalCommand`` (spec §15.2, §15.3).

::

    ACCEPTED ─begin attempt─► DISPATCHING(attempt IN_FLIGHT, lease)
        SUCCEEDED ──────────────────────────────► SUCCEEDED     + receipt (SUCCEEDED)
        FAILED_TERMINAL / retry budget spent ───► FAILED        + receipt (FAILED)
        FAILED_RETRYABLE ───────────────────────► DISPATCHING   (next attempt after backoff)
        OUTCOME_UNKNOWN / lease expired in flight ► OUTCOME_UNKNOWN ─reconcile─┐
    OUTCOME_UNKNOWN:                                                          │
        lookup SUCCEEDED / FAILED_TERMINAL ─────► SUCCEEDED / FAILED + receipt  ◄┘
        no lookup or NOT_FOUND, replay-safe ────► DISPATCHING (same idempotency key)
        no lookup or NOT_FOUND, not replay-safe ► QUARANTINED  + receipt (OUTCOME_UNKNOWN)
        lookup failed ──────────────────────────► OUTCOME_UNKNOWN (lookup again later),
                                                   QUARANTINED once the budget is spent

``OUTCOME_UNKNOWN`` is neither success nor automatically retryable (§15.3): only a
provider that deduplicates on the idempotency key (``replay_safe``) may see the request
again. Every terminal transition publishes one completion receipt (a new outcome
version) in the same transaction.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from effect_owner_svc.providers.base import ProviderOutcome, ProviderOutcomeKind
from services.effect_contract import CompletionOutcomeCode

__all__ = [
    "DUE_COMMAND_STATES",
    "TERMINAL_COMMAND_STATES",
    "AttemptOutcome",
    "CommandPolicy",
    "CommandState",
    "Complete",
    "LookupAgainAt",
    "Reconcile",
    "Replay",
    "RetryAt",
    "attempt_outcome_for",
    "decide_after_attempt",
    "decide_after_lookup",
]


class CommandState(StrEnum):
    """``external_commands.state`` (``effect.v1.CommandState``)."""

    ACCEPTED = "ACCEPTED"
    DISPATCHING = "DISPATCHING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"
    QUARANTINED = "QUARANTINED"


class AttemptOutcome(StrEnum):
    """``remote_attempts.outcome`` (``effect.v1.RemoteAttemptOutcome``)."""

    IN_FLIGHT = "IN_FLIGHT"
    SUCCEEDED = "SUCCEEDED"
    FAILED_RETRYABLE = "FAILED_RETRYABLE"
    FAILED_TERMINAL = "FAILED_TERMINAL"
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"


DUE_COMMAND_STATES = frozenset(
    {CommandState.ACCEPTED, CommandState.DISPATCHING, CommandState.OUTCOME_UNKNOWN}
)
TERMINAL_COMMAND_STATES = frozenset(
    {CommandState.SUCCEEDED, CommandState.FAILED, CommandState.QUARANTINED}
)


@dataclass(frozen=True)
class CommandPolicy:
    """Remote-attempt budget, backoff and lease of the owner's dispatcher."""

    max_attempts: int = 5
    reconcile_max_attempts: int = 10
    base_delay_ms: int = 1_000
    max_delay_ms: int = 300_000
    lease_ms: int = 60_000

    def delay(self, retry: int, rng: random.Random) -> timedelta:
        """Jittered delay before retry ``retry`` (1-based): uniform in [cap/2, cap]."""
        cap = min(self.max_delay_ms, self.base_delay_ms * 2 ** max(retry - 1, 0))
        return timedelta(milliseconds=rng.uniform(cap / 2, cap))


@dataclass(frozen=True)
class Complete:
    """Terminal: publish a receipt with ``outcome``."""

    state: CommandState
    outcome: CompletionOutcomeCode
    safe_error_code: str = ""
    result_digest: str = ""


@dataclass(frozen=True)
class RetryAt:
    """Proven not applied: another attempt at ``when``."""

    when: datetime
    safe_error_code: str


@dataclass(frozen=True)
class Reconcile:
    """The attempt's outcome is unknown: reconcile before anything else."""

    safe_error_code: str


@dataclass(frozen=True)
class Replay:
    """Send again with the same idempotency key (replay-safe provider only)."""

    safe_error_code: str


@dataclass(frozen=True)
class LookupAgainAt:
    """The lookup itself failed: ask again at ``when``."""

    when: datetime
    safe_error_code: str


_ATTEMPT_OUTCOME = {
    ProviderOutcomeKind.SUCCEEDED: AttemptOutcome.SUCCEEDED,
    ProviderOutcomeKind.FAILED_RETRYABLE: AttemptOutcome.FAILED_RETRYABLE,
    ProviderOutcomeKind.FAILED_TERMINAL: AttemptOutcome.FAILED_TERMINAL,
    ProviderOutcomeKind.OUTCOME_UNKNOWN: AttemptOutcome.OUTCOME_UNKNOWN,
    ProviderOutcomeKind.NOT_FOUND: AttemptOutcome.OUTCOME_UNKNOWN,
}


def attempt_outcome_for(outcome: ProviderOutcome) -> AttemptOutcome:
    """The remote-attempt outcome recording ``outcome``."""
    return _ATTEMPT_OUTCOME[outcome.kind]


def _quarantine(code: str) -> Complete:
    return Complete(CommandState.QUARANTINED, CompletionOutcomeCode.OUTCOME_UNKNOWN, code)


def decide_after_attempt(
    attempt_number: int,
    outcome: ProviderOutcome,
    policy: CommandPolicy,
    *,
    now: datetime,
    rng: random.Random,
) -> Complete | RetryAt | Reconcile:
    """What one remote attempt's classified outcome means for the command."""
    match outcome.kind:
        case ProviderOutcomeKind.SUCCEEDED:
            return Complete(
                CommandState.SUCCEEDED,
                CompletionOutcomeCode.SUCCEEDED,
                "",
                outcome.result_digest,
            )
        case ProviderOutcomeKind.FAILED_TERMINAL:
            return Complete(
                CommandState.FAILED, CompletionOutcomeCode.FAILED, outcome.safe_error_code
            )
        case ProviderOutcomeKind.FAILED_RETRYABLE:
            if attempt_number >= policy.max_attempts:
                return Complete(
                    CommandState.FAILED, CompletionOutcomeCode.FAILED, "retry_budget_exhausted"
                )
            return RetryAt(now + policy.delay(attempt_number, rng), outcome.safe_error_code)
        case _:
            return Reconcile(outcome.safe_error_code or "outcome_unknown")


def decide_after_lookup(
    lookup: ProviderOutcome | None,
    *,
    replay_safe: bool,
    attempt_count: int,
    reconcile_attempts: int,
    policy: CommandPolicy,
    now: datetime,
    rng: random.Random,
) -> Complete | Replay | LookupAgainAt:
    """Reconcile an ``OUTCOME_UNKNOWN`` command through the provider (§15.3).

    Args:
        lookup: the provider's lookup answer, or None when it has no lookup.
        replay_safe: the provider deduplicates on the idempotency key.
        attempt_count: remote attempts made so far.
        reconcile_attempts: lookups made so far (before this one).
    """
    kind = None if lookup is None else lookup.kind
    if lookup is not None and kind is ProviderOutcomeKind.SUCCEEDED:
        return Complete(
            CommandState.SUCCEEDED, CompletionOutcomeCode.SUCCEEDED, "", lookup.result_digest
        )
    if lookup is not None and kind is ProviderOutcomeKind.FAILED_TERMINAL:
        return Complete(CommandState.FAILED, CompletionOutcomeCode.FAILED, lookup.safe_error_code)
    if lookup is None or kind is ProviderOutcomeKind.NOT_FOUND:
        # Absence is not proof the request never arrived (it may still be in flight);
        # only a deduplicating provider may see the same key again.
        if replay_safe and attempt_count < policy.max_attempts:
            return Replay("replayed_with_same_key")
        return _quarantine("outcome_unknown_quarantined")
    if reconcile_attempts + 1 >= policy.reconcile_max_attempts:
        return _quarantine("reconciliation_exhausted")
    return LookupAgainAt(
        now + policy.delay(reconcile_attempts + 1, rng), lookup.safe_error_code or "lookup_failed"
    )
