"""Tracing and metrics overhead on durable steps/s (issue 14 benchmark; target ≤ 5 %).

Prints, on SQLite and (when ``FLOW_TEST_MYSQL_URL`` is set) MariaDB, durable steps
committed per second (the 10-step Flow of ``bench/durable_bench.py``, one worker) in two
modes:

* **off** — what ``FLOW_OTEL_ENABLED=false`` gives (no tracer provider: every span is a
  no-op, no carrier is stored) and metric hooks that do nothing;
* **on** — an SDK tracer provider with a ``BatchSpanProcessor`` and an exporter that
  discards the batches (the export path minus the network), every metric hook counting
  and the ``/metrics`` endpoint serving.

One worker steps one org's runs for ``BENCH_TELEMETRY_SECONDS`` per mode (default
``max(4 * BENCH_SECONDS, 20)``), switching mode every quarter second (about one run's
10-step chain) — off/on, then on/off, … — so a machine-wide slowdown, the database's
growth and the runs' ages hit both modes alike. Runs are topped up between segments,
outside the measured windows.

The overhead is the *pooled* rate of each mode (all its
steps over all its stepping time): a slope of a few percent between the modes is
resolved by thousands of steps, where a median of ten two-second rounds of ~80 steps
each spread from -6 % to +19 %. Its 95 % interval is a bootstrap over the segment pairs;
the CPU per step is pooled the same way (``time.process_time`` over the stepping windows
only).
It also reports the instrumentation's own cost per step measured in isolation — the hooks
one step really makes (counted from the on-mode's counters), replayed in a tight loop —
as a share of the off-mode step time.
The authoritative-state scan is no per-step cost but a periodic reader: its line gives
one pass's duration over the bench's orgs and the share of one core it takes at the
default period (``FLOW_METRICS_STATE_MS``). Nothing is asserted; figures depend on the
machine.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.databases import on_each_database
from runtime_svc.kernel import FlowRunStateStore, RetryPolicy
from runtime_svc.observability import RuntimeStateSource, StepWatch
from runtime_svc.worker import Outcome
from services import db, migrate, telemetry
from services.metrics import FlowMetrics, install_metrics, metrics, start_metrics_server
from services.metrics_state import StateScan
from tests.integration.worker.support import make_worker, seed, start_run

__all__ = ["NullMetrics", "Pooled", "Segment", "pool", "run", "seconds_per_mode"]

_POLICY = RetryPolicy(lease_duration_ms=120_000)
#: Steps of the bench Flow's runs (``seed(mutations=10)``).
_STEPS_PER_RUN = 10

#: Length of one measured segment; the mode switches after each.
_SEGMENT_S = 0.25
#: The default FLOW_METRICS_STATE_MS, in seconds.
_STATE_PERIOD_S = 15.0
#: Bootstrap resamples of the segment pairs for the 95 % interval.
_RESAMPLES = 2000


def seconds_per_mode(seconds: float) -> float:
    """Stepping time per mode: ``BENCH_TELEMETRY_SECONDS``, else ``max(4 * seconds, 20)``."""
    configured = os.environ.get("BENCH_TELEMETRY_SECONDS")
    return float(configured) if configured else max(4 * seconds, 20.0)


@dataclass
class Segment:
    """One measured window of one mode: steps committed, wall and CPU seconds."""

    on: bool
    steps: int
    wall_s: float
    cpu_s: float


@dataclass(frozen=True)
class Pooled:
    """Both modes' pooled figures and the overhead with its bootstrap interval."""

    rate_off: float
    rate_on: float
    cpu_ms_off: float
    cpu_ms_on: float
    overhead: float
    overhead_low: float
    overhead_high: float
    cpu_change: float
    pairs: int


