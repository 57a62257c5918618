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
    """The hinted path (``BENCH_WAIT_PRECLAIM=0``: a process without a local worker)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'w.db'}"
    await wait_bench._bench("sqlite", url, (20, 60), 3, preclaim=False)
    out = capsys.readouterr().out
    assert re.search(r"reconciler sweep,\s+20 waiting: .* 21 probes \(batch 100\)", out), out
    assert re.search(r"reconciler sweep,\s+60 waiting: .* 61 probes \(batch 100\)", out), out
    assert re.search(r"wake latency,\s+60 waiting: p50 +\d.*pre-claimed 0 of 3", out), out
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
    assert "cost per wake (hinted): accept+resolve 2 transactions" in out
    assert "claim+running 1 transactions" in out
    # Every measured wake left the population again; the clones (and the template) wait.
    assert "pending dependencies at the end: 61" in out


async def test_the_wait_bench_measures_the_preclaimed_wake(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The path of a runtime process with a local worker with room (ADR 0007): every
    wake is pre-claimed — Running at the resolution's commit, no claim transaction."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'w.db'}"
    await wait_bench._bench("sqlite", url, (20, 60), 3, preclaim=True)
    out = capsys.readouterr().out
    assert re.search(r"wake latency,\s+20 waiting: p50 +\d.*pre-claimed 3 of 3", out), out
    assert re.search(r"wake latency,\s+60 waiting: p50 +\d.*pre-claimed 3 of 3", out), out
    phases = r"phases p50/p99 ms: signal [\d.]+/[\d.]+, resolution\+claim\+running [\d.]+/"
    assert re.search(phases, out), out
    # Acceptance, then match, resolution, claim with Running and the ledger row's
    # completion in one fresh transaction: 2 transactions, none for the claim.
    assert "cost per wake (pre-claimed): accept+resolve+claim+running 2 transactions" in out
    assert "no claim transaction (0/0)" in out
    assert "pending dependencies at the end: 61" in out
