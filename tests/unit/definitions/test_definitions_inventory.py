"""Compile-only inventory rows and migration cohorts (§20.4, §20.7)."""

from __future__ import annotations

import pytest

from runtime_svc.compiler import ExecutionProfile, PlanCompileError, compile_plan
from runtime_svc.definitions import Cohort, inventory_row
from tests.unit.definitions import corpus


def _row(name: str):  # type: ignore[no-untyped-def]
    inputs = corpus.inputs(name)
    source = corpus.flow(name)
    try:
        outcome = compile_plan(source, inputs)
    except PlanCompileError as exc:
        outcome = exc  # type: ignore[assignment]
    return inventory_row(name, f"fv-{name}", source, inputs, outcome)


@pytest.mark.parametrize(
    ("name", "cohort", "profile"),
    [
        ("embedded_discount_transform", Cohort.EMBEDDED_BEFORE_SAVE, "embedded_before_save"),
        ("atomic_close_won", Cohort.SMALL_BOUNDED_ATOMIC, "bounded_atomic"),
        ("durable_send_email", Cohort.EXTERNAL_EFFECTS, "durable_orchestration"),
        ("durable_wait_time_fault_path", Cohort.TIME_WAITS, "durable_orchestration"),
        ("durable_wait_event_terminal", Cohort.PRODUCER_WAITS, "durable_orchestration"),
        ("durable_unbounded_loop", Cohort.LARGE_COMPLEX, "durable_orchestration"),
    ],
)
def test_profiles_and_cohorts(name: str, cohort: Cohort, profile: str) -> None:
    row = _row(name)
    assert row.compilable and row.profile is ExecutionProfile(profile)
    assert row.cohort is cohort
    assert row.estimated_step_count >= 1


def test_unbounded_loops_are_reported_unproven() -> None:
    assert not _row("durable_unbounded_loop").fanout_proven
    assert _row("atomic_close_won").fanout_proven


def test_a_rejected_flow_reports_reasons_and_unknown_capabilities() -> None:
    row = _row("reject_atomic_unknown_capability")
    assert not row.compilable and row.profile is None
    assert row.cohort is Cohort.METADATA_ONLY
    assert all(d.severity == "error" for d in row.diagnostics)
    assert any(d.blocker_chain == ("ActionCall sync",) for d in row.diagnostics)
    (unknown,) = row.unknown_capabilities
    assert unknown.startswith("action legacy_sync: unknown ") and "security" in unknown
    assert row.legacy_behaviors == ("legacy.run_atomically",)


def test_legacy_behaviour_is_named() -> None:
    assert (
        "legacy.atomic_mapped_to_durable" in _row("legacy_atomic_mapped_durable").legacy_behaviors
    )
    assert _row("embedded_discount_transform").legacy_behaviors == (
        "legacy.before_save_transient_interview",
    )
