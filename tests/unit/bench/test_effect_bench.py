"""The effect bench's per-phase breakdown (pure parts): two profile snapshots of a service
child become per-effect counters, and the printout names each call site with its
transactions and statements and each component with its loop CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import effect_bench

ROOT = Path(__file__).resolve().parents[3]


def _snapshot(txn: float, stmt: float, cpu_s: float, loop_s: float, proc_s: float) -> dict:
    return {
        "seq": 1,
        "process_cpu_s": proc_s,
        "loop_thread_cpu_s": loop_s,
        "txns": {"w runtime_svc/a.py:commit": txn, "r services/b.py:poll": 2.0},
        "stmts": {"runtime_svc/a.py:commit": stmt, "services/b.py:poll": 2.0},
        "cpu_s": {"loop flow-worker-0": cpu_s, "loop idle": 0.5},
    }


def test_the_delta_of_two_snapshots_is_per_effect_and_drops_unchanged_sites() -> None:
    before = _snapshot(10.0, 40.0, 1.0, 2.0, 3.0)
    after = _snapshot(30.0, 120.0, 2.0, 4.0, 7.0)
    per = effect_bench._profile_delta(before, after, 10)
    assert per["txns"] == {"w runtime_svc/a.py:commit": 2.0}  # the poll did not change
    assert per["stmts"] == {"runtime_svc/a.py:commit": 8.0}
    assert per["cpu_ms"] == {"loop flow-worker-0": 100.0}
    assert per["loop_ms"] == 200.0 and per["process_ms"] == 400.0
    assert effect_bench._profile_delta({}, {}, 10) == {}


def test_the_breakdown_prints_sites_statements_and_components(
    capsys: pytest.CaptureFixture[str],
) -> None:
    per = effect_bench._profile_delta({}, _snapshot(4.0, 10.0, 0.2, 0.3, 0.4), 2)
    effect_bench._print_phases("sqlite", "runtime", per)
    out = capsys.readouterr().out
    assert "2.00    5.0  w runtime_svc/a.py:commit" in out
    assert "1.00    1.0  r services/b.py:poll" in out
    assert "process 200.0, event loop 150.0, other threads 50.0" in out
    assert "100.00  loop flow-worker-0" in out
    effect_bench._print_phases("sqlite", "owner", {})  # no profile: nothing printed
    assert capsys.readouterr().out == ""


_CHILD = """
import asyncio, os, signal
from services import db

# The profiler names frames of the service packages: compile the opener as if it lived in
# one (the file need not exist).
SOURCE = (
    "async def opened_here(engine):\\n"
    "    async with db.transaction(engine) as conn:\\n"
    "        await conn.exec_driver_sql('SELECT 1')\\n"
    "        await conn.exec_driver_sql('SELECT 2')\\n"
)
ns = {"db": db}
exec(compile(SOURCE, "/nowhere/runtime_svc/probe.py", "exec"), ns)

async def main():
    engine = db.create_engine(os.environ["URL"], pool_size=1)
    await ns["opened_here"](engine)
    await engine.dispose()

asyncio.run(main())
os.kill(os.getpid(), signal.SIGUSR1)
"""


def test_the_profiler_counts_a_childs_transactions_by_call_site(tmp_path: Path) -> None:
    """Loaded as ``sitecustomize`` (as the bench loads it into its children), the
    profiler names the function that opened the transaction and counts its statements,
    and SIGUSR1 writes the counters."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(effect_bench._PROFILER), str(ROOT)]),
        "BENCH_PROFILE_DIR": str(tmp_path),
        "URL": f"sqlite+aiosqlite:///{tmp_path / 'p.db'}",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, cwd=ROOT, timeout=120, capture_output=True
    )
    assert proc.returncode == 0, proc.stderr.decode()
    (dump,) = tmp_path.glob("*.json")
    data = json.loads(dump.read_text())
    assert data["txns"]["w runtime_svc/probe.py:opened_here"] == 1
    # the two SELECTs (and SQLite's BEGIN, issued as a statement)
    assert data["stmts"]["runtime_svc/probe.py:opened_here"] >= 2
    assert data["cpu_s"] and data["process_cpu_s"] > 0
