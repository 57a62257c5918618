"""The pure admission policy (§16.2, §16.3): budgets in the versioned runtime policy, the
applicable bound, pressure levels and the per-pass / in-flight limits, the deficit
scheduler. No database."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from runtime_svc.admission.budgets import (
    AdmissionPolicy,
    AdmissionSubject,
    Budget,
    PressureThresholds,
    admission_notes,
)
from runtime_svc.admission.pressure import (
    COLD_LANES,
    MUTATION_LANES,
    OutcomeWindow,
    PressureSignals,
    mutation_inflight_limit,
    pass_limits,
    pressure_level,
)
from runtime_svc.admission.scheduler import DeficitScheduler
from runtime_svc.compiler import QueueClass, RuntimePolicy
from runtime_svc.definitions.policy import (
    DEFAULT_POLICY_DOCUMENT,
    normalize_policy_document,
    policy_document_digest,
)
from services.errors import InvalidArgumentError
from services.metrics import FlowMetrics

ALL_LANES = [q.value for q in QueueClass]


def test_the_six_lanes_of_16_1_are_one_enum_split_into_mutation_and_cold() -> None:
    assert ALL_LANES == [
        "embedded_foreground",
        "bounded_atomic_foreground",
        "durable_mutation",
        "dependency_wakeup",
        "effect_completion",
        "maintenance_reconciliation",
    ]
    assert set(ALL_LANES) > MUTATION_LANES | COLD_LANES
    assert not MUTATION_LANES & COLD_LANES


def _doc(admission: dict[str, Any]) -> dict[str, Any]:
    return {**DEFAULT_POLICY_DOCUMENT, "admission": admission}


def test_budgets_live_in_the_versioned_policy_and_change_its_digest() -> None:
    plain = normalize_policy_document(DEFAULT_POLICY_DOCUMENT)
    assert "admission" not in plain  # old documents keep their digest
    doc = normalize_policy_document(
        _doc({"org": {"max_inflight": 3, "weight": 2}, "flows": {"F": {"max_concurrent_runs": 2}}})
    )
    assert doc["admission"]["org"] == {"max_inflight": 3, "weight": 2}
    assert policy_document_digest(doc) != policy_document_digest(plain)
    policy = RuntimePolicy.from_dict({**doc, "version": 2})
    assert policy.admission_policy.concurrent_runs_limit("F") == 2
    assert RuntimePolicy.from_dict({**plain, "version": 1}).admission is None


@pytest.mark.parametrize(
    "admission",
    [
        {"bogus": 1},
        {"org": {"max_inflight": -1}},
        {"org": {"weight": 0}},
        {"lanes": {"no_such_lane": {"max_inflight": 1}}},
        {"profiles": {"nope": {"max_inflight": 1}}},
        {"flow_versions": {"NoVersion": {"max_inflight": 1}}},
        {"flows": {"F": {"max_concurrent_runs": 0}}},
        {"lanes": {"durable_mutation": {"max_concurrent_runs": 1}}},
        {"reserved_share": 1.0},
        {"reserved_share": "half"},
        {"pressure": {"retry_rate": 0}},
        {"pressure": {"pool_saturation": 1.5}},
        {"pressure": {"unknown_signal": 1}},
        {"org": "x"},
        {"records": {"Account": {"max_concurrent_runs": 0}}},
        {"records": {"Account": {}}},
        {"records": {"Account": {"max_inflight": 1}}},
        {"records": {"Account": 1}},
        {"records": []},
    ],
)
def test_a_malformed_admission_section_is_invalid_argument(admission: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        normalize_policy_document(_doc(admission))
    assert err.value.field_path == "policy"


def test_per_record_limits_are_read_by_object_and_absent_ones_keep_the_digest() -> None:
    without = normalize_policy_document(_doc({"flows": {"F": {"max_concurrent_runs": 2}}}))
    assert "records" not in without["admission"]  # published before the key: same digest
    doc = normalize_policy_document(
        _doc(
            {"records": {"Account": {"max_concurrent_runs": 1}, "Case": {"max_concurrent_runs": 3}}}
        )
    )
    assert doc["admission"]["records"] == {
        "Account": {"max_concurrent_runs": 1},
        "Case": {"max_concurrent_runs": 3},
    }
    policy = RuntimePolicy.from_dict({**doc, "version": 2}).admission_policy
    assert policy.record_runs_limit("Account") == 1
    assert policy.record_runs_limit("Case") == 3
    assert policy.record_runs_limit("Contact") is None


def test_the_applicable_bound_is_the_smallest_scope_and_names_it() -> None:
    policy = AdmissionPolicy.from_dict(
        {
            "org": {"max_inflight": 10},
            "lanes": {"durable_mutation": {"max_inflight": 6}},
            "profiles": {"durable_orchestration": {"max_inflight": 8}},
            "flows": {"Sync": {"max_inflight": 4}},
            "flow_versions": {"Sync@2": {"max_inflight": 3}},
            "object_classes": {"Account": {"max_inflight": 5}},
        }
    )
    subject = AdmissionSubject(
        "o", "durable_mutation", "durable_orchestration", "Sync", 2, ("Account",)
    )
    assert policy.bound_for(subject).limit == 3
    assert policy.bound_for(subject).scope == "flow_version:Sync@2"
    other = AdmissionSubject("o", "dependency_wakeup", "durable_orchestration", "Sync", 1, ())
    assert (policy.bound_for(other).limit, policy.bound_for(other).scope) == (4, "flow:Sync")
    assert AdmissionPolicy().bound_for(other).limit is None
    notes = dict(
        admission_notes(policy, "o", "Sync", 2, "durable_orchestration", ["durable_mutation"], [])
    )
    assert "at most 3 in flight (flow_version:Sync@2)" in notes["admission.lanes[durable_mutation]"]
    assert notes["admission.flows[Sync]"] == "concurrent runs: unlimited"


def test_pressure_is_the_largest_signal_capped_at_one() -> None:
    t = PressureThresholds()
    assert pressure_level(PressureSignals(), t) == 0.0
    one_busy = PressureSignals(pool_in_use=1, pool_size=8)  # below the soft start
    assert pressure_level(one_busy, t) == 0.0
    busy = PressureSignals(pool_in_use=9, pool_size=16)  # 0.5625 / 0.75 = 3/4 of it
    assert pressure_level(busy, t) == pytest.approx(0.5)
    storm = PressureSignals(pool_in_use=3, pool_size=8, retry_rate=0.9)
    assert pressure_level(storm, t) == 1.0
    for name in ("lock_wait_rate", "deadlock_rate", "lease_expiry_rate"):
        value = getattr(t, name) * 2
        assert pressure_level(PressureSignals(**{name: value}), t) == 1.0
    # Queue age is exported, never a throttle (an old queue would only get older).
    old_queue = PressureSignals(queue_age_seconds=t.queue_age_seconds * 2)
    assert old_queue.levels(t)["queue_age_seconds"] == 1.0
    assert pressure_level(old_queue, t) == 0.0


def test_pressure_throttles_mutation_lanes_and_never_the_cold_lanes_reserved_share() -> None:
    lanes = ["durable_mutation", "dependency_wakeup", "effect_completion"]
    calm = pass_limits(lanes, capacity=8, pressure=0.0, reserved_share=0.25)
    assert calm == {"durable_mutation": 8, "dependency_wakeup": 8, "effect_completion": 8}
    half = pass_limits(lanes, capacity=8, pressure=0.5, reserved_share=0.25)
    assert half["durable_mutation"] == 4
    full = pass_limits(lanes, capacity=8, pressure=1.0, reserved_share=0.25)
    assert full == {"durable_mutation": 0, "dependency_wakeup": 2, "effect_completion": 2}
    # Even the smallest pass keeps one cold admission.
    assert (
        pass_limits(lanes, capacity=1, pressure=1.0, reserved_share=0.0)["dependency_wakeup"] == 1
    )
    capped = pass_limits(
        lanes, capacity=8, pressure=0.0, reserved_share=0.25, lane_caps={"durable_mutation": 2}
    )
    assert capped["durable_mutation"] == 2


@pytest.mark.parametrize("budget", [1, 2, 5, 8, 32])
def test_mutations_in_flight_never_take_the_reserved_share_and_only_shrink(budget: int) -> None:
    limits = [mutation_inflight_limit(budget, p / 10, 0.25) for p in range(11)]
    assert limits == sorted(limits, reverse=True)  # more pressure never admits more
    assert limits[0] <= budget - 1  # at least one connection stays for cold lanes
    assert limits[-1] == 0


def test_the_outcome_window_forgets_old_outcomes_so_a_stopped_lane_resumes() -> None:
    now = [0.0]
    window = OutcomeWindow(10, horizon_s=30, clock=lambda: now[0])
    for _ in range(5):
        window.add("deadlock")
    assert window.rate("deadlock") == 1.0
    now[0] = 29.0
    assert window.rate("deadlock") == 1.0
    now[0] = 31.0  # no new outcome arrived: the storm's evidence expires
    assert window.rate("deadlock") == 0.0 and len(window) == 0
    with pytest.raises(ValueError):
        OutcomeWindow(5, horizon_s=0)


def test_the_outcome_window_is_bounded_and_decays() -> None:
    window = OutcomeWindow(10)
    for _ in range(10):
        window.add("retry")
    assert window.rate("retry") == 1.0
    for _ in range(10):
        window.add("ok")
    assert window.rate("retry") == 0.0 and len(window) == 10
    with pytest.raises(ValueError):
        OutcomeWindow(0)


def test_deficit_scheduler_gives_each_visit_its_weighted_quantum_and_no_more() -> None:
    sched = DeficitScheduler(quantum=3)
    assert sched.visit("hot") == 3
    sched.charge("hot", 3)
    assert sched.visit("hot") == 3  # spent: no more than one quantum next time
    assert sched.visit("cold") == 3
    assert sched.visit("cold") == 6  # unspent credit banks up to one extra quantum
    assert sched.visit("cold") == 6
    sched.idle("cold")
    assert sched.credit("cold") == 0
    assert sched.visit("heavy", weight=2) == 6
    sched.charge("unknown")  # harmless
    with pytest.raises(ValueError):
        DeficitScheduler(0)


def test_budget_round_trips() -> None:
    policy = AdmissionPolicy(
        org=Budget(4, 2),
        flows={"F": Budget(None, 1, 3)},
        reserved_share=0.5,
    )
    assert AdmissionPolicy.from_dict(policy.to_dict()) == policy


def test_admission_metrics_count_decisions_and_expose_pressure() -> None:
    m = FlowMetrics(CollectorRegistry())
    m.admission_decided("durable_mutation", "pressure")
    m.admission_decided("durable_mutation", "pressure")
    m.admission_sampled({"pool_saturation": 0.5, "retry_rate": 1.0})
    sample = m.registry.get_sample_value
    labels = {"lane": "durable_mutation", "decision": "pressure"}
    assert sample("nexus_flow_admission_decisions_total", labels) == 2
    assert sample("nexus_flow_admission_pressure", {"signal": "retry_rate"}) == 1.0
