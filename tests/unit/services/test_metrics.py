"""``services.metrics`` and the pure parts of ``services.metrics_state``: label hygiene,
the hooks, atomic state gauges, aggregation over orgs, and the HTTP endpoint."""

from __future__ import annotations

import urllib.request
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.metrics import (
    FlowMetrics,
    StateFamily,
    install_metrics,
    label,
    metrics,
    seconds_since,
    start_metrics_server,
)
from services.metrics_state import Sample, aggregate, due_age

#: The only label names any metric may carry: codes, never identifiers.
ALLOWED_LABELS = {
    "lane",
    "state",
    "profile",
    "step_kind",
    "reason",
    "outcome",
    "producer",
    "result",
    "family",
    "owner_kind",
    "call",
    "decision",
    "kind",
    "outbox",
    "le",  # histogram buckets
    # process/platform/gc collectors of prometheus-client
    "generation",
    "implementation",
    "major",
    "minor",
    "patchlevel",
    "version",
}


def _value(m: FlowMetrics, name: str, **labels: str) -> float:
    found = m.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def test_labels_are_short_codes_or_other() -> None:
    assert label("durable_mutation", {"durable_mutation"}) == "durable_mutation"
    assert label("run_0123", {"durable_mutation"}) == "other"
    assert label("BoundedMutation") == "BoundedMutation"
    assert label("has space") == "other"
    assert label("x" * 49) == "other"
    assert label(None) == "other"


def test_seconds_since_is_never_negative_and_treats_naive_as_utc() -> None:
    now = datetime(2026, 1, 1, 12, tzinfo=UTC)
    assert seconds_since(now - timedelta(seconds=5), now) == 5.0
    assert seconds_since(now + timedelta(seconds=5), now) == 0.0
    assert seconds_since(datetime(2026, 1, 1, 11, 59), now) == 60.0
    assert seconds_since(None, now) is None
    assert due_age(None, now) == 0.0


def test_hooks_move_their_metrics() -> None:
    m = FlowMetrics()
    m.claim_won("durable_mutation", datetime.now(UTC) - timedelta(seconds=3))
    m.claim_lost("durable_mutation", "lost_race")
    m.attempt_finished(
        "durable_mutation", "durable_orchestration", "BoundedMutation", "fence_lost", 0.2
    )
    m.retry_scheduled("bogus-lane-id-123", "deadlock")
    m.retry_budget_exhausted("durable_mutation")
    m.leases_expired(2)
    m.leases_expired(0)
    m.transaction_finished("rolled_back", "retryable_conflict")
    m.transaction_finished("rolled_back", "lock_wait_timeout")
    m.transaction_finished("commit_unknown", "outcome_unknown")
    m.checkpoint_written(2048)
    m.checkpoint_rejected("checkpoint_too_large")
    m.dependency_resolved(
        "effect_completion", datetime.now(UTC) - timedelta(seconds=9), None, effect=True
    )
    m.producer_missing()
    m.outbox_attempt("flow.effect.submit", "delivered", datetime.now(UTC), delivered=True)
    m.effect_accepted("email.smtp", datetime.now(UTC))
    m.provider_called("email.smtp", "submit", "succeeded", 0.01)
    assert _value(m, "nexus_flow_claims_total", lane="durable_mutation") == 1
    assert _value(m, "nexus_flow_queue_age_seconds_sum", lane="durable_mutation") >= 3
    assert (
        _value(m, "nexus_flow_claim_conflicts_total", lane="durable_mutation", reason="lost_race")
        == 1
    )
    assert _value(m, "nexus_flow_stale_fence_rollbacks_total", lane="durable_mutation") == 1
    assert _value(m, "nexus_flow_step_retries_total", lane="other", reason="deadlock") == 1
    assert _value(m, "nexus_flow_retry_budget_exhausted_total", lane="durable_mutation") == 1
    assert _value(m, "nexus_flow_lease_expiries_total") == 2
    assert _value(m, "nexus_flow_db_deadlocks_total") == 1
    assert _value(m, "nexus_flow_db_lock_wait_timeouts_total") == 1
    assert _value(m, "nexus_flow_db_transactions_total", outcome="commit_unknown") == 1
    assert _value(m, "nexus_flow_checkpoint_size_bytes_count") == 1
    assert (
        _value(
            m, "nexus_flow_checkpoint_serialization_failures_total", reason="checkpoint_too_large"
        )
        == 1
    )
    assert _value(m, "nexus_flow_effect_completion_latency_seconds_count") == 1
    assert _value(m, "nexus_flow_dependency_age_seconds_count", producer="effect_completion") == 1
    assert _value(m, "nexus_flow_dependency_missing_producers_total") == 1
    assert (
        _value(m, "nexus_flow_outbox_delivery_latency_seconds_count", family="flow.effect.submit")
        == 1
    )
    assert _value(m, "nexus_flow_effect_submit_latency_seconds_count", owner_kind="email.smtp") == 1
    assert (
        _value(
            m,
            "nexus_flow_effect_provider_calls_total",
            owner_kind="email.smtp",
            outcome="succeeded",
        )
        == 1
    )


