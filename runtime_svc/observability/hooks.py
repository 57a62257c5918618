"""Tracing and metric hooks of the runtime's hot paths, so that the worker, the kernel
and the wait engine each need one line per event (``services.telemetry``,
``services.metrics``).

* :class:`StepWatch` — one claim and attempt of the worker: the attempt's ``trace_id``
  (the run's trace, from ``flow_runs.trace_context``), the claim metrics, and the
  ``flow.step.attempt`` span, current while the step executes — so the catalog calls,
  record writes, wait commits and an EffectSubmit's outbox enqueue of the step all
  continue the run's trace;
* :func:`run_trace_context` — the ``flow.run.accept`` span of a new run (a child of
  ``StartRun`` / the record write that triggered it) and the carrier the run row keeps;
* :func:`wait_resolved` — the ``flow.wait.resolve`` span and the wait metrics;
* :func:`signal_trace_context` — the carrier a new wake signal keeps.

Span attributes are identifiers and codes only (``nexus.flow.*``); metric labels are
codes only (lane, profile, step kind, outcome).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime

from opentelemetry.trace import SpanKind, Status, StatusCode

from runtime_svc.admission.events import note_retry
from services.metrics import metrics
from services.telemetry import current_carrier, parent_of, span, trace_id_of

__all__ = [
    "ATTEMPT_SPAN",
    "RESOLVE_SPAN",
    "RUN_SPAN",
    "StepWatch",
    "attempt_exhausted",
    "attempt_retried",
    "run_trace_context",
    "signal_trace_context",
    "wait_resolved",
]

#: Span names (the trace test and the operations guide name them).
RUN_SPAN = "flow.run.accept"
ATTEMPT_SPAN = "flow.step.attempt"
RESOLVE_SPAN = "flow.wait.resolve"

#: The attempt the current task executes (task-local: concurrent attempts never mix).
_CURRENT: ContextVar[StepWatch | None] = ContextVar("nexus_flow_attempt", default=None)

#: Worker outcomes that are not errors of the step.
_OK_OUTCOMES = frozenset({"committed", "retry_scheduled", "already_committed", "not_eligible"})


@dataclass
class StepWatch:
    """Times one candidate from its claim to its outcome (see the module docstring).

    Attributes:
        lane: the step's queue class.
        profile: the run's execution profile.
        step_kind: the plan step kind.
        trace_context: the run's stored carrier.
    """

    lane: str
    profile: str
    step_kind: str
    trace_context: str | None
    run_after: datetime | None = None
    _started_ns: int = field(default_factory=time.time_ns)
    _started: float = field(default_factory=time.perf_counter)

    @property
    def trace_id(self) -> str | None:
        """The run's trace id — what the claim stores on the attempt (§19)."""
        return trace_id_of(self.trace_context)

    def lost(self, reason: str) -> None:
        """The claim was not won."""
        metrics().claim_lost(self.lane, reason)

    @contextmanager
    def attempt(
        self, flow_run_id: str, step_execution_id: str, attempt_id: str, attempt_number: int
    ) -> Iterator[_Finish]:
        """The ``flow.step.attempt`` span of a won claim, current for the block; call
        the yielded function with the outcome."""
        metrics().claim_won(self.lane, self.run_after)
        finish = _Finish()
        with span(
            ATTEMPT_SPAN,
            parent=self.trace_context,
            kind=SpanKind.CONSUMER,
            start_time=self._started_ns,
            attributes={
                "nexus.flow.run_id": flow_run_id,
                "nexus.flow.step_execution_id": step_execution_id,
                "nexus.flow.attempt_id": attempt_id,
                "nexus.flow.attempt_number": attempt_number,
                "nexus.flow.step_kind": self.step_kind,
                "nexus.flow.lane": self.lane,
                "nexus.flow.profile": self.profile,
            },
        ) as current:
            token = _CURRENT.set(self)
            try:
                yield finish
            finally:
                _CURRENT.reset(token)
                outcome = finish.outcome or "error"
                current.set_attribute("nexus.flow.outcome", outcome)
                if outcome not in _OK_OUTCOMES:
                    current.set_status(Status(StatusCode.ERROR, outcome))
                metrics().attempt_finished(
                    self.lane,
                    self.profile,
                    self.step_kind,
                    outcome,
                    time.perf_counter() - self._started,
                )


def attempt_retried(reason: str) -> None:
    """The current attempt's rollback scheduled a retry (``reason``: its safe code)."""
    watch = _CURRENT.get()
    metrics().retry_scheduled(watch.lane if watch else "", reason)
    note_retry(reason)  # the admission controller's lock-wait/deadlock/retry rates


def attempt_exhausted() -> None:
    """The current attempt's rollback exhausted the step's retry budget."""
    watch = _CURRENT.get()
    metrics().retry_budget_exhausted(watch.lane if watch else "")


class _Finish:
    """Records the outcome of the attempt block."""

    outcome: str | None = None

    def __call__(self, outcome: str) -> None:
        self.outcome = outcome


def run_trace_context(flow_run_id: str, plan_id: str, profile: str) -> str | None:
    """Start (and end) the ``flow.run.accept`` span of a new run as a child of the current
    context (the ``StartRun`` RPC, the record write of an after-save trigger) or as a new
    root; returns the carrier the run row keeps (None when tracing is off)."""
    with span(
        RUN_SPAN,
        attributes={
            "nexus.flow.run_id": flow_run_id,
            "nexus.flow.plan_id": plan_id,
            "nexus.flow.profile": profile,
        },
    ):
        return current_carrier()


def signal_trace_context() -> str | None:
    """The carrier a new wake signal keeps: the producer's current span (the
    ``SubmitWakeSignal`` RPC, the step whose record write signalled)."""
    return current_carrier()


def wait_resolved(
    *,
    flow_run_id: str,
    dependency_id: str,
    producer_kind: str,
    family: str,
    created_at: datetime | None,
    notified_at: datetime | None,
    signal_trace: str | None = None,
) -> None:
    """A dependency resolved: the wait metrics and a ``flow.wait.resolve`` span — a child
    of the notifying request (``SubmitWakeSignal``, a record write) or, when the
    resolution runs in a sweep, of the span that produced the signal (its stored trace
    context)."""
    metrics().dependency_resolved(
        family, created_at, notified_at, effect=family == "effect_completion"
    )
    with span(
        RESOLVE_SPAN,
        parent=parent_of(None, signal_trace),
        attributes={
            "nexus.flow.run_id": flow_run_id,
            "nexus.flow.dependency_id": dependency_id,
            "nexus.flow.producer_kind": producer_kind,
            "nexus.flow.producer_family": family,
        },
    ):
        pass
