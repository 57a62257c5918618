"""Resource keys, the one comparator and the lock-plan builder (§13.1, §13.2)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_svc.compiler.inputs import MetadataViewInput, RelationshipView
from runtime_svc.resources import (
    ORDERING_VERSION,
    LateResourceDiscoveryError,
    LockPlan,
    LockRole,
    ResourceClass,
    ResourceKey,
    business_key,
    canonical_order,
    history_key,
    is_canonical,
    plan_record_mutation,
)

# --- strategies -----------------------------------------------------------------------------

_names = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Zs", "Cc")),
    min_size=1,
    max_size=6,
).filter(lambda s: s == s.strip())
_keys = st.builds(
    ResourceKey,
    resource_class=st.sampled_from(list(ResourceClass)),
    object_or_namespace=st.sampled_from(["Account", "Contact", "a", "B", "é", "Z"]) | _names,
    record_identity=_names,
    partition=st.none() | st.sampled_from(["", "p1", "p2"]),
)


@settings(max_examples=150)
@given(st.lists(_keys, max_size=12), st.randoms(use_true_random=False))
def test_any_permutation_of_the_same_keys_sorts_identically(
    keys: list[ResourceKey], rnd: random.Random
) -> None:
    shuffled = list(keys)
    rnd.shuffle(shuffled)
    assert canonical_order(keys) == canonical_order(shuffled)
    # Repetition does not matter either: the order is a function of the key *set*.
    assert canonical_order(keys + shuffled) == canonical_order(keys)


@settings(max_examples=150)
@given(st.lists(_keys, max_size=12))
def test_class_order_is_respected_and_result_is_strictly_increasing(
    keys: list[ResourceKey],
) -> None:
    ordered = canonical_order(keys)
    assert len(ordered) == len(set(keys))
    classes = [k.resource_class for k in ordered]
    assert classes == sorted(classes)
    assert is_canonical(ordered)
    assert canonical_order(ordered) == ordered  # idempotent


@given(_keys, _keys)
def test_comparator_is_a_total_order(a: ResourceKey, b: ResourceKey) -> None:
    # Distinct keys never tie (antisymmetry): exactly one order comes out.
    assert canonical_order([a, b]) == canonical_order([b, a])
    if a != b:
        assert len(canonical_order([a, b])) == 2


def test_global_class_order_is_the_section_13_1_order() -> None:
    assert list(ResourceClass) == sorted(ResourceClass)
    assert [c.name for c in ResourceClass] == [
        "BUSINESS_RECORD",
        "HISTORY_SEQUENCE",
        "FLOW_ROOT",
        "FLOW_STEP",
        "FLOW_ATTEMPT",
        "FLOW_DEPENDENCY",
        "OUTBOX_LINK",
    ]
    mixed = [
        ResourceKey(ResourceClass.OUTBOX_LINK, "outbox", "m1"),
        ResourceKey(ResourceClass.FLOW_ROOT, "flow_run", "r1"),
        history_key("Account", "a1"),
        ResourceKey(ResourceClass.FLOW_STEP, "flow_step", "s1"),
        business_key("Contact", "c1"),
        ResourceKey(ResourceClass.FLOW_DEPENDENCY, "dep", "d1"),
        ResourceKey(ResourceClass.FLOW_ATTEMPT, "attempt", "t1"),
        business_key("Account", "a1"),
    ]
    assert [k.resource_class for k in canonical_order(mixed)] == [
        ResourceClass.BUSINESS_RECORD,
        ResourceClass.BUSINESS_RECORD,
        ResourceClass.HISTORY_SEQUENCE,
        ResourceClass.FLOW_ROOT,
        ResourceClass.FLOW_STEP,
        ResourceClass.FLOW_ATTEMPT,
        ResourceClass.FLOW_DEPENDENCY,
        ResourceClass.OUTBOX_LINK,
    ]


def test_row_identity_order_is_the_byte_order_of_the_indexes() -> None:
    # utf8mb4_bin compares UTF-8 bytes; code-point order is the same order.
    ids = ["b", "B", "a", "é", "z", "aa", "a0"]
    ordered = [k.record_identity for k in canonical_order(business_key("X", i) for i in ids)]
    assert ordered == sorted(ids, key=lambda s: s.encode("utf-8"))


def test_normalization_never_merges_distinct_identities() -> None:
    assert business_key("Account", "A") != business_key("Account", "a")
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    assert len(canonical_order([business_key("O", nfc), business_key("O", nfd)])) == 2


def test_normalization_of_optional_parts() -> None:
    blank = ResourceKey(ResourceClass.FLOW_STEP, "flow_step", "s1", partition="")
    assert blank.partition is None
    assert blank == ResourceKey(ResourceClass.FLOW_STEP, "flow_step", "s1")
    coerced = ResourceKey(100, "Account", "a1")  # type: ignore[arg-type]
    assert coerced.resource_class is ResourceClass.BUSINESS_RECORD
    assert coerced.ordering_version == ORDERING_VERSION
    unpartitioned, partitioned = (
        ResourceKey(ResourceClass.FLOW_STEP, "n", "i"),
        ResourceKey(ResourceClass.FLOW_STEP, "n", "i", partition="0"),
    )
    assert canonical_order([partitioned, unpartitioned]) == (unpartitioned, partitioned)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"object_or_namespace": ""}, ValueError),
        ({"record_identity": ""}, ValueError),
        ({"record_identity": " a1"}, ValueError),
        ({"object_or_namespace": "x" * 201}, ValueError),
        ({"record_identity": 7}, TypeError),
        ({"ordering_version": 0}, ValueError),
        ({"resource_class": 42}, ValueError),
    ],
)
def test_malformed_keys_are_refused(kwargs: dict[str, object], error: type[Exception]) -> None:
    base: dict[str, object] = {
        "resource_class": ResourceClass.BUSINESS_RECORD,
        "object_or_namespace": "Account",
        "record_identity": "a1",
    }
    with pytest.raises(error):
        ResourceKey(**{**base, **kwargs})  # type: ignore[arg-type]


def test_a_key_of_another_ordering_version_cannot_be_ordered() -> None:
    future = ResourceKey(ResourceClass.BUSINESS_RECORD, "Account", "a1", ordering_version=2)
    with pytest.raises(ValueError, match="ordering version 2"):
        canonical_order([future, business_key("Account", "a2")])


# --- lock plans -------------------------------------------------------------------------------

_VIEW = MetadataViewInput(
    digest="view",
    relationships=(
        # Declared child-first / in an arbitrary order on purpose: declaration order must
        # not leak into lock order.
        RelationshipView("Owner", "User", "Contact", "OwnerId", lock_parent=False),
        RelationshipView("Account", "Account", "Contact", "AccountId", lock_parent=True),
        RelationshipView("ParentAccount", "Account", "Account", "ParentId", lock_parent=True),
    ),
)


def test_plan_holds_record_lock_relevant_parents_and_history_in_canonical_order() -> None:
    plan = plan_record_mutation(
        _VIEW,
        "Contact",
        "c1",
        [("OwnerId", "u1"), ("AccountId", "a9"), ("Email", "x"), ("AccountId", None)],
    )
    assert plan.keys == (
        business_key("Account", "a9"),
        business_key("Contact", "c1"),
        history_key("Contact", "c1"),
    )
    assert plan.roles[business_key("Account", "a9")] == {LockRole.PARENT}
    assert plan.roles[business_key("Contact", "c1")] == {LockRole.RECORD}
    assert business_key("User", "u1") not in plan  # lookup that is not lock-relevant
    assert plan.creates == frozenset()


def test_reparenting_locks_both_parents_and_self_reference_is_one_lock() -> None:
    plan = plan_record_mutation(
        _VIEW, "Account", "a5", [("ParentId", "a7"), ("ParentId", "a1"), ("ParentId", "a5")]
    )
    assert plan.of_class(ResourceClass.BUSINESS_RECORD) == (
        business_key("Account", "a1"),
        business_key("Account", "a5"),
        business_key("Account", "a7"),
    )


def test_plans_in_opposite_declaration_orders_are_identical() -> None:
    a = plan_record_mutation(_VIEW, "Contact", "c1", [("AccountId", "a1")])
    b = plan_record_mutation(_VIEW, "Account", "a1", [])
    assert a.union(b).keys == b.union(a).keys
    assert a.union(b).digest() == b.union(a).digest()
    assert a.union(b).keys == (
        business_key("Account", "a1"),
        business_key("Contact", "c1"),
        history_key("Account", "a1"),
        history_key("Contact", "c1"),
    )
    # A row that is the parent in one plan and the record in the other keeps one position.
    assert a.union(b).roles[business_key("Account", "a1")] == {LockRole.PARENT, LockRole.RECORD}


def test_create_plan_and_late_discovery() -> None:
    plan = plan_record_mutation(_VIEW, "Contact", "c1", [("AccountId", "a1")], creates=True)
    assert plan.creates == {business_key("Contact", "c1")}
    plan.require(business_key("Account", "a1"))
    with pytest.raises(LateResourceDiscoveryError) as info:
        plan.require(business_key("Account", "a2"), LockRole.PARENT)
    err = info.value
    assert err.resource_key == business_key("Account", "a2")
    assert err.attributes["resource_class"] == "BUSINESS_RECORD"
    assert "a2" not in err.safe_message  # safe: class and object only


def test_lock_plan_refuses_non_canonical_keys() -> None:
    a, b = business_key("Account", "a1"), business_key("Account", "a2")
    with pytest.raises(ValueError, match="canonical"):
        LockPlan(keys=(b, a), roles={a: frozenset(), b: frozenset()})
    with pytest.raises(ValueError, match="canonical"):
        LockPlan(keys=(a, a), roles={a: frozenset()})
    with pytest.raises(ValueError, match="created"):
        LockPlan(keys=(a,), roles={a: frozenset()}, creates=frozenset({b}))
    h = history_key("Account", "a1")
    with pytest.raises(ValueError, match="business rows"):
        LockPlan.of([(h, LockRole.HISTORY)], creates=[h])


@settings(max_examples=100)
@given(st.lists(st.sampled_from(["a1", "a2", "a3", "c1", "c2"]), min_size=1, max_size=5))
def test_union_is_order_independent(ids: list[str]) -> None:
    plans = [plan_record_mutation(_VIEW, "Contact", i, [("AccountId", "a1")]) for i in ids]
    forward, backward = LockPlan(), LockPlan()
    for p in plans:
        forward = forward.union(p)
    for p in reversed(plans):
        backward = backward.union(p)
    assert forward == backward
    assert forward.digest() == backward.digest()


def test_record_keys_are_built_once_per_identity_and_still_validated() -> None:
    """``business_key``/``history_key`` are cached per (object, record): the same
    (frozen) key comes back, and a bad identity is refused on every call."""
    assert business_key("Account", "a1") is business_key("Account", "a1")
    assert history_key("Account", "a1") is history_key("Account", "a1")
    assert business_key("Account", "a1") != history_key("Account", "a1")
    for _ in range(2):
        with pytest.raises(ValueError, match="white space"):
            business_key("Account", " a1")
        with pytest.raises(ValueError, match="empty"):
            history_key("Account", "")
