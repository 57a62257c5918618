"""The pure outbox state machine: backoff, delivery budget, reconciliation, finalization."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from services.outbox.model import (
    PRE_FINAL_STATES,
    TERMINAL_STATES,
    AcceptedReceipt,
    Delivered,
    DeliveryPolicy,
    DeliveryState,
    Refused,
    RejectedReceipt,
    RetryLater,
    UnknownReceipt,
    backoff_delay,
    decide_after_delivery,
    decide_after_reconcile,
    terminal_state_for,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = DeliveryPolicy(
    max_attempts=3, base_delay_ms=100, max_delay_ms=1000, reconcile_max_attempts=2
)


def _deliver(attempts: int, result: object, **kw: object) -> object:
    args: dict[str, object] = {
        "reconciles": True,
        "finalizes": True,
        "now": NOW,
        "deadline": None,
        "rng": random.Random(1),
    }
    args.update(kw)
    return decide_after_delivery(attempts, result, POLICY, **args)  # type: ignore[arg-type]


def test_backoff_is_jittered_and_bounded() -> None:
    rng = random.Random(2)
    for retry in range(1, 12):
        cap = min(1000, 100 * 2 ** (retry - 1))
        for _ in range(20):
            delay = backoff_delay(POLICY, retry, rng)
            assert timedelta(milliseconds=cap / 2) <= delay <= timedelta(milliseconds=cap)


def test_delivered() -> None:
    t = _deliver(0, Delivered())
    assert (t.state, t.attempts, t.delivered, t.error_code) == (
        DeliveryState.DELIVERED,
        1,
        True,
        None,
    )


def test_retry_until_the_budget_then_reconcile() -> None:
    t = _deliver(0, RetryLater("unavailable"))
    assert t.state is DeliveryState.RETRYING and t.next_attempt_at > NOW
    last = _deliver(POLICY.max_attempts - 1, RetryLater("unavailable"))
    assert (last.state, last.next_attempt_at) == (DeliveryState.RECONCILING, NOW)


@pytest.mark.parametrize(
    ("reconciles", "finalizes", "expected"),
    [
        (True, True, DeliveryState.RECONCILING),
        (True, False, DeliveryState.RECONCILING),
        (False, True, DeliveryState.UNKNOWN),
        (False, False, DeliveryState.DEAD_LETTERED),
    ],
)
def test_exhaustion_depends_on_the_family(
    reconciles: bool, finalizes: bool, expected: DeliveryState
) -> None:
    assert _deliver(0, Refused("x"), reconciles=reconciles, finalizes=finalizes).state is expected


def test_a_passed_deadline_stops_retrying() -> None:
    t = _deliver(0, RetryLater("unavailable"), deadline=NOW - timedelta(seconds=1))
    assert (t.state, t.error_code) == (DeliveryState.RECONCILING, "delivery_deadline_passed")


def test_reconciliation_outcomes() -> None:
    rng = random.Random(3)
    kw = {"now": NOW, "deadline": None, "rng": rng}
    assert (
        decide_after_reconcile(3, AcceptedReceipt(), POLICY, **kw).state is DeliveryState.DELIVERED
    )  # type: ignore[arg-type]
    assert (
        decide_after_reconcile(3, RejectedReceipt(), POLICY, **kw).state is DeliveryState.REJECTED
    )  # type: ignore[arg-type]
    assert (
        decide_after_reconcile(3, UnknownReceipt("c"), POLICY, **kw).state is DeliveryState.UNKNOWN
    )  # type: ignore[arg-type]
    again = decide_after_reconcile(3, RetryLater("lost"), POLICY, **kw)  # type: ignore[arg-type]
    assert again.state is DeliveryState.RECONCILING and again.next_attempt_at > NOW
    spent = decide_after_reconcile(4, RetryLater("lost"), POLICY, **kw)  # type: ignore[arg-type]
    assert (spent.state, spent.error_code) == (DeliveryState.UNKNOWN, "reconciliation_exhausted")
    late = decide_after_reconcile(3, RetryLater("lost"), POLICY, now=NOW, deadline=NOW, rng=rng)
    assert late.state is DeliveryState.UNKNOWN


def test_only_a_finalizer_leaves_a_pre_final_state() -> None:
    assert terminal_state_for(DeliveryState.REJECTED) is DeliveryState.HANDOFF_REJECTED
    assert terminal_state_for(DeliveryState.UNKNOWN) is DeliveryState.DEAD_LETTERED
    for state in set(DeliveryState) - PRE_FINAL_STATES:
        with pytest.raises(ValueError):
            terminal_state_for(state)
    assert not PRE_FINAL_STATES & TERMINAL_STATES


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        DeliveryPolicy(max_attempts=0)
    with pytest.raises(ValueError):
        DeliveryPolicy(base_delay_ms=10, max_delay_ms=5)
