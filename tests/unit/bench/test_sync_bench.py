"""The synchronous-profile bench (§22.7 before-save latency against the bare write,
Bounded Atomic cost) runs end to end on SQLite: its setup really subscribes and activates
both Flows, the before-save variant really transforms the record, and the Bounded Atomic
variant really commits a run — so the figures ``make bench`` prints compare real work.
No speed is asserted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import sync_bench
from services import db, migrate


async def test_the_three_variants_do_their_work_and_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'bench.db'}"
    await migrate.upgrade(url, "runtime_svc")
    engine = db.create_engine(url, pool_size=2)
    try:
        setup = await sync_bench._setup(engine)
        variants = sync_bench._Variants(engine, setup)
        await sync_bench._check(engine, setup, variants)  # asserts each variant's effect
    finally:
        await engine.dispose()
    await sync_bench._bench("sqlite", f"sqlite+aiosqlite:///{tmp_path / 'b2.db'}", 0.3)
    out = capsys.readouterr().out
    assert re.search(r"\(a\) bare record mutations/s\s+\d", out), out
    assert re.search(r"\(b\) \+ 5-element before-save Flow/s\s+\d.*ratio b/a.*overhead", out)
    assert re.search(r"\(c\) Bounded Atomic runs/s\s+\d.*ratio c/a", out), out
    # c/a split into its two causes: the run's CPU and its wait, as multiples of (a)'s.
    assert re.search(r"ratio c/a .*per run CPU x\d+\.\d+, wait x\d+\.\d+ of \(a\)", out), out
    # The cost drivers of each variant and the raw commit rate they are measured against.
    assert re.search(r"raw single-row commits/s\s+\d", out), out
    assert re.search(r"\(a\) bare record mutations/s\s+\d.*ratio a/raw", out), out
    per_op = re.findall(
        r"per op: write txns (\S+)\s+txns (\S+)\s+statements\s+(\S+)"
        r"\s+round trips\s+\S+\s+COMMITs\s+(\S+)\s+CPU ms\s+\S+\s+wait ms\s+\d+\.\d+",
        out,
    )
    assert len(per_op) == 4, out
    raw, bare, before, atomic = per_op
    # The raw commit, timed call by call with (a) and (b): one INSERT, one transaction.
    assert raw == ("1.00", "1.00", "1.0", "1.00"), per_op
    # A deduplicated create is one write transaction (pinned in detail, with its
    # statements, by tests/integration/records/test_records_write_cost.py).
    assert bare[:2] == ("1.00", "1.00") and before[:2] == ("1.00", "1.00"), per_op
    # The before-save write's activation read rides on the ledger lookup: it costs the
    # bare write's statements (test_records_before_save_ledger.py pins the count).
    assert before[2] == bare[2], per_op
    # SQLite sends every COMMIT on its own (the last writes carry it only where several
    # statements share a round trip, ADR 0013).
    assert bare[3] == before[3] == "1.00" and atomic[3] == "2.00", per_op
    # A Bounded Atomic run is created claimed (ADR 0005): create+claim, then the business
    # transaction — two write transactions and nothing else (pinned in detail by
    # tests/integration/atomic/test_atomic_created_claimed.py).
    assert atomic[:2] == ("2.00", "2.00"), per_op


def test_the_cost_split_divides_cpu_and_wait_per_call() -> None:
    """(c)'s CPU and wait per call as multiples of (a)'s: per call, not per total (the
    variants make different numbers of calls), and the wait is the wall time not spent on
    this process's CPU."""
    bare = sync_bench._Cost(calls=10, seconds=10.0, cpu_s=6.0)  # 0.6 CPU + 0.4 wait per call
    atomic = sync_bench._Cost(calls=5, seconds=15.0, cpu_s=9.0)  # 1.8 CPU + 1.2 wait per call
    assert atomic.wait_s == pytest.approx(6.0)
    assert atomic.times(bare) == "CPU x3.00, wait x3.00"
    # A call that used more CPU than wall time (other threads' CPU) waits no negative time,
    # and a multiple of nothing is not printed as a number.
    busy = sync_bench._Cost(calls=1, seconds=1.0, cpu_s=1.5)
    assert busy.wait_s == 0.0
    assert atomic.times(busy) == "CPU x1.20, wait x-"
