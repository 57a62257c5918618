"""The durable-wait bench runs end to end on SQLite with a small population: its wakes
really resolve and claim waiting runs, its clones really are waiting runs the reconciler
probes, and every figure is reported. No speed is asserted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import wait_bench


async def test_the_wait_bench_measures_real_wakes_and_sweeps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await wait_bench._bench("sqlite", f"sqlite+aiosqlite:///{tmp_path / 'w.db'}", (20, 60), 3)
    out = capsys.readouterr().out
    assert re.search(r"reconciler sweep,\s+20 waiting: .* 21 probes \(batch 100\)", out), out
    assert re.search(r"reconciler sweep,\s+60 waiting: .* 61 probes \(batch 100\)", out), out
    assert re.search(r"wake latency,\s+60 waiting: p50 +\d", out), out
    assert re.search(r"wake p99 ratio 60 / 20 waiting: +\d", out), out
    # Where the time went: the three commits' phases, CPU and GC per wake, the slowest.
    phases = r"phases p50/p99 ms: signal [\d.]+/[\d.]+, resolution [\d.]+/[\d.]+, "
    assert re.search(phases + r"(ledger [\d.]+/[\d.]+, )?claim\+running [\d.]+/", out), out
    assert re.search(r"CPU per wake p50/p99 [\d.]+/[\d.]+ ms; GC in a wake", out), out
    assert "slow wake" in out
    # Acceptance (signal + request-ledger row), then match, resolution and the ledger
    # row's completion in one fresh transaction; the worker claims the candidate the
    # resolution's hint carries (no candidate read) and moves it to Running in the same
    # transaction (the fused claim, ADR 0003): 2 + 1.
    assert "cost per wake: accept+resolve 2 transactions" in out
    assert "claim+running 1 transactions" in out
    # Every measured wake left the population again; the clones (and the template) wait.
    assert "pending dependencies at the end: 61" in out
