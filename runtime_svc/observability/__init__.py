"""The runtime's telemetry: span and metric hooks of the hot paths (:mod:`.hooks`) and
the authoritative-state gauges (:mod:`.state`). See ``docs/operations.md``."""

from runtime_svc.observability.hooks import (
    ATTEMPT_SPAN,
    RESOLVE_SPAN,
    RUN_SPAN,
    StepWatch,
    run_trace_context,
    signal_trace_context,
    wait_resolved,
)
from runtime_svc.observability.state import (
    DIVERGENCE_KINDS,
    DUAL_OWNERSHIP_KINDS,
    RunFacts,
    RuntimeStateSource,
    classify_run,
)

__all__ = [
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
