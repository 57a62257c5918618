"""The runtime's pure telemetry logic: :func:`classify_run` (projection divergence and
dual ownership, row-local), the attempt watch's metrics and span, and the pinned exports
of ``runtime_svc.observability``."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import runtime_svc.observability as observability
from runtime_svc.kernel.states import RunState, StepState
from runtime_svc.kernel.tables import compatibility_status
from runtime_svc.observability import RunFacts, StepWatch, classify_run
from runtime_svc.observability.hooks import attempt_exhausted, attempt_retried
from services import telemetry
from services.metrics import FlowMetrics, install_metrics, metrics

V2, LEGACY = "FlowRuntimeV2", "LegacyInterpreter"


def facts(**kw: object) -> RunFacts:
    base: dict[str, object] = {
        "runtime_state": RunState.RUNNABLE.code,
        "interview_status": compatibility_status(RunState.RUNNABLE).code,
        "execution_owner": V2,
        "ownership_epoch": 1,
        "step_state": StepState.PENDING.code,
        "step_epoch": 1,
        "has_current_step": True,
    }
    base.update(kw)
    return RunFacts(**base)  # type: ignore[arg-type]


def test_a_healthy_run_shows_nothing() -> None:
    assert classify_run(facts()) == ([], [])
    for state in RunState:
        step = next(iter(sorted(_consistent(state))))
        healthy = facts(
            runtime_state=state.code,
            interview_status=compatibility_status(state).code,
            step_state=step.code,
        )
        assert classify_run(healthy) == ([], []), state


def _consistent(state: RunState) -> set[StepState]:
    from runtime_svc.kernel.tables import CONSISTENT_STEP_STATES

    return set(CONSISTENT_STEP_STATES[state])


@pytest.mark.parametrize(
    ("kw", "divergent"),
    [
        ({"interview_status": "Finished"}, ["compatibility_status"]),
        ({"interview_status": None}, ["compatibility_status"]),
        ({"step_state": StepState.SUCCEEDED.code}, ["root_step_state"]),
        ({"step_state": "NoSuchState"}, ["root_step_state"]),
        ({"runtime_state": "NoSuchState"}, ["compatibility_status"]),
    ],
)
def test_projection_divergence(kw: dict[str, object], divergent: list[str]) -> None:
    assert classify_run(facts(**kw))[0] == divergent


@pytest.mark.parametrize(
    ("kw", "dual"),
    [
        ({"execution_owner": "SomethingElse"}, ["unknown_owner"]),
        ({"ownership_epoch": 0, "step_epoch": 0}, ["v2_epoch_zero"]),
        ({"step_epoch": 2}, ["step_epoch_mismatch"]),
        (
            {
                "execution_owner": LEGACY,
                "ownership_epoch": 0,
                "step_epoch": None,
                "step_state": None,
                "has_current_step": False,
            },
            [],
        ),
        (
            {
                "execution_owner": LEGACY,
                "ownership_epoch": 3,
                "step_epoch": None,
                "step_state": None,
                "has_current_step": False,
            },
            ["legacy_epoch_nonzero"],
        ),
        (
            {"execution_owner": LEGACY, "ownership_epoch": 0, "step_epoch": 0},
            ["legacy_with_v2_lifecycle"],
        ),
    ],
)
def test_dual_ownership(kw: dict[str, object], dual: list[str]) -> None:
    assert classify_run(facts(**kw))[1] == dual


def test_kinds_are_the_published_label_sets() -> None:
    seen_divergent: set[str] = set()
    seen_dual: set[str] = set()
    for kw in (
        {"interview_status": "x"},
        {"step_state": StepState.FAILED.code},
        {"execution_owner": "x"},
        {"ownership_epoch": 0, "step_epoch": 0},
        {"step_epoch": 9},
        {"execution_owner": LEGACY, "ownership_epoch": 2},
    ):
        divergent, dual = classify_run(facts(**kw))
        seen_divergent.update(divergent)
        seen_dual.update(dual)
    assert seen_divergent <= set(observability.DIVERGENCE_KINDS)
    assert seen_dual <= set(observability.DUAL_OWNERSHIP_KINDS)


@pytest.fixture
def fresh() -> Iterator[FlowMetrics]:
    previous = metrics()
    yield install_metrics()
    install_metrics(previous)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "tracer", lambda: provider.get_tracer(telemetry.TRACER_NAME))
    yield exporter
    provider.shutdown()


def test_the_attempt_watch_continues_the_run_trace_and_counts_its_outcome(
    fresh: FlowMetrics, spans: InMemorySpanExporter
) -> None:
    with telemetry.span("StartRun"):
        run_context = observability.run_trace_context("run-1", "plan-1", "durable_orchestration")
    watch = StepWatch("durable_mutation", "durable_orchestration", "BoundedMutation", run_context)
    assert watch.trace_id == telemetry.trace_id_of(run_context)
    with watch.attempt("run-1", "step-1", "att-1", 1) as finish:
        attempt_retried("deadlock")
        finish("retry_scheduled")
    attempt_exhausted()  # outside an attempt: counted under lane "other"
    names = {s.name for s in spans.get_finished_spans()}
    assert names == {"StartRun", observability.RUN_SPAN, observability.ATTEMPT_SPAN}
    by_name = {s.name: s for s in spans.get_finished_spans()}
    attempt = by_name[observability.ATTEMPT_SPAN]
    accept = by_name[observability.RUN_SPAN]
    assert attempt.parent is not None and attempt.parent.span_id == accept.context.span_id
    assert attempt.attributes is not None
    assert attempt.attributes["nexus.flow.outcome"] == "retry_scheduled"
    assert attempt.attributes["nexus.flow.run_id"] == "run-1"
    r = fresh.registry
    assert r.get_sample_value("nexus_flow_claims_total", {"lane": "durable_mutation"}) == 1
    assert (
        r.get_sample_value(
            "nexus_flow_step_attempts_total",
            {"lane": "durable_mutation", "outcome": "retry_scheduled"},
        )
        == 1
    )
    assert (
        r.get_sample_value(
            "nexus_flow_step_retries_total", {"lane": "durable_mutation", "reason": "deadlock"}
        )
        == 1
    )
    assert r.get_sample_value("nexus_flow_retry_budget_exhausted_total", {"lane": "other"}) == 1


def test_an_attempt_left_without_an_outcome_is_an_error(
    fresh: FlowMetrics, spans: InMemorySpanExporter
) -> None:
    watch = StepWatch("effect_completion", "durable_orchestration", "EffectCompletion", None)
    assert watch.trace_id is None
    with pytest.raises(RuntimeError), watch.attempt("r", "s", "a", 1):
        raise RuntimeError("boom")
    (span,) = spans.get_finished_spans()
    assert span.parent is None  # no run context: a root of its own
    assert span.status.status_code.name == "ERROR"
    assert (
        fresh.registry.get_sample_value(
            "nexus_flow_step_attempts_total", {"lane": "effect_completion", "outcome": "error"}
        )
        == 1
    )


def test_exports_are_pinned() -> None:
    assert sorted(observability.__all__) == [
        "ATTEMPT_SPAN",
        "DIVERGENCE_KINDS",
        "DUAL_OWNERSHIP_KINDS",
        "RESOLVE_SPAN",
        "RUN_SPAN",
        "RunFacts",
        "RuntimeStateSource",
        "StepWatch",
        "classify_run",
        "run_trace_context",
        "signal_trace_context",
        "wait_resolved",
    ]
    for name in ("hooks", "state"):
        module = importlib.import_module(f"runtime_svc.observability.{name}")
        for exported in module.__all__:
            assert hasattr(module, exported), (name, exported)
