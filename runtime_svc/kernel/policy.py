"""Retry and lease policy (§12.1, §12.3, §13.4) and lease-token helpers. Pure.

Backoff is bounded, jittered and exponential, and the jitter is *deterministic*: it is
derived from a seed (the step execution id) and the attempt number through
``services.digest``, so the ``RecoveryBackoffFloor`` stored on an attempt at claim time can
be recomputed and audited from the policy alone. For attempt ``n``::

    exponential(n) = min(max_delay_ms, base_delay_ms * 2 ** (n - 1))
    floor(n)       = ceil(exponential(n) * (1 - jitter_ratio))      # ordinary retry floor
    backoff(n, s)  = floor(n) + round((exponential(n) - floor(n)) * u(s, n)),  u in [0, 1)

so ``floor(n) <= backoff(n, s) <= max_delay_ms`` always holds.

Lease tokens are unpredictable (``secrets.token_urlsafe``); only their digest is stored
(``flow_step_executions.lease_token`` and ``flow_step_attempts.lease_token_digest``): a
database reader can correlate attempts but cannot forge the fence.
"""

from __future__ import annotations

import functools
import math
import secrets
from dataclasses import asdict, dataclass

from services.digest import parse_digest, versioned_digest

__all__ = [
    "DEFAULT_RETRY_POLICY",
    "RetryPolicy",
    "lease_token_digest",
    "new_lease_token",
]

_LEASE_TOKEN_BYTES = 32


@dataclass(frozen=True)
class RetryPolicy:
    """Retry/lease numbers selected at claim time; its digest is stored on the attempt.

    Attributes:
        max_attempts: attempts a step may start in total (first attempt included).
        base_delay_ms: exponential backoff base.
        max_delay_ms: cap of any backoff (bounded).
        jitter_ratio: share of the exponential delay that is jittered, in [0, 1).
        lease_duration_ms: claim/heartbeat lease; longer than the admitted step budget.
        max_lease_expiries: fenced lease expiries a step survives; one more is terminal.
        max_retry_elapsed_ms: retry budget measured from the step's creation (0: none).
    """

    max_attempts: int = 5
    base_delay_ms: int = 1_000
    max_delay_ms: int = 300_000
    jitter_ratio: float = 0.2
    lease_duration_ms: int = 60_000
    max_lease_expiries: int = 3
    max_retry_elapsed_ms: int = 0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not 0 < self.base_delay_ms <= self.max_delay_ms:
            raise ValueError("need 0 < base_delay_ms <= max_delay_ms")
        if not 0.0 <= self.jitter_ratio < 1.0:
            raise ValueError("jitter_ratio must be in [0, 1)")
        if self.lease_duration_ms < 1:
            raise ValueError("lease_duration_ms must be >= 1")
        if self.max_lease_expiries < 0 or self.max_retry_elapsed_ms < 0:
            raise ValueError("limits must not be negative")

    def digest(self) -> str:
        """``retry-policy/v1:sha256:…`` over every field (``RetryPolicyDigest``); a
        policy is immutable, so its digest is computed once (every claim stores it)."""
        return _policy_digest(self)

    def exponential_ms(self, attempt_number: int) -> int:
        """Un-jittered delay after attempt ``attempt_number`` (1-based), capped."""
        if attempt_number < 1:
            raise ValueError("attempt_number is 1-based")
        # Cap the exponent first: 2 ** 10_000 is a valid int but a silly one.
        exponent = min(attempt_number - 1, 62)
        return min(self.max_delay_ms, self.base_delay_ms * (1 << exponent))

    def floor_ms(self, attempt_number: int) -> int:
        """Ordinary retry floor of attempt ``attempt_number``: the low end of its jitter."""
        return math.ceil(self.exponential_ms(attempt_number) * (1.0 - self.jitter_ratio))

    def backoff_ms(self, attempt_number: int, seed: str) -> int:
        """Deterministic jittered delay in ``[floor_ms(n), exponential_ms(n)]``."""
        high = self.exponential_ms(attempt_number)
        low = self.floor_ms(attempt_number)
        return low + round((high - low) * _unit(seed, attempt_number))


DEFAULT_RETRY_POLICY = RetryPolicy()


@functools.lru_cache(maxsize=64)
def _policy_digest(policy: RetryPolicy) -> str:
    return versioned_digest("retry-policy", asdict(policy))


def _unit(seed: str, attempt_number: int) -> float:
    """A reproducible number in [0, 1) from ``(seed, attempt_number)``."""
    _, _, hex_digest = parse_digest(
        versioned_digest("retry-jitter", {"seed": seed, "attempt": attempt_number})
    )
    return int(hex_digest[:13], 16) / float(1 << 52)


def new_lease_token() -> str:
    """A fresh unpredictable lease token (held by the worker only)."""
    return secrets.token_urlsafe(_LEASE_TOKEN_BYTES)


def lease_token_digest(token: str) -> str:
    """The stored form of a lease token (``LeaseTokenDigest``)."""
    return versioned_digest("lease-token", token)
