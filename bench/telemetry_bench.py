"""Tracing and metrics overhead on durable steps/s (issue 14 benchmark; target ≤ 5 %).

Prints, on SQLite and (when ``FLOW_TEST_MYSQL_URL`` is set) MariaDB, durable steps
committed per second (the 10-step Flow of ``bench/durable_bench.py``, one worker) in two
modes, alternated round by round so drift hits both equally:

* **off** — what ``FLOW_OTEL_ENABLED=false`` gives (no tracer provider: every span is a
  no-op, no carrier is stored) and metric hooks that do nothing;
* **on** — an SDK tracer provider with a ``BatchSpanProcessor`` and an exporter that
  discards the batches (the export path minus the network), every metric hook counting
  and the ``/metrics`` endpoint serving.

After an unmeasured warm-up round, each round runs both modes back to back
(``BENCH_TELEMETRY_ROUNDS`` rounds, 10 by default, the order flipped every round, at
least two seconds per mode and round) and gives one *paired* change per figure —
``(off - on) / off`` of the steps/s, ``(on - off) / off`` of the process CPU time per
committed step, taken over the stepping window only (not the seeding of the round's
fresh org and runs). The report is the median of the paired changes with their
interquartile range (p25..p75): a machine-wide slowdown hits both halves of a pair, and
one unlucky round moves a median of ten little, where a ratio of two medians over six
sub-second rounds — CPU including each round's seeding — swung by ±15 % between
invocations.
On a shared machine the wall-clock rate still swings between rounds by far more than
the instrumentation costs, so it also reports the instrumentation's own cost per step
measured in isolation — the hooks one step really makes (counted from the on-mode's
counters), replayed in a tight loop — as a share of the off-mode step time: the figure
to compare with the 5 % target.
The authoritative-state scan is no per-step cost but a periodic reader: its line gives
one pass's duration over the bench's orgs and the share of one core it takes at the
default period (``FLOW_METRICS_STATE_MS``). Nothing is asserted; figures depend on the
machine.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from bench import durable_bench
from bench.databases import on_each_database
from runtime_svc.observability import RuntimeStateSource, StepWatch
from services import db, migrate, telemetry
from services.metrics import FlowMetrics, install_metrics, metrics, start_metrics_server
from services.metrics_state import StateScan

__all__ = ["NullMetrics", "run"]

_ROUNDS = max(2, int(os.environ.get("BENCH_TELEMETRY_ROUNDS", "10")))
#: Shortest measuring time per mode and round (a round of a few steps is noise).
_MIN_ROUND_S = 2.0
#: The default FLOW_METRICS_STATE_MS, in seconds.
_STATE_PERIOD_S = 15.0


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
    rounds: int = _ROUNDS,
    min_round_s: float = _MIN_ROUND_S,
) -> dict[str, float]:
    await migrate.upgrade(url, "runtime_svc")
    engine = db.create_engine(url, pool_size=8)
    exporter = _Discard()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    instance = FlowMetrics()
    server = start_metrics_server("127.0.0.1", 0, instance)
    scan = StateScan(engine, [RuntimeStateSource()], instance=instance)
    rates: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    steps_on = 0.0
    per_round = max(seconds / rounds, min_round_s)
    try:
        with _mode(False, provider, instance):  # warm-up (schema, caches, first org): unmeasured
            await durable_bench._steps_rate(engine, 1, min_round_s)
        for i in range(rounds):
            for on in (False, True) if i % 2 == 0 else (True, False):
                with _mode(on, provider, instance):
                    # CPU over the stepping window only: each round seeds a fresh org and
                    # its runs first, which is no per-step cost (and in the on-mode makes
                    # one accept span per run) — counted in, it swamped a round of a few
                    # dozen steps.
                    cost = await durable_bench._steps_rate(engine, 1, per_round)
                    if on:
                        steps_on += cost.steps_per_s * per_round
                rates[on].append(cost.steps_per_s)
                cpu[on].append(cost.cpu_ms / 1000)
        provider.force_flush()
        spans = exporter.spans
        hooks_s = _hook_cost(instance, provider, steps_on, spans)
        scan_started = time.perf_counter()
        orgs = await scan.scan_once()
        scan_s = time.perf_counter() - scan_started
    finally:
        server.stop()
        provider.shutdown()
        await engine.dispose()
    off, on_rate = statistics.median(rates[False]), statistics.median(rates[True])
    cpu_off, cpu_on = statistics.median(cpu[False]), statistics.median(cpu[True])
    rate_change = _paired(rates[False], rates[True], slower=True)
    cpu_change = _paired(cpu[False], cpu[True], slower=False)
    share = hooks_s * off
    print(
        f"{label:<8} durable steps/s tracing+metrics off / on  {off:8.1f} / {on_rate:8.1f}"
        f"   overhead {_spread(rate_change)}"
    )
    print(
        f"{label:<8} CPU ms per step off / on                 {cpu_off * 1000:8.2f} / "
        f"{cpu_on * 1000:8.2f}   change   {_spread(cpu_change)}"
    )
    print(
        f"{label:<8} instrumentation per step (isolated)      {hooks_s * 1e6:8.1f} us"
        f"   = {share * 100:5.2f} % of an off-mode step (target <= 5 %)"
    )
    print(f"{label:<8} spans exported per committed step (on)    {spans / max(steps_on, 1):8.2f}")
    print(
        f"{label:<8} state scan: one pass over {orgs} orgs        {scan_s * 1000:8.1f} ms"
        f"   = {scan_s / (_STATE_PERIOD_S) * 100:5.2f} % of a core at the default period"
    )
    return {
        "off": off,
        "on": on_rate,
        "share": share,
        "overhead": statistics.median(rate_change),
        "cpu_change": statistics.median(cpu_change),
    }


def _paired(off: list[float], on: list[float], *, slower: bool) -> list[float]:
    """Per-round relative changes of the on-mode against the same round's off-mode:
    ``(off - on) / off`` for a rate (``slower``: a positive value is a slowdown), else
    ``(on - off) / off`` (a positive value is a cost)."""
    return [
        ((a - b) if slower else (b - a)) / a for a, b in zip(off, on, strict=True) if a > 0
    ] or [0.0]


def _spread(changes: list[float]) -> str:
    """``median % (p25..p75, n rounds)`` of paired changes."""
    if len(changes) >= 2:
        q1, _, q3 = statistics.quantiles(changes, n=4, method="inclusive")
    else:
        q1 = q3 = changes[0]
    return (
        f"{statistics.median(changes) * 100:+6.1f} % (p25..p75 {q1 * 100:+.1f}..{q3 * 100:+.1f},"
        f" {len(changes)} rounds)"
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
    """Print the overhead figures (``seconds`` per mode, split over the rounds)."""
    per_round = max(seconds / _ROUNDS, _MIN_ROUND_S)
    print(
        f"Telemetry overhead bench ({_ROUNDS} paired rounds, {per_round:.1f}s per mode and"
        " round, order alternating; target overhead <= 5 %)"
    )
    asyncio.run(_main(seconds))
