"""Retry/lease policy (§12.1, §12.3, §13.4): bounded, jittered, deterministic backoff
whose jitter never goes below the ordinary floor; policy digests; lease tokens."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime_svc.kernel.policy import (
    DEFAULT_RETRY_POLICY,
    RetryPolicy,
    lease_token_digest,
    new_lease_token,
)
from services.digest import is_digest

policies = st.builds(
    RetryPolicy,
    max_attempts=st.integers(1, 20),
    base_delay_ms=st.integers(1, 10_000),
    max_delay_ms=st.integers(10_000, 10_000_000),
    jitter_ratio=st.floats(0.0, 0.99, allow_nan=False),
    lease_duration_ms=st.integers(1, 10**7),
    max_lease_expiries=st.integers(0, 10),
)


@given(policies, st.integers(1, 200), st.text(min_size=1, max_size=40))
def test_backoff_is_bounded_jittered_and_never_below_the_floor(
    policy: RetryPolicy, attempt: int, seed: str
) -> None:
    delay = policy.backoff_ms(attempt, seed)
    assert policy.floor_ms(attempt) <= delay <= policy.exponential_ms(attempt)
    assert delay <= policy.max_delay_ms
    assert delay == policy.backoff_ms(attempt, seed)  # reproducible from (seed, attempt)


@given(policies, st.integers(1, 60))
def test_exponential_delay_grows_until_the_cap(policy: RetryPolicy, attempt: int) -> None:
    assert policy.exponential_ms(attempt) <= policy.exponential_ms(attempt + 1)
    assert policy.exponential_ms(attempt) == min(
        policy.max_delay_ms, policy.base_delay_ms * 2 ** min(attempt - 1, 62)
    )


def test_jitter_depends_on_the_seed() -> None:
    delays = {DEFAULT_RETRY_POLICY.backoff_ms(3, f"step_{i}") for i in range(50)}
    assert len(delays) > 10


def test_policy_digest_covers_every_field() -> None:
    base = DEFAULT_RETRY_POLICY
    assert is_digest(base.digest(), "retry-policy")
    assert base.digest() == RetryPolicy().digest()
    for name, value in (
        ("max_attempts", 9),
        ("base_delay_ms", 7),
        ("max_delay_ms", 9_999_999),
        ("jitter_ratio", 0.5),
        ("lease_duration_ms", 1),
        ("max_lease_expiries", 9),
        ("max_retry_elapsed_ms", 1),
    ):
        assert dataclasses.replace(base, **{name: value}).digest() != base.digest(), name


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"base_delay_ms": 0},
        {"base_delay_ms": 10, "max_delay_ms": 5},
        {"jitter_ratio": 1.0},
        {"lease_duration_ms": 0},
        {"max_lease_expiries": -1},
    ],
)
def test_invalid_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        DEFAULT_RETRY_POLICY.exponential_ms(0)


def test_lease_tokens_are_unpredictable_and_stored_only_as_digests() -> None:
    tokens = {new_lease_token() for _ in range(100)}
    assert len(tokens) == 100 and all(len(t) >= 40 for t in tokens)
    token = next(iter(tokens))
    digest = lease_token_digest(token)
    assert is_digest(digest, "lease-token") and token not in digest
    assert len(digest) <= 100  # fits DIGEST_LEN (attempt) and TOKEN_LEN (step)
