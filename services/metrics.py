"""Prometheus metrics of one process (spec §19 "Required metrics"; STYLE 17).

Two kinds of metric, both on the process's ``/metrics`` endpoint (``FLOW_METRICS_PORT``,
:func:`start_metrics_server`; every process has its own — API, worker-only and owner
replicas alike — and a runtime that supervises worker processes merges theirs into its
own, labelled ``worker_process``, :mod:`services.metrics_merge`):

* **events**, counted where they happen by one-line hooks in the hot paths (a claim won
  or lost, a retry, a lease expiry, a deadlock, a checkpoint's size, a wake, a provider
  call …): counters ``*_total`` and histograms ``*_seconds`` / ``*_bytes``;
* **authoritative state** (run counts by state, queue depth and oldest age by lane,
  pending dependencies, outbox and command backlogs, projection divergence, dual
  ownership): gauges published by the bounded periodic scan of
  :mod:`services.metrics_state` — derived from the database, never from log lines, so
  an alert on them reads the truth (§19 "Alerts must be based on authoritative state").

Labels are low-cardinality codes only — lane, state, profile, step kind, producer
family, owner kind, outcome, reason — never a run, step, record or org id. Every label
value passes through :func:`label`, which maps anything outside the expected shape (or
outside a closed set) to ``other``.

Why ``prometheus-client`` rather than the OpenTelemetry Prometheus exporter: it is the
reference implementation of the exposition format the alerts are written against, a
counter increment is a lock and an add (the hooks sit in every step's path), custom
collectors expose database-derived gauges atomically at scrape time, and its HTTP server
runs in a thread of its own — a scrape is answered even while the event loop is busy.
Traces stay with OpenTelemetry (:mod:`services.telemetry`).

One :class:`FlowMetrics` per process, created at import and replaceable once at start
(:func:`install_metrics`, also what tests use); hooks call :func:`metrics` so hot
modules need no plumbing, the same shape as OpenTelemetry's global provider.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.metrics_merge import ChildSource, MergedRegistry

__all__ = [
    "LANES",
    "FlowMetrics",
    "MetricsServer",
    "StateFamily",
    "StateGauges",
    "install_metrics",
    "label",
    "metrics",
    "seconds_since",
    "start_metrics_server",
]

log = logging.getLogger(__name__)

#: The admission lanes (§16.1 queue classes) a ``lane`` label may take.
LANES = frozenset(
    {
        "embedded_foreground",
        "bounded_atomic_foreground",
        "durable_mutation",
        "dependency_wakeup",
        "effect_completion",
        "maintenance_reconciliation",
    }
)
_LABEL_RE = re.compile(r"^[A-Za-z0-9_.:/-]{1,48}$")
_OTHER = "other"

_FAST = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_SLOW = (0.05, 0.25, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0, 604800.0)
_BYTES = (256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0)


def label(value: object, allowed: Iterable[str] | None = None) -> str:
    """A safe, low-cardinality label value: ``value`` when it is a short code (and in
    ``allowed``, when given), else ``other``."""
    text = str(value) if value is not None else ""
    if allowed is not None:
        return text if text in allowed else _OTHER
    return text if _LABEL_RE.match(text) else _OTHER


def seconds_since(moment: datetime | None, now: datetime | None = None) -> float | None:
    """Seconds from ``moment`` to ``now`` (default: the wall clock), never negative;
    None when ``moment`` is None. Naive datetimes are UTC (the storage convention)."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    end = now or datetime.now(UTC)
    if end.tzinfo is None:
        end = end.replace(tzinfo=UTC)
    return max((end - moment).total_seconds(), 0.0)


@dataclass(frozen=True)
class StateFamily:
    """One gauge family published by the state scan."""

    name: str
    documentation: str
    labels: tuple[str, ...] = ()


class StateGauges(Collector):
    """Database-derived gauges, swapped atomically per scan pass and read at scrape time
    (a scrape never sees a half-updated family)."""

    def __init__(self, families: Sequence[StateFamily] = ()) -> None:
        self._families: dict[str, StateFamily] = {f.name: f for f in families}
        self._values: Mapping[str, Mapping[tuple[str, ...], float]] = {}
        self._lock = threading.Lock()

    def declare(self, families: Iterable[StateFamily]) -> None:
        """Add families (exposed with no sample until a scan publishes one)."""
        with self._lock:
            for family in families:
                self._families.setdefault(family.name, family)

    def publish(self, values: Mapping[str, Mapping[tuple[str, ...], float]]) -> None:
        """Replace every published value (families missing from ``values`` read empty)."""
        frozen = {name: dict(samples) for name, samples in values.items()}
        with self._lock:
            self._values = frozen

    def value(self, name: str, labels: tuple[str, ...] = ()) -> float | None:
        """The published value of one sample (tests and the bench read it)."""
        with self._lock:
            return self._values.get(name, {}).get(labels)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            families, values = list(self._families.values()), self._values
        for family in families:
            gauge = GaugeMetricFamily(family.name, family.documentation, labels=list(family.labels))
            for labels, value in sorted(values.get(family.name, {}).items()):
                gauge.add_metric(list(labels), value)
            yield gauge


