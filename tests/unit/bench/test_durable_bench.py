"""The durable-step bench counts what one step costs (issue 13): run on SQLite until its
work runs out (no time limit is reached, no speed is asserted), every run finishes and
the per-step counters are the ones step continuation (ADR 0002) gives — one claim and
one running transaction for a run's first step, one commit transaction per step."""

from __future__ import annotations

from pathlib import Path

from bench import durable_bench
from services import db, migrate
from services.db_batch import row_guard


async def test_the_durable_bench_counts_transactions_statements_and_cpu_per_step(
    tmp_path: Path,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'd.db'}"
    await migrate.upgrade(url, "runtime_svc")
    engine = db.create_engine(url, pool_size=4)
    try:
        counters = durable_bench._count(engine)
        # 8 runs of 10 steps; 1,000 s is never reached: the loop ends when no work is left.
        cost = await durable_bench._steps_rate(engine, 1, 1_000.0, counters)
    finally:
        await engine.dispose()
    assert cost.steps_per_s > 0
    # 80 steps: 8 first steps at 2 write transactions (the fused claim + Running, then
    # the commit; 3 before ADR 0003), 72 continued ones at 1.
    assert cost.write_txns == (8 * 2 + 72) / 80
    # Read transactions: discovery and the first steps' preparation only.
    assert cost.write_txns < cost.txns < 2 * cost.write_txns
    # 28.0 before the continuation stopped re-reading the rows it holds or wrote, the
    # clock was read once per transaction and a continued step's commit stopped asking
    # for the checkpoint sequence; 21.6 after (issue 13, docs/performance.md); 16.5
    # after the fused claim + Running (ADR 0003: no running transaction, the commit's
    # root UPDATE carries the continuation's claim, the next step is inserted Running),
    # the lone record's lock-first read and that lock carrying the clock.
    assert 10 < cost.statements < 17
    # SQLite commits in its frame: no write rides with a COMMIT, so no row guard (ADR 0014).
    assert cost.row_guards == 0
    assert cost.cpu_ms > 0


def test_the_durable_bench_counts_the_row_guards_among_the_statements() -> None:
    """A row guard is a statement that touches no table; the bench counts it among the
    statements and says how many of them were guards."""
    counters = durable_bench._Counters()
    guard = row_guard(1)
    carried = f"UPDATE t SET v = 1;\n{guard};\nINSERT INTO u VALUES (1);\nCOMMIT"
    durable_bench._note_statement(counters, carried)
    durable_bench._note_statement(counters, "SELECT 1")
    assert (counters.statements, counters.row_guards, counters.round_trips) == (4, 1, 2)
