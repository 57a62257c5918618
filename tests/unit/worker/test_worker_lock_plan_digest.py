"""The worker's memoized lock-plan digest (its attempt evidence): always the plan's own
``LockPlan.digest()``, and a plan that differs in any digested part — a key, a key's
roles, the created keys — never gets another plan's digest."""

from __future__ import annotations

from runtime_svc.resources import LockPlan, LockRole, ResourceClass, ResourceKey
from runtime_svc.worker import loop


def _key(identity: str, cls: ResourceClass = ResourceClass.BUSINESS_RECORD) -> ResourceKey:
    return ResourceKey(cls, "Account", identity)


def test_the_memoized_digest_is_the_plans_digest_for_every_digested_difference() -> None:
    a, b = _key("rec_a"), _key("rec_b")
    plans = [
        LockPlan.of([(a, LockRole.RECORD)]),
        LockPlan.of([(b, LockRole.RECORD)]),  # another key
        LockPlan.of([(a, LockRole.RECORD), (a, LockRole.PARENT)]),  # another role set
        LockPlan.of([(a, LockRole.RECORD)], creates=[a]),  # a created key
        LockPlan.of([(a, LockRole.RECORD), (b, LockRole.PARENT)]),
        LockPlan.of([(a, LockRole.PARENT), (b, LockRole.RECORD)]),  # roles swapped
    ]
    digests = [p.digest() for p in plans]
    assert len(set(digests)) == len(plans)
    for _ in range(2):  # the second pass is answered from the memo
        assert [loop._lock_plan_digest(p) for p in plans] == digests
    # An equal plan built again (another object) has the same digest.
    assert loop._lock_plan_digest(LockPlan.of([(a, LockRole.RECORD)])) == digests[0]
    evidence = loop._lock_plan_evidence([plans[4]])
    assert evidence == {"lock_plan_digest": digests[4], "lock_plan_keys": 2}
    assert loop._lock_plan_evidence([]) is None


def test_the_memo_is_bounded() -> None:
    for i in range(loop._MAX_CACHED_LOCK_PLANS + 10):
        plan = LockPlan.of([(_key(f"rec_{i}"), LockRole.RECORD)])
        assert loop._lock_plan_digest(plan) == plan.digest()
    assert len(loop._LOCK_PLAN_DIGESTS) == loop._MAX_CACHED_LOCK_PLANS
