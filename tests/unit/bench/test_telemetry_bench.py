"""The telemetry-overhead bench runs end to end on SQLite: both modes really commit
steps, the on-mode really exports spans, the isolated hook cost and the state-scan line
are reported. No speed is asserted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import telemetry_bench
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
        "sqlite", f"sqlite+aiosqlite:///{tmp_path / 't.db'}", 1.0, rounds=2, min_round_s=0.5
    )
    out = capsys.readouterr().out
    assert figures["off"] > 0 and figures["on"] > 0
    assert 0 < figures["share"] < 1
    assert re.search(r"durable steps/s tracing\+metrics off / on +[\d.]+ / +[\d.]+", out), out
    assert re.search(
        r"overhead +[-+][\d.]+ % \(p25\.\.p75 [-+][\d.]+\.\.[-+][\d.]+, 2 rounds\)", out
    )
    assert "overhead" in figures and "cpu_change" in figures
    assert re.search(r"instrumentation per step \(isolated\) +[\d.]+ us", out), out
    spans = re.search(r"spans exported per committed step \(on\) +([\d.]+)", out)
    assert spans is not None and float(spans.group(1)) >= 1.0, out
    assert re.search(r"state scan: one pass over \d+ orgs", out), out


def test_paired_changes_are_per_round_and_summarised_by_median_and_quartiles() -> None:
    # A machine-wide slowdown in round two hits both modes: the paired change stays 10 %.
    off, on = [100.0, 50.0, 80.0], [90.0, 45.0, 72.0]
    changes = telemetry_bench._paired(off, on, slower=True)
    assert [round(c, 6) for c in changes] == [0.1, 0.1, 0.1]
    assert telemetry_bench._paired([2.0], [3.0], slower=False) == [0.5]
    assert telemetry_bench._paired([0.0], [1.0], slower=True) == [0.0]  # no off figure
    text = telemetry_bench._spread([0.01, 0.02, 0.03, 0.10])
    assert text.startswith("  +2.5 % (p25..p75 +1.7..+4.8, 4 rounds)"), text