class _Discard(SpanExporter):
    """Counts and drops exported spans."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class NullMetrics(FlowMetrics):
    """:class:`FlowMetrics` whose hooks do nothing (the "off" mode's baseline)."""


def _noop(*_: Any, **__: Any) -> None:
    return None


for _name, _member in inspect.getmembers(FlowMetrics, inspect.isfunction):
    if not _name.startswith("_"):
        setattr(NullMetrics, _name, _noop)


@contextmanager
def _mode(on: bool, provider: TracerProvider, instance: FlowMetrics) -> Iterator[None]:
    """Point ``services.telemetry.tracer`` and the process metrics at the mode's."""
    original_tracer, original_metrics = telemetry.tracer, metrics()
    noop = trace.NoOpTracer()
    telemetry.tracer = (  # type: ignore[assignment]
        (lambda: provider.get_tracer(telemetry.TRACER_NAME)) if on else (lambda: noop)
    )
    install_metrics(instance if on else NullMetrics())
    try:
        yield
    finally:
        telemetry.tracer = original_tracer  # type: ignore[assignment]
        install_metrics(original_metrics)


async def _bench(
    label: str,
    url: str,
    seconds: float,
    *,
    segment_s: float = _SEGMENT_S,
) -> dict[str, float]:
    await migrate.upgrade(url, "runtime_svc")
    engine = db.create_engine(url, pool_size=8)
    exporter = _Discard()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    instance = FlowMetrics()
    server = start_metrics_server("127.0.0.1", 0, instance)
    scan = StateScan(engine, [RuntimeStateSource()], instance=instance)
    try:
        segments = await _segments(engine, provider, instance, seconds, segment_s)
        provider.force_flush()
        spans = exporter.spans
        steps_on = sum(s.steps for s in segments if s.on)
        hooks_s = _hook_cost(instance, provider, steps_on, spans)
        scan_started = time.perf_counter()
        orgs = await scan.scan_once()
        scan_s = time.perf_counter() - scan_started
    finally:
        server.stop()
        provider.shutdown()
        await engine.dispose()
    pooled = pool(segments)
    share = hooks_s * pooled.rate_off
    print(
        f"{label:<8} durable steps/s tracing+metrics off / on  {pooled.rate_off:8.1f} /"
        f" {pooled.rate_on:8.1f}   overhead {pooled.overhead * 100:+5.1f} %"
        f" (95 % interval {pooled.overhead_low * 100:+.1f}..{pooled.overhead_high * 100:+.1f},"
        f" {pooled.pairs} pairs of {segment_s:g}s; target <= 5 %)"
    )
    print(
        f"{label:<8} CPU ms per step off / on                 {pooled.cpu_ms_off:8.2f} /"
        f" {pooled.cpu_ms_on:8.2f}   change   {pooled.cpu_change * 100:+5.1f} %"
    )
    print(
        f"{label:<8} instrumentation per step (isolated)      {hooks_s * 1e6:8.1f} us"
        f"   = {share * 100:5.2f} % of an off-mode step"
    )
    print(f"{label:<8} spans exported per committed step (on)    {spans / max(steps_on, 1):8.2f}")
    print(
        f"{label:<8} state scan: one pass over {orgs} orgs        {scan_s * 1000:8.1f} ms"
        f"   = {scan_s / (_STATE_PERIOD_S) * 100:5.2f} % of a core at the default period"
    )
    return {
        "off": pooled.rate_off,
        "on": pooled.rate_on,
        "share": share,
        "overhead": pooled.overhead,
        "overhead_high": pooled.overhead_high,
        "cpu_change": pooled.cpu_change,
    }


async def _segments(
    engine: AsyncEngine,
    provider: TracerProvider,
    instance: FlowMetrics,
    seconds: float,
    segment_s: float,
) -> list[Segment]:
    """Step one org's runs with one worker, alternating the mode every ``segment_s``
    (pair ``i`` runs off→on when ``i`` is even, on→off when odd) until each mode had
    ``seconds``; runs are started between segments, never inside a measured window."""
    store = FlowRunStateStore(engine, policy=_POLICY)
    seeded = await seed(engine, mutations=10, pure_step=False)
    worker = make_worker(engine, store, owner="telemetry", batch_size=1)
    started = 0
    committed = 0
    rate = 100.0  # steps/s guess until the warm-up measured one

    async def top_up(needed: float) -> None:
        nonlocal started
        while started * _STEPS_PER_RUN - committed < needed:
            await start_run(store, seeded, label=f"t{started}")
            started += 1

    async def segment(on: bool) -> Segment:
        nonlocal committed
        await top_up(rate * segment_s * 2 + 2 * _STEPS_PER_RUN)
        with _mode(on, provider, instance):
            steps = 0
            cpu = time.process_time()
            begun = time.perf_counter()
            while time.perf_counter() - begun < segment_s:
                done = await worker.run_batch(seeded.org)
                steps += sum(1 for o in done if o is Outcome.COMMITTED)
                if not done:
                    break
            wall = time.perf_counter() - begun
            cpu = time.process_time() - cpu
        committed += steps
        return Segment(on, steps, wall, cpu)

    warm = [await segment(False), await segment(True)]  # schema, caches, plan: unmeasured
    rate = max(sum(s.steps for s in warm) / max(sum(s.wall_s for s in warm), 1e-9), 1.0)
    segments: list[Segment] = []
    for i in range(max(1, math.ceil(seconds / segment_s))):
        for on in (False, True) if i % 2 == 0 else (True, False):
            segments.append(await segment(on))
    return segments


def pool(segments: Sequence[Segment], *, resamples: int = _RESAMPLES) -> Pooled:
    """Pooled steps/s and CPU per step of each mode, the overhead ``(off - on) / off``
    and its 95 % bootstrap interval over the segment pairs (each pair is one off and one
    on segment measured back to back, so resampling pairs keeps the drift paired)."""
    pairs = [(segments[i], segments[i + 1]) for i in range(0, len(segments) - 1, 2)]
    off_on = [(a, b) if not a.on else (b, a) for a, b in pairs]

    def figures(chosen: Sequence[tuple[Segment, Segment]]) -> tuple[float, float]:
        off_steps = sum(o.steps for o, _ in chosen)
        on_steps = sum(n.steps for _, n in chosen)
        off_rate = off_steps / max(sum(o.wall_s for o, _ in chosen), 1e-9)
        on_rate = on_steps / max(sum(n.wall_s for _, n in chosen), 1e-9)
        return off_rate, on_rate

    rate_off, rate_on = figures(off_on)
    cpu_off = sum(o.cpu_s for o, _ in off_on) / max(sum(o.steps for o, _ in off_on), 1)
    cpu_on = sum(n.cpu_s for _, n in off_on) / max(sum(n.steps for _, n in off_on), 1)
    overhead = (rate_off - rate_on) / rate_off if rate_off > 0 else 0.0
    rng = random.Random(14)
    samples: list[float] = []
    for _ in range(resamples if len(off_on) > 1 else 0):
        off_r, on_r = figures([off_on[rng.randrange(len(off_on))] for _ in off_on])
        samples.append((off_r - on_r) / off_r if off_r > 0 else 0.0)
    if samples:
        samples.sort()
        low = samples[int(0.025 * (len(samples) - 1))]
        high = samples[int(0.975 * (len(samples) - 1))]
    else:
        low = high = overhead
    return Pooled(
        rate_off=rate_off,
        rate_on=rate_on,
        cpu_ms_off=cpu_off * 1000,
        cpu_ms_on=cpu_on * 1000,
        overhead=overhead,
        overhead_low=low,
        overhead_high=high,
        cpu_change=(cpu_on - cpu_off) / cpu_off if cpu_off > 0 else 0.0,
        pairs=len(off_on),
    )


def _hook_cost(instance: FlowMetrics, provider: TracerProvider, steps: float, spans: int) -> float:
    """Seconds the tracing and metric hooks of one committed step cost, replayed in a
    loop: the spans and database transactions per step are what the on-mode counted."""
    steps = max(steps, 1.0)
    tx = sum(
        instance.registry.get_sample_value("nexus_flow_db_transactions_total", {"outcome": o})
        or 0.0
        for o in ("committed", "rolled_back", "commit_unknown")
    )
    tx_per_step = max(round(tx / steps), 1)
    spans_per_step = max(spans / steps, 1.0)
    watch = StepWatch("durable_mutation", "durable_orchestration", "BoundedMutation", None)
    with _mode(True, provider, instance):
        with telemetry.span("bench.run"):
            watch.trace_context = telemetry.current_carrier()
        loops = 2000
        started = time.perf_counter()
        for i in range(loops):
            with watch.attempt("run", "step", f"att{i}", 1) as finish:
                for _ in range(tx_per_step):
                    metrics().transaction_finished("committed")
                metrics().checkpoint_written(512)
                metrics().locks_acquired(0.001)
                metrics().step_transaction("durable_orchestration", "BoundedMutation", 0.002)
                for _ in range(int(spans_per_step) - 1):
                    with telemetry.span("bench.extra"):
                        telemetry.current_carrier()
                finish("committed")
        return (time.perf_counter() - started) / loops


async def _main(seconds: float) -> None:
    async def one(label: str, url: str) -> None:
        await _bench(label, url, seconds)

    await on_each_database("telemetry", one)


def run(seconds: float) -> None:
    """Print the overhead figures (:func:`seconds_per_mode` of stepping per mode)."""
    per_mode = seconds_per_mode(seconds)
    print(
        f"Telemetry overhead bench ({per_mode:.0f}s per mode in alternating {_SEGMENT_S:g}s"
        " segments, 1 worker; target overhead <= 5 %)"
    )
    asyncio.run(_main(per_mode))