def test_every_metric_follows_the_naming_and_label_rules() -> None:
    m = FlowMetrics()
    m.state.declare([StateFamily("nexus_flow_runs", "runs", ("state",))])
    m.state.publish({"nexus_flow_runs": {("Runnable",): 1.0}})
    names = set()
    for family in m.registry.collect():
        if family.name.startswith(("process_", "python_")):
            continue
        names.add(family.name)
        assert family.name.startswith("nexus_flow_"), family.name
        if family.type == "counter":
            assert not family.name.endswith("_total")  # the client appends it
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, (family.name, sample.labels)
    assert "nexus_flow_runs" in names


def test_state_gauges_swap_atomically_and_expose_declared_families_empty() -> None:
    m = FlowMetrics()
    m.state.declare(
        [StateFamily("nexus_flow_x", "x", ("state",)), StateFamily("nexus_flow_y", "y")]
    )
    families = {f.name: f for f in m.state.collect()}
    assert set(families) == {"nexus_flow_x", "nexus_flow_y"}
    assert families["nexus_flow_x"].samples == []
    m.state.publish({"nexus_flow_x": {("a",): 1.0, ("b",): 2.0}, "nexus_flow_y": {(): 7.0}})
    assert m.state.value("nexus_flow_x", ("b",)) == 2.0
    m.state.publish({"nexus_flow_y": {(): 8.0}})
    assert m.state.value("nexus_flow_x", ("a",)) is None
    assert m.state.value("nexus_flow_y") == 8.0


def test_aggregate_sums_counts_and_takes_the_oldest_age_over_a_zero_baseline() -> None:
    baseline = [
        Sample("runs", ("Runnable",), 0),
        Sample("runs", ("Waiting",), 0),
        Sample("age", (), 0, "max"),
    ]
    per_org = {
        "o1": [Sample("runs", ("Runnable",), 3), Sample("age", (), 5, "max")],
        "o2": [Sample("runs", ("Runnable",), 4), Sample("age", (), 9, "max")],
    }
    assert aggregate(baseline, per_org) == {
        "runs": {("Runnable",): 7, ("Waiting",): 0},
        "age": {(): 9},
    }
    assert aggregate(baseline, {}) == {"runs": {("Runnable",): 0, ("Waiting",): 0}, "age": {(): 0}}


def test_the_endpoint_serves_the_installed_metrics_in_text_format() -> None:
    previous = metrics()
    mine = install_metrics()
    try:
        assert metrics() is mine
        mine.claim_won("dependency_wakeup", None)
        server = start_metrics_server("127.0.0.1", 0)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
                body = r.read().decode()
        finally:
            server.stop()
        families = {f.name: f for f in text_string_to_metric_families(body)}
        claims = families["nexus_flow_claims"]
        assert [(s.labels, s.value) for s in claims.samples if s.name.endswith("_total")] == [
            ({"lane": "dependency_wakeup"}, 1.0)
        ]
        assert "process_resident_memory_bytes" in families
    finally:
        install_metrics(previous)


def test_a_taken_port_is_an_os_error() -> None:
    server = start_metrics_server("127.0.0.1", 0, FlowMetrics())
    try:
        with pytest.raises(OSError):
            start_metrics_server("127.0.0.1", server.port, FlowMetrics())
    finally:
        server.stop()
