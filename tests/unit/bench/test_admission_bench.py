"""The admission fairness bench runs end to end on SQLite: each scenario really creates
and executes the runs it measures (every cold run is picked up), and the report prints
the three scenarios with their p99 ratios. No speed is asserted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import admission_bench


async def test_every_scenario_serves_the_cold_tenant_and_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'bench.db'}"
    figures = await admission_bench._bench("sqlite", url, 3)
    for ages in figures.values():
        # every cold run picked up: the warm-up tick and the three measured ones
        assert len(ages) == 4 and all(a >= 0 for a in ages)
    out = capsys.readouterr().out
    for name in ("alone", "hot, admission", "hot, rotation order", "hot, no admission"):
        assert re.search(rf"{re.escape(name)}\s+p50\s+[\d.]+ ms\s+p99\s+[\d.]+ ms", out), out
    assert "ratio p99/alone" in out