class FlowMetrics:
    """Every metric of the three services on one registry (see the module docstring).

    Args:
        registry: the registry to register on (default: a new one with the process,
            platform and GC collectors).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                registry.register(collector)
        self.registry = r = registry
        #: Supervised worker processes whose metrics this process's endpoint merges in
        #: (``services.metrics_merge``; ``runtime_svc.processes`` adds its pool).
        self.child_sources: list[ChildSource] = []
        self.state = StateGauges()
        r.register(self.state)

        # --- scheduler: claims, leases, fences (§12) --------------------------------------
        self.claims = Counter("nexus_flow_claims", "Step claims won.", ["lane"], registry=r)
        self.claim_conflicts = Counter(
            "nexus_flow_claim_conflicts",
            "Claims lost to another claimer or a concurrent transition.",
            ["lane", "reason"],
            registry=r,
        )
        self.queue_age = Histogram(
            "nexus_flow_queue_age_seconds",
            "Time a step waited in its lane from due (run_after) to claim.",
            ["lane"],
            buckets=_SLOW,
            registry=r,
        )
        self.lease_expiries = Counter(
            "nexus_flow_lease_expiries",
            "Expired step leases recovered by the sweep (§12.4).",
            registry=r,
        )
        self.stale_fence_rollbacks = Counter(
            "nexus_flow_stale_fence_rollbacks",
            "Attempts abandoned because their fence was lost (business writes rolled back).",
            ["lane"],
            registry=r,
        )
        # --- admission and backpressure (§16) ----------------------------------------------
        self.admission_decisions = Counter(
            "nexus_flow_admission_decisions",
            "Admission decisions on claim candidates, before any business connection.",
            ["lane", "decision"],
            registry=r,
        )
        self.admission_pressure = Gauge(
            "nexus_flow_admission_pressure",
            "Pressure level (0..1) by §16.2 signal, as admission last sampled it.",
            ["signal"],
            registry=r,
        )
        # --- steps and their transactions -------------------------------------------------
        self.step_attempts = Counter(
            "nexus_flow_step_attempts",
            "Finished step attempts by outcome.",
            ["lane", "outcome"],
            registry=r,
        )
        self.step_duration = Histogram(
            "nexus_flow_step_duration_seconds",
            "Step attempt duration from claim to its recorded outcome, by plan step kind.",
            ["lane", "profile", "step_kind"],
            buckets=_FAST,
            registry=r,
        )
        self.transaction_duration = Histogram(
            "nexus_flow_step_transaction_duration_seconds",
            "Duration of a step's business transaction (BEGIN to COMMIT), by plan step kind.",
            ["profile", "step_kind"],
            buckets=_FAST,
            registry=r,
        )
        self.retries = Counter(
            "nexus_flow_step_retries",
            "Step retries scheduled after a proven rollback or a retryable failure.",
            ["lane", "reason"],
            registry=r,
        )
        self.retry_exhausted = Counter(
            "nexus_flow_retry_budget_exhausted",
            "Steps whose retry budget was exhausted (terminal failure).",
            ["lane"],
            registry=r,
        )
        # --- database -------------------------------------------------------------------
        self.db_transactions = Counter(
            "nexus_flow_db_transactions",
            "Database transactions by outcome: committed, rolled_back (any error, "
            "including a proven rollback at COMMIT) or commit_unknown (ambiguous).",
            ["outcome"],
            registry=r,
        )
        self._transactions_by_outcome: dict[str, Counter] = {}
        self.db_deadlocks = Counter(
            "nexus_flow_db_deadlocks",
            "Transactions rolled back by a deadlock or write conflict (retried whole).",
            registry=r,
        )
        self.db_lock_wait_timeouts = Counter(
            "nexus_flow_db_lock_wait_timeouts",
            "Statements that timed out waiting for a row lock.",
            registry=r,
        )
        self.lock_wait = Histogram(
            "nexus_flow_lock_wait_seconds",
            "Time a step spent acquiring its business locks in canonical order.",
            buckets=_FAST,
            registry=r,
        )
        # --- checkpoints ------------------------------------------------------------------
        self.checkpoint_size = Histogram(
            "nexus_flow_checkpoint_size_bytes",
            "Canonical size of each checkpoint context written.",
            buckets=_BYTES,
            registry=r,
        )
        self.checkpoint_rejections = Counter(
            "nexus_flow_checkpoint_serialization_failures",
            "Checkpoints refused: not JSON, too large, or carrying credential material.",
            ["reason"],
            registry=r,
        )
        # --- waits (§14) ----------------------------------------------------------------
        self.dependency_age = Histogram(
            "nexus_flow_dependency_age_seconds",
            "Age of a dependency when it resolved (wait entered to resolution).",
            ["producer"],
            buckets=_SLOW,
            registry=r,
        )
        self.wake_latency = Histogram(
            "nexus_flow_wake_latency_seconds",
            "Notification (signal received, timer due) to resolution of the dependency.",
            ["producer"],
            buckets=_SLOW,
            registry=r,
        )
        self.missing_producers = Counter(
            "nexus_flow_dependency_missing_producers",
            "Dependencies expired because their producer kind is not registered.",
            registry=r,
        )
        self.wake_signals = Counter(
            "nexus_flow_wake_signals",
            "Wake signals submitted, by producer family and result (new/duplicate/stale).",
            ["producer", "result"],
            registry=r,
        )
        # --- effects (§15) and the outbox -------------------------------------------------
        self.effect_submit_latency = Histogram(
            "nexus_flow_effect_submit_latency_seconds",
            "EffectSubmit commit (outbox enqueue) to the owner's durable acceptance.",
            ["owner_kind"],
            buckets=_SLOW,
            registry=r,
        )
        self.effect_completion_latency = Histogram(
            "nexus_flow_effect_completion_latency_seconds",
            "EffectSubmit commit to the resolution of its completion dependency.",
            buckets=_SLOW,
            registry=r,
        )
        self.outbox_deliveries = Counter(
            "nexus_flow_outbox_deliveries",
            "Outbox delivery and reconciliation attempts by family and result.",
            ["family", "result"],
            registry=r,
        )
        self.outbox_delivery_latency = Histogram(
            "nexus_flow_outbox_delivery_latency_seconds",
            "Enqueue to acknowledged delivery of an outbox message.",
            ["family"],
            buckets=_SLOW,
            registry=r,
        )
        self.provider_calls = Counter(
            "nexus_flow_effect_provider_calls",
            "Provider calls of the effect owner by owner kind and outcome.",
            ["owner_kind", "outcome"],
            registry=r,
        )
        self.provider_call_duration = Histogram(
            "nexus_flow_effect_provider_call_seconds",
            "Duration of one provider call (submit or lookup).",
            ["owner_kind", "call"],
            buckets=_FAST,
            registry=r,
        )
        self.handoffs = Counter(
            "nexus_flow_effect_handoffs",
            "Owner-side AcceptHandoff/RejectIfUnaccepted decisions.",
            ["decision"],
            registry=r,
        )
        # --- supervisor → worker-process hints (services.supervisor_link) -----------------
        self.process_hints = Counter(
            "nexus_flow_worker_process_hints",
            "Wake hints a supervisor relayed to its worker processes (sent, dropped: no "
            "live child could take it) and a worker process received.",
            ["event"],
            registry=r,
        )
        # --- the state scan itself --------------------------------------------------------
        self.state_scan_duration = Histogram(
            "nexus_flow_state_scan_duration_seconds",
            "Duration of one pass of the authoritative-state scan.",
            buckets=_FAST,
            registry=r,
        )
        self.state_scan_errors = Counter(
            "nexus_flow_state_scan_errors",
            "State-scan passes that failed (the previous values stay published).",
            registry=r,
        )
        self.state_scan_timestamp = Gauge(
            "nexus_flow_state_scan_timestamp_seconds",
            "Unix time of the last completed state-scan pass (alert when it stops moving).",
            registry=r,
        )

    # --- hooks (one line each at the call sites) ----------------------------------------

    def claim_won(self, lane: str, run_after: datetime | None) -> None:
        """A claim committed; ``run_after`` is when the step became due."""
        lane = label(lane, LANES)
        self.claims.labels(lane).inc()
        waited = seconds_since(run_after)
        if waited is not None:
            self.queue_age.labels(lane).observe(waited)

    def admission_decided(self, lane: str, decision: str) -> None:
        """A candidate was admitted or deferred (``decision``: its safe code)."""
        self.admission_decisions.labels(label(lane, LANES), label(decision)).inc()

    def admission_sampled(self, levels: Mapping[str, float]) -> None:
        """The pressure levels admission last computed, by signal."""
        for signal, level in levels.items():
            self.admission_pressure.labels(label(signal)).set(level)

    def claim_lost(self, lane: str, reason: str) -> None:
        self.claim_conflicts.labels(label(lane, LANES), label(reason)).inc()

    def attempt_finished(
        self, lane: str, profile: str, step_kind: str, outcome: str, seconds: float
    ) -> None:
        """An attempt ended with ``outcome`` after ``seconds`` (claim to outcome)."""
        lane = label(lane, LANES)
        self.step_attempts.labels(lane, label(outcome)).inc()
        self.step_duration.labels(lane, label(profile), label(step_kind)).observe(seconds)
        if outcome == "fence_lost":
            self.stale_fence_rollbacks.labels(lane).inc()

    def step_transaction(self, profile: str, step_kind: str, seconds: float) -> None:
        self.transaction_duration.labels(label(profile), label(step_kind)).observe(seconds)

    def retry_scheduled(self, lane: str, reason: str) -> None:
        self.retries.labels(label(lane, LANES), label(reason)).inc()

    def retry_budget_exhausted(self, lane: str) -> None:
        self.retry_exhausted.labels(label(lane, LANES)).inc()

    def leases_expired(self, count: int) -> None:
        if count > 0:
            self.lease_expiries.inc(count)

    def transaction_finished(self, outcome: str, error_class: str | None = None) -> None:
        """One database transaction ended (``services.db.transaction``)."""
        child = self._transactions_by_outcome.get(outcome)
        if child is None:  # a handful of outcomes: the labelled child is looked up once each
            child = self._transactions_by_outcome[outcome] = self.db_transactions.labels(outcome)
        child.inc()
        if error_class == "retryable_conflict":
            self.db_deadlocks.inc()
        elif error_class == "lock_wait_timeout":
            self.db_lock_wait_timeouts.inc()

    def locks_acquired(self, seconds: float) -> None:
        self.lock_wait.observe(seconds)

    def checkpoint_written(self, size_bytes: int) -> None:
        self.checkpoint_size.observe(size_bytes)

    def checkpoint_rejected(self, reason: str | None) -> None:
        self.checkpoint_rejections.labels(label(reason or "invalid")).inc()

    def dependency_resolved(
        self,
        producer: str,
        created_at: datetime | None,
        notified_at: datetime | None,
        *,
        effect: bool = False,
    ) -> None:
        """A dependency resolved: its age, the wake latency and, for an effect
        completion, the effect's end-to-end latency."""
        family = label(producer)
        age = seconds_since(created_at)
        if age is not None:
            self.dependency_age.labels(family).observe(age)
            if effect:
                self.effect_completion_latency.observe(age)
        latency = seconds_since(notified_at)
        if latency is not None:
            self.wake_latency.labels(family).observe(latency)

    def producer_missing(self) -> None:
        self.missing_producers.inc()

    def signal_submitted(self, producer: str, result: str) -> None:
        self.wake_signals.labels(label(producer), label(result)).inc()

    def outbox_attempt(
        self, family: str, result: str, enqueued_at: datetime | None, delivered: bool
    ) -> None:
        """One delivery/reconciliation attempt of ``family`` ended with ``result``."""
        self.outbox_deliveries.labels(label(family), label(result)).inc()
        if delivered:
            waited = seconds_since(enqueued_at)
            if waited is not None:
                self.outbox_delivery_latency.labels(label(family)).observe(waited)

    def effect_accepted(self, owner_kind: str, enqueued_at: datetime | None) -> None:
        """The owner durably accepted a handoff enqueued at ``enqueued_at``."""
        waited = seconds_since(enqueued_at)
        if waited is not None:
            self.effect_submit_latency.labels(label(owner_kind)).observe(waited)

    def provider_called(self, owner_kind: str, call: str, outcome: str, seconds: float) -> None:
        kind = label(owner_kind)
        self.provider_calls.labels(kind, label(outcome)).inc()
        self.provider_call_duration.labels(kind, label(call)).observe(seconds)

    def handoff_decided(self, decision: str) -> None:
        self.handoffs.labels(label(decision)).inc()

    def process_hint(self, event: str) -> None:
        self.process_hints.labels(label(event, ("sent", "dropped", "received"))).inc()


class _Current:
    """The process's :class:`FlowMetrics` (see the module docstring)."""

    metrics = FlowMetrics()


def metrics() -> FlowMetrics:
    """This process's metrics."""
    return _Current.metrics


def install_metrics(instance: FlowMetrics | None = None) -> FlowMetrics:
    """Make ``instance`` (default: a fresh one) this process's metrics; returns it."""
    _Current.metrics = instance if instance is not None else FlowMetrics()
    return _Current.metrics


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint (its own thread)."""

    server: WSGIServer
    thread: threading.Thread
    host: str
    port: int

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(
    host: str, port: int, instance: FlowMetrics | None = None
) -> MetricsServer:
    """Serve ``instance`` (default: :func:`metrics`) on ``host:port`` (0 = a free port),
    with the metrics of its supervised worker processes merged in (``child_sources``).

    Raises:
        OSError: the address cannot be bound.
    """
    target = instance or metrics()
    exposed = MergedRegistry(target.registry, target.child_sources)
    server, thread = start_http_server(port, addr=host, registry=exposed)
    bound = int(server.server_port)
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(server, thread, host, bound)
