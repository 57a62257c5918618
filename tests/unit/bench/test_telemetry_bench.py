"""The telemetry-overhead bench runs end to end on SQLite: both modes really commit
steps, the on-mode really exports spans, the isolated hook cost and the state-scan line
are reported; the pooled overhead and its bootstrap interval are computed right. No speed
is asserted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import telemetry_bench
from bench.telemetry_bench import Segment
from services.metrics import FlowMetrics


def test_null_metrics_hooks_do_nothing() -> None:
    null = telemetry_bench.NullMetrics()
    null.claim_won("durable_mutation", None)
    null.transaction_finished("committed")
    assert (
        null.registry.get_sample_value("nexus_flow_claims_total", {"lane": "durable_mutation"})
        is None
    )
    real = FlowMetrics()
    real.claim_won("durable_mutation", None)
    assert (
        real.registry.get_sample_value("nexus_flow_claims_total", {"lane": "durable_mutation"}) == 1
    )


async def test_the_telemetry_bench_reports_every_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = await telemetry_bench._bench(
        "sqlite", f"sqlite+aiosqlite:///{tmp_path / 't.db'}", 1.0, segment_s=0.25
    )
    out = capsys.readouterr().out
    assert figures["off"] > 0 and figures["on"] > 0
    assert 0 < figures["share"] < 1
    assert re.search(
        r"durable steps/s tracing\+metrics off / on +[\d.]+ / +[\d.]+   overhead +[-+][\d.]+ %"
        r" \(95 % interval [-+][\d.]+\.\.[-+][\d.]+, 4 pairs of 0\.25s",
        out,
    ), out
    assert "overhead_high" in figures and "cpu_change" in figures
    assert re.search(r"instrumentation per step \(isolated\) +[\d.]+ us", out), out
    spans = re.search(r"spans exported per committed step \(on\) +([\d.]+)", out)
    assert spans is not None and float(spans.group(1)) >= 1.0, out
    assert re.search(r"state scan: one pass over \d+ orgs", out), out


def _segments(pairs: list[tuple[float, float]], *, steps: int = 100) -> list[Segment]:
    """Pairs of (off seconds, on seconds) for ``steps`` steps each, order alternating."""
    out: list[Segment] = []
    for i, (off_s, on_s) in enumerate(pairs):
        off, on = Segment(False, steps, off_s, off_s / 2), Segment(True, steps, on_s, on_s / 2)
        out.extend((off, on) if i % 2 == 0 else (on, off))
    return out


def test_pooled_overhead_is_steps_over_time_per_mode_and_keeps_pairs_together() -> None:
    # A machine-wide slowdown in the second pair hits both modes: still a 10 % overhead
    # (each on-segment needs 1/0.9 of its off-segment's time for the same steps).
    pooled = telemetry_bench.pool(_segments([(1.0, 1.0 / 0.9), (3.0, 3.0 / 0.9)]))
    assert pooled.pairs == 2
    assert pooled.rate_off == pytest.approx(200 / 4.0)
    assert pooled.rate_on == pytest.approx(200 / (4.0 / 0.9))
    assert pooled.overhead == pytest.approx(0.1)
    assert pooled.overhead_low == pytest.approx(0.1) and pooled.overhead_high == pytest.approx(0.1)
    assert pooled.cpu_ms_off == pytest.approx(4.0 / 2 / 200 * 1000)
    assert pooled.cpu_change == pytest.approx(1 / 0.9 - 1)


def test_the_bootstrap_interval_widens_with_disagreeing_pairs() -> None:
    noisy = telemetry_bench.pool(_segments([(1.0, 0.8), (1.0, 1.2)] * 10))
    assert noisy.overhead == pytest.approx(0.0, abs=1e-9)
    assert noisy.overhead_low < -0.05 and noisy.overhead_high > 0.05
    steady = telemetry_bench.pool(_segments([(1.0, 1.01)] * 20))
    assert steady.overhead_high - steady.overhead_low < 1e-9


def test_seconds_per_mode_has_a_floor_and_an_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BENCH_TELEMETRY_SECONDS", raising=False)
    assert telemetry_bench.seconds_per_mode(3) == 20.0
    assert telemetry_bench.seconds_per_mode(10) == 40.0
    monkeypatch.setenv("BENCH_TELEMETRY_SECONDS", "7.5")
    assert telemetry_bench.seconds_per_mode(3) == 7.5
