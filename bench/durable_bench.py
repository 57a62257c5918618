"""Durable-step figures (issue 5 benchmark): wired into ``bench/__main__.py`` by the lead.

Prints, on SQLite and (when ``FLOW_TEST_MYSQL_URL`` is set) MariaDB:

* durable steps committed per second for a 10-step Flow with one record mutation per
  step, executed by 1 and by 4 in-process ``StepWorker`` s (each step = claim, running,
  one business transaction with record + history + event + audit + checkpoint + fenced
  root/step/attempt advance);
* the cost of one durable step on average over that window: write transactions, all
  transactions, SQL statements (SQLAlchemy ``begin`` and ``before_cursor_execute`` events on
  the engine; SQLite's own ``BEGIN`` statement is not counted) and CPU milliseconds of this
  process (``time.process_time``) — so every change to the hot path shows its cost;
* the raw single-row commit rate of the same database (through the same transaction
  frame) and the ratio steps/s ÷ commits/s, the raw rate measured right before and right
  after each throughput figure (their mean: the host's speed drifts within a minute);
* 1-worker steps/s and CPU per step on the standard library's event loop vs ``uvloop``
  (``FLOW_EVENT_LOOP``; the rest of the bench runs on the loop it names);
* claim latency (eligible-work query + claim transaction) in an org with 1,000 and in one
  with 100,000 waiting (non-eligible) runs, both in the table, sampled in turn, and their
  ratio (should stay near 1).

The waiting population is cloned from one real run's rows by bulk insert (bench fixture
data only: seeding 100,000 runs through the store would dominate the bench's time).
Nothing is asserted; figures depend on the machine. Bounded: every figure stops after
``seconds`` (or when its work runs out).
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from bench import on_service_loop
from bench.databases import on_each_database, settle
from runtime_svc.kernel import FlowRunStateStore, RetryPolicy, RunState, StepState
from runtime_svc.schema import flow_runs, flow_step_executions
from runtime_svc.worker import Outcome
from services import db, event_loop, migrate
from services.db import BEGIN_MODE_OPTION
from services.db_batch import is_row_guard, statements_of
from services.db_mysql import carried_commit
from tests.integration.worker.support import make_worker, seed, start_run

__all__ = ["run"]

_POLICY = RetryPolicy(lease_duration_ms=120_000)
#: Runs a throughput figure seeds per second of its window (10 steps each: room for
#: 600 steps/s before the work, not the window, would end the figure).
_RUNS_PER_S = 60
_META = sa.MetaData()
_RAW = sa.Table(
    "bench_durable_raw",
    _META,
    sa.Column("org_id", sa.String(64), primary_key=True),
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("payload", sa.Text, nullable=False),
)


@dataclass
class _Counters:
    """Transactions and statements an engine ran (its sync facade's events)."""

    transactions: int = 0
    write_transactions: int = 0
    #: SQL statements (each statement of a batched round trip counts: services/db_batch.py)
    statements: int = 0
    #: Statement round trips to the server (a batch of writes is one)
    round_trips: int = 0
    #: ``COMMIT`` s sent in a round trip of their own (one carried by a transaction's last
    #: writes, ADR 0013, is not: it rode on a statement round trip)
    commits: int = 0
    #: Of :attr:`statements`, the row guards after fenced writes whose round trip carries
    #: the ``COMMIT`` (``services.db_batch.row_guard``, ADR 0014): no table access
    row_guards: int = 0

    def snapshot(self) -> tuple[int, int, int, int, int]:
        return (
            self.transactions,
            self.write_transactions,
            self.statements,
            self.round_trips,
            self.commits,
        )


def _note_statement(counters: _Counters, statement: object) -> None:
    """Count one cursor execution: a round trip, its statements, the row guards among
    them (a ``BEGIN`` is none of these)."""
    if isinstance(statement, str) and statement.startswith("BEGIN"):
        return
    statements = statements_of(str(statement))
    counters.statements += len(statements)
    counters.row_guards += sum(1 for s in statements if is_row_guard(s))
    counters.round_trips += 1


def _count(engine: AsyncEngine) -> _Counters:
    counters = _Counters()

    @sa.event.listens_for(engine.sync_engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        counters.transactions += 1
        if conn.get_execution_options().get(BEGIN_MODE_OPTION) != "DEFERRED":
            counters.write_transactions += 1

    @sa.event.listens_for(engine.sync_engine, "before_cursor_execute")
    def _statement(*args: Any) -> None:
        _note_statement(counters, args[2])

    @sa.event.listens_for(engine.sync_engine, "commit")
    def _commit(conn: sa.Connection) -> None:
        if not carried_commit(conn.connection.dbapi_connection):
            counters.commits += 1

    return counters


@dataclass(frozen=True)
class _StepCost:
    steps_per_s: float
    write_txns: float
    txns: float
    statements: float
    round_trips: float
    commits: float
    cpu_ms: float
    #: Of :attr:`statements`, row guards (ADR 0014)
    row_guards: float = 0.0


async def _raw_table(engine: AsyncEngine) -> None:
    """Create the raw commit's table (once per database)."""
    async with engine.begin() as conn:
        await conn.run_sync(_META.create_all)


async def _raw_commit(engine: AsyncEngine, key: str) -> None:
    """One raw single-row commit: an INSERT through SQLAlchemy and its COMMIT."""
    async with db.transaction(engine) as conn:
        await conn.execute(_RAW.insert().values(org_id="org-b", id=key, payload="{}"))


async def _raw_rate(engine: AsyncEngine, seconds: float) -> float:
    await _raw_table(engine)
    prefix = uuid.uuid4().hex[:12]  # measured several times on one table
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        await _raw_commit(engine, f"{prefix}-{n}")
        n += 1
    return n / (time.perf_counter() - start)


async def _steps_rate(
    engine: AsyncEngine,
    workers: int,
    seconds: float,
    counters: _Counters | None = None,
    *,
    runs_per_worker: int = 8,
) -> _StepCost:
    """Steps/s of ``workers`` workers for ``seconds`` (or until the work runs out: the
    ``runs_per_worker`` times ``workers`` 10-step runs seeded first) and, with ``counters``
    (:func:`_count` on ``engine``), the per-step cost."""
    counters = counters if counters is not None else _Counters()
    store = FlowRunStateStore(engine, policy=_POLICY)
    seeded = await seed(engine, mutations=10, pure_step=False)
    for i in range(workers * runs_per_worker):
        await start_run(store, seeded, label=f"b{i}")
    pool = [make_worker(engine, store, owner=f"b{i}", batch_size=2) for i in range(workers)]
    committed = 0
    before, guards = counters.snapshot(), counters.row_guards
    cpu = time.process_time()
    start = time.perf_counter()

    async def loop(i: int) -> None:
        nonlocal committed
        while time.perf_counter() - start < seconds:
            done = await pool[i].run_batch(seeded.org)
            committed += sum(1 for o in done if o is Outcome.COMMITTED)
            if not done:
                return

    await asyncio.gather(*(loop(i) for i in range(workers)))
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    txns, writes, statements, trips, commits = (
        a - b for a, b in zip(counters.snapshot(), before, strict=True)
    )
    per = max(committed, 1)
    return _StepCost(
        steps_per_s=committed / elapsed,
        write_txns=writes / per,
        txns=txns / per,
        statements=statements / per,
        round_trips=trips / per,
        commits=commits / per,
        cpu_ms=cpu * 1000 / per,
        row_guards=(counters.row_guards - guards) / per,
    )


async def _clone_waiting(engine: AsyncEngine, org: str, template: str, total: int) -> None:
    """Bulk-insert ``total`` Waiting copies of run ``template`` (root + current step)."""
    r, s = flow_runs.c, flow_step_executions.c
    async with db.transaction(engine, readonly=True) as conn:
        root = dict(
            (
                await conn.execute(
                    sa.select(flow_runs).where(r.org_id == org, r.flow_run_id == template)
                )
            )
            .mappings()
            .one()
        )
        step = dict(
            (
                await conn.execute(
                    sa.select(flow_step_executions).where(
                        s.org_id == org, s.flow_run_id == template
                    )
                )
            )
            .mappings()
            .one()
        )
    root.update(runtime_state=RunState.WAITING.code, idempotency_key=None, run_after=None)
    step.update(state=StepState.WAITING.code, run_after=None)
    chunk = 2_000
    for base in range(0, total, chunk):
        roots: list[dict[str, Any]] = []
        steps: list[dict[str, Any]] = []
        for i in range(base, min(total, base + chunk)):
            run_id, step_id = f"wr-{i:07d}-{uuid.uuid4().hex[:6]}", f"ws-{i:07d}"
            roots.append({**root, "flow_run_id": run_id, "current_step_execution_id": step_id})
            steps.append({**step, "flow_run_id": run_id, "step_execution_id": step_id})
        async with db.transaction(engine) as conn:
            await conn.execute(flow_runs.insert(), roots)
            await conn.execute(flow_step_executions.insert(), steps)


async def _claim_latencies(
    engine: AsyncEngine, populations: tuple[int, ...], samples: int
) -> list[float]:
    """Median ms of eligible_work + claim of one due run among each of ``populations``
    waiting runs — one org per population, all loaded (and settled) first, then sampled
    in turn (one claim per org per round), so the figures compare the populations at the
    same moments of a host whose speed drifts within a minute."""
    store = FlowRunStateStore(engine, policy=_POLICY)
    orgs = []
    for waiting in populations:
        seeded = await seed(engine, mutations=1, pure_step=False)
        template = await start_run(store, seeded)
        await _clone_waiting(engine, seeded.org, template.flow_run_id, waiting)
        await store.request_cancel(seeded.org, template.flow_run_id)
        orgs.append(seeded)
    # Timed as the populations stand, not while the server writes the load back.
    settled = await settle(engine, (flow_runs, flow_step_executions))
    loaded = " and ".join(f"{n:,}" for n in populations)
    print(f"    {loaded} waiting loaded (one org each) and settled: {settled}")
    times: list[list[float]] = [[] for _ in populations]
    for i in range(samples):
        for seeded, sampled in zip(orgs, times, strict=True):
            run = await start_run(store, seeded, label=f"c{i}")
            t0 = time.perf_counter()
            [candidate] = await store.eligible_work(seeded.org, "durable_mutation", limit=1)
            fence = await store.claim(seeded.org, candidate, lease_owner="bench")
            sampled.append((time.perf_counter() - t0) * 1000)
            if fence is None:
                raise RuntimeError("the bench run could not be claimed")
            await store.request_cancel(seeded.org, run.flow_run_id)
    return [statistics.median(t) for t in times]


async def _rate_on_own_engine(url: str, seconds: float) -> _StepCost:
    engine = db.create_engine(url, pool_size=2)
    counters = _count(engine)
    try:
        return await _steps_rate(engine, 1, seconds, counters, runs_per_worker=32)
    finally:
        await engine.dispose()


async def _loop_comparison(label: str, url: str, seconds: float) -> None:
    """1-worker steps/s and CPU ms per step on the standard library's loop vs uvloop
    (``FLOW_EVENT_LOOP``), alternating, two rounds each, each on its own loop in a thread
    (this loop only waits meanwhile, so the process CPU is the measured loop's)."""
    if event_loop.resolve("auto") != "uvloop":
        print(f"{label:<8} event loop comparison skipped (uvloop not installed)")
        return
    costs: dict[str, list[_StepCost]] = {"asyncio": [], "uvloop": []}
    for _ in range(2):
        for loop in costs:
            cost = await asyncio.to_thread(
                event_loop.run, _rate_on_own_engine(url, seconds / 2), loop
            )
            costs[loop].append(cost)
    rate = {k: statistics.median(c.steps_per_s for c in v) for k, v in costs.items()}
    cpu = {k: statistics.median(c.cpu_ms for c in v) for k, v in costs.items()}
    print(
        f"{label:<8} 1 worker on asyncio / uvloop: steps/s {rate['asyncio']:6.1f} /"
        f" {rate['uvloop']:6.1f}   CPU ms/step {cpu['asyncio']:5.2f} / {cpu['uvloop']:5.2f}"
        f"   uvloop CPU ratio {cpu['uvloop'] / cpu['asyncio']:4.2f}"
    )


async def _bench(label: str, url: str, seconds: float) -> None:
    await migrate.upgrade(url, "runtime_svc")
    engine = db.create_engine(url, pool_size=8)
    counters = _count(engine)
    try:
        raw = await _raw_rate(engine, seconds)
        print(f"{label:<8} raw single-row commits/s          {raw:9.0f}")
        for workers in (1, 4):
            # Enough runs that the window, not the work, ends the figure (8 per worker
            # ran out after ~1.3 s at 60 steps/s, 32 after ~1.6 s at 200: start-up costs
            # weighed on it): room for _RUNS_PER_S runs a second.
            runs = max(32, math.ceil(seconds * _RUNS_PER_S / workers))
            # The ratio's raw rate is measured right before and right after the figure
            # (their mean): this host's speed drifts within a minute, and a raw rate
            # taken at another moment than the steps moves the ratio by as much.
            cost = await _steps_rate(engine, workers, seconds, counters, runs_per_worker=runs)
            after = await _raw_rate(engine, seconds / 2)
            around = (raw + after) / 2
            print(
                f"{label:<8} durable steps/s, {workers} worker(s)      {cost.steps_per_s:9.1f}"
                f"   ratio steps/commits {cost.steps_per_s / around:5.3f}"
                f"   (raw commits/s before / after: {raw:.0f} / {after:.0f})"
            )
            raw = after
            print(
                f"{label:<8}   per step: write txns {cost.write_txns:5.2f}"
                f"  txns {cost.txns:5.2f}  statements {cost.statements:5.1f}"
                f" ({cost.row_guards:3.1f} row guards)"
                f"  round trips {cost.round_trips:5.1f}  COMMITs {cost.commits:4.2f}"
                f"  CPU ms {cost.cpu_ms:6.2f}"
            )
        await _loop_comparison(label, url, seconds)
        small, large = await _claim_latencies(engine, (1_000, 100_000), 30)
        print(
            f"{label:<8} claim latency ms (1k / 100k waiting) {small:7.2f} / {large:7.2f}"
            f"   ratio {large / small:5.2f}"
        )
    finally:
        await engine.dispose()


async def _main(seconds: float) -> None:
    async def one(label: str, url: str) -> None:
        await _bench(label, url, seconds)

    await on_each_database("durable", one)


def run(seconds: float) -> None:
    """Print the durable-step figures (each throughput figure runs ``seconds``)."""
    print(f"Durable orchestration bench ({seconds:.0f}s per throughput figure)")
    asyncio.run(_main(seconds))


if __name__ == "__main__":
    on_service_loop()
    run(float(os.environ.get("BENCH_SECONDS", "3")))
