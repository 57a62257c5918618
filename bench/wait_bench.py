"""Durable-wait figures (issue 11 benchmark), on SQLite and (when ``FLOW_TEST_MYSQL_URL`` is
set) MariaDB:

* **wake latency**, signal accepted → step ``Running``: ``SubmitWakeSignal``'s service path
  (``SignalService.submit_once`` with a request id, as the servicer calls it: validate,
  commit the signal with its request-ledger row, the producer-side match and the
  root-first resolution, the ledger row's completion), p50/p99 over ``samples`` wakes,
  with 1,000 and with 100,000 other runs waiting, and the p99 ratio (target p99 ≤ 50 ms
  on loopback, ratio ≤ 1.2). The process is wired as a runtime process with a local
  worker with room is (``runtime_svc.worker.background``): the resolution pre-claims the
  woken step for that worker (``docs/adr/0007-pre-claimed-wake.md``), so the step is
  ``Running`` when the resolution commits and the wake ends there (the worker's pick-up
  of the in-memory hand-over is not timed, as the hint's pick-up was not before). A wake
  the resolution did not pre-claim (or every wake with ``BENCH_WAIT_PRECLAIM=0``: the
  hinted path of a process without a local worker) goes on with the scheduler's claim of
  the candidate the resolution's wakeup hint carries, with ``Claimed → Running`` in the
  claim's own transaction (ADR 0003). The worker's idle back-off is left out: a hint or
  hand-over ends it (``services.background.Wakeup``);
* **where a wake's time goes**: per phase (up to the signal's, the resolution's and the
  claim-and-``Running`` commit), the process CPU and GC pauses per wake, and the
  phases of the slowest 2 % of wakes — the tail the p99 comes from;
* the **server's own latency at the same moments**: one raw single-row commit after each
  wake, p50/p99/max — a wake makes two durable commits (three on the hinted path), so a
  server whose commit p99 is stalled (fsync, page flushing after the bulk clone) puts
  that stall into the wake's p99;
* the **cost drivers of one wake**: transactions and SQL statements, split into the
  accept-and-resolve part (with the claim when pre-claimed) and the separate claim part
  (none when pre-claimed);
* the **periodic reconciler's cost per sweep** (one org pass: due probes, owed matches,
  deadlines, repair cursor, retention) as the waiting population grows 1k → 10k → 100k with
  every probe due before each measured pass (the worst case): milliseconds and statements
  per sweep, which must stay bounded by the batch size, not by the population.

The waiting population is cloned from one real waiting run (root, step, checkpoint and a
``Pending`` dependency each) by bulk insert — bench fixture data only. Nothing is
asserted; figures depend on the machine.
"""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from bench import on_service_loop
from bench.databases import on_each_database, settle
from runtime_svc.api.signals import encode_submit_response
from runtime_svc.kernel import NotEligible
from runtime_svc.kernel.wait_model import DependencyState
from runtime_svc.schema import (
    flow_checkpoints,
    flow_dependencies,
    flow_runs,
    flow_step_executions,
)
from runtime_svc.waits.preclaim import PreClaimer
from runtime_svc.waits.resolution import ResolvedRun
from runtime_svc.waits.runtime import WaitRuntime
from runtime_svc.worker.background import LocalWakeSeats
from services import db, migrate
from services.db_batch import statements_of
from services.proto import runtime_v1
from services.request_dedupe import DedupeScope, RequestKey
from tests.integration.waits.support import SIGNAL_KINDS, World, approval, new_scope, signal_flow

__all__ = ["run"]

_BATCH = 100


class _Counter:
    """Transactions and statements an engine executed (a driver-level observation), and
    when each transaction was handed to its commit (``perf_counter``; the commit's own
    round trip falls into the next phase)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine.sync_engine
        self.statements = 0
        self.transactions = 0
        self.commits: list[float] = []
        #: (start, end, first words) of each statement (``perf_counter``): a slow wake's
        #: time is then either in a statement (the server) or between them (this process).
        self.spans: list[tuple[float, float, str]] = []
        self._started = 0.0

    def _statement(self, *args: Any) -> None:
        self.statements += len(statements_of(str(args[2])))
        self._started = time.perf_counter()

    def _executed(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        head = " ".join(statement.split()[:4])[:48]
        self.spans.append((self._started, time.perf_counter(), head))

    def _begin(self, *_args: Any) -> None:
        self.transactions += 1

    def _commit(self, *_args: Any) -> None:
        self.commits.append(time.perf_counter())

    def _checkin(self, *_args: Any) -> None:
        # The connection is back in the pool once its COMMIT (and the pool's reset)
        # returned: the commit's round trip, as a span of its own.
        if self.commits and self.commits[-1] > self._started:
            self.spans.append((self.commits[-1], time.perf_counter(), "COMMIT"))
            self._started = time.perf_counter()

    def __enter__(self) -> _Counter:
        event.listen(self._engine, "before_cursor_execute", self._statement)
        event.listen(self._engine, "after_cursor_execute", self._executed)
        event.listen(self._engine, "begin", self._begin)
        event.listen(self._engine, "commit", self._commit)
        event.listen(self._engine.pool, "checkin", self._checkin)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self._engine, "before_cursor_execute", self._statement)
        event.remove(self._engine, "after_cursor_execute", self._executed)
        event.remove(self._engine, "begin", self._begin)
        event.remove(self._engine, "commit", self._commit)
        event.remove(self._engine.pool, "checkin", self._checkin)


class _GcPauses:
    """Garbage-collector pauses (ms, generation) while active: a wake's tail can be a
    collection rather than the database."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, int]] = []
        self._started = 0.0
        self.active = False

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if not self.active:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append(((time.perf_counter() - self._started) * 1000, info["generation"]))


_GC = _GcPauses()
gc.callbacks.append(_GC)

#: The phases of a wake, each ending where the named transaction was handed to COMMIT.
_PHASES = ("signal", "resolution", "claim+running")
_NAMES = {
    # Pre-claimed: the resolution's commit also claimed the step Running (ADR 0007).
    len(_PHASES): ("signal", "resolution+claim+running", "end"),
    len(_PHASES) + 1: (*_PHASES, "end"),
    len(_PHASES) + 2: ("signal", "resolution", "ledger", "claim+running", "end"),
}


@dataclass
class _Wake:
    total_ms: float
    accept_ms: float
    accept_tx: int
    accept_sql: int
    claim_tx: int
    claim_sql: int
    #: The resolution claimed the step Running for the local worker (ADR 0007).
    preclaimed: bool = False
    #: ms from the submit to each of the wake's three commits (``_PHASES``) and to the end.
    marks: tuple[float, ...] = ()
    #: CPU ms of this process over the wake (``time.process_time``; aiosqlite's thread
    #: included).
    cpu_ms: float = 0.0
    #: GC pauses (ms) during the wake.
    gc_ms: float = 0.0
    #: The wake's longest statement or COMMIT (ms, first words) and its longest stretch
    #: with neither running (ms; the driver's hand-offs and this process's work).
    slowest_statement: tuple[float, str] = (0.0, "")
    longest_gap_ms: float = 0.0


def _where(
    t0: float, t_end: float, spans: list[tuple[float, float, str]]
) -> tuple[tuple[float, str], float]:
    """The longest statement and the longest interval between statements of a wake."""
    slowest = max(((b - a) * 1000, head) for a, b, head in spans) if spans else (0.0, "")
    edges = [t0, *(x for a, b, _h in sorted(spans) for x in (a, b)), t_end]
    gaps = [(edges[i + 1] - edges[i]) * 1000 for i in range(0, len(edges) - 1, 2)]
    return slowest, max(gaps, default=0.0)


async def _template(world: World) -> str:
    await world.seed(signal_flow(deadline="P7D"))
    run = await world.start("wait_signal", key="template")
    await world.drive(run.flow_run_id)
    return run.flow_run_id


async def _clone(engine: AsyncEngine, org: str, template: str, start: int, count: int) -> None:
    """Bulk-insert ``count`` waiting copies of ``template`` (root, step, checkpoint and a
    Pending dependency with a due probe)."""
    r, s, c, d = flow_runs.c, flow_step_executions.c, flow_checkpoints.c, flow_dependencies.c
    async with db.transaction(engine, readonly=True) as conn:

        async def one(table: Any, *where: Any) -> dict[str, Any]:
            row = (await conn.execute(sa.select(table).where(*where))).mappings().one()
            return dict(row)

        root = await one(flow_runs, r.org_id == org, r.flow_run_id == template)
        step = await one(flow_step_executions, s.org_id == org, s.flow_run_id == template)
        ckpt = await one(
            flow_checkpoints, c.org_id == org, c.checkpoint_id == root["current_checkpoint_id"]
        )
        dep = await one(flow_dependencies, d.org_id == org, d.flow_run_id == template)
        now = await db.db_now(conn)
    root["idempotency_key"] = None
    dep["next_probe_at"] = now - timedelta(seconds=1)
    chunk = 1_000
    for base in range(start, start + count, chunk):
        rows: dict[str, list[dict[str, Any]]] = {"r": [], "s": [], "c": [], "d": []}
        for i in range(base, min(start + count, base + chunk)):
            tag = f"{i:07d}-{uuid.uuid4().hex[:6]}"
            run_id, step_id, ckpt_id = f"wr-{tag}", f"ws-{tag}", f"wc-{tag}"
            rows["r"].append(
                {
                    **root,
                    "flow_run_id": run_id,
                    "current_step_execution_id": step_id,
                    "current_checkpoint_id": ckpt_id,
                }
            )
            rows["s"].append({**step, "flow_run_id": run_id, "step_execution_id": step_id})
            rows["c"].append({**ckpt, "flow_run_id": run_id, "checkpoint_id": ckpt_id})
            rows["d"].append(
                {
                    **dep,
                    "dependency_id": f"wd-{tag}",
                    "flow_run_id": run_id,
                    "step_execution_id": step_id,
                    "producer_key": f"approval:clone-{i}",
                }
            )
        async with db.transaction(engine) as conn:
            await conn.execute(flow_runs.insert(), rows["r"])
            await conn.execute(flow_step_executions.insert(), rows["s"])
            await conn.execute(flow_checkpoints.insert(), rows["c"])
            await conn.execute(flow_dependencies.insert(), rows["d"])


async def _wake(
    world: World, hints: list[ResolvedRun], seats: LocalWakeSeats | None, key: str
) -> _Wake:
    """One wake of a real waiting run: submit → resolved and (pre-claimed) Running, or
    submit → resolved, then the hinted claim → Running."""
    run = await world.start("wait_signal", key=key)
    await world.drive(run.flow_run_id)  # parked on its wait (setup, not measured)
    _GC.pauses.clear()
    _GC.active = True
    c0 = time.process_time()
    submission = approval(key, f"t-{key}")
    request = runtime_v1.SubmitWakeSignalRequest(
        request_id=f"req-{key}",
        producer_kind=submission.producer_kind,
        producer_key=submission.producer_key,
        wake_token=submission.wake_token,
    )
    ledger_key = RequestKey.of(DedupeScope.of_work_scope(world.work), "SubmitWakeSignal", request)
    with _Counter(world.engine) as accept:
        t0 = time.perf_counter()
        # ``SubmitWakeSignal``'s service call: deduplicated on the request id like the
        # servicer (the ledger row commits with the signal and is completed with the
        # post-match answer).
        await world.rt.signals.submit_once(
            world.work, submission, ledger_key, encode_submit_response
        )
        t1 = time.perf_counter()
    # Pre-claimed (ADR 0007): the step is Running since the resolution's commit; the
    # hand-over is taken as a worker loop would (the bench does not execute the step).
    handed = None if seats is None else seats.take()
    with _Counter(world.engine) as claim:
        if handed is None:
            # What a worker of the process does with the resolution's wakeup hint
            # (``runtime_svc.worker.background._run_resolved``): claim the candidate the
            # resolution left, reading it only when the hint carries none.
            resolved = [h for h in hints if h.flow_run_id == run.flow_run_id]
            candidate = resolved[-1].candidate if resolved else None
            if candidate is None:
                candidate = await world.store.candidate_for_run(world.org, run.flow_run_id)
            if candidate is None:
                raise RuntimeError("the woken run is not claimable")
            fence = await world.store.claim(world.org, candidate, lease_owner="bench", running=True)
            if isinstance(fence, NotEligible):
                raise RuntimeError(f"the woken run's claim was refused: {fence.reason}")
        t2 = time.perf_counter() if handed is None else t1
    hints.clear()
    cpu = (time.process_time() - c0) * 1000
    _GC.active = False
    marks = tuple((t - t0) * 1000 for t in [*accept.commits, *claim.commits, t2])
    slowest, gap = _where(t0, t2, [*accept.spans, *claim.spans])
    await world.store.request_cancel(world.org, run.flow_run_id)  # out of the population
    return _Wake(
        (t2 - t0) * 1000,
        (t1 - t0) * 1000,
        accept.transactions,
        accept.statements,
        claim.transactions,
        claim.statements,
        handed is not None,
        marks,
        cpu,
        sum(ms for ms, _gen in _GC.pauses),
        slowest,
        gap,
    )


_RAW = sa.Table(
    "bench_wait_raw",
    sa.MetaData(),
    sa.Column("id", sa.String(64), primary_key=True),
)


async def _raw_commit(engine: AsyncEngine) -> float:
    """Ms of one single-row commit: the unit a wake's durable commits cost."""
    t0 = time.perf_counter()
    async with db.transaction(engine) as conn:
        await conn.execute(_RAW.insert().values(id=f"r-{uuid.uuid4().hex}"))
    return (time.perf_counter() - t0) * 1000


def _tail(label: str, wakes: list[_Wake]) -> str:
    """Where the time of a wake went: per phase p50 / p99, CPU and GC, and the phases of
    the slowest 2 % of wakes (the tail the p99 comes from)."""
    # Four commits; five when the request-ledger row is completed in a transaction of
    # its own (the two-transaction match, or the code before round 5).
    count = max((len(w.marks) for w in wakes), default=0)
    names = _NAMES.get(count) or (*(f"commit{i}" for i in range(1, count)), "end")
    shaped = [w for w in wakes if len(w.marks) == count]

    def spans(w: _Wake) -> list[float]:
        return [b - a for a, b in zip((0.0, *w.marks), w.marks, strict=False)]

    lines = []
    if shaped:
        per = list(zip(*(spans(w) for w in shaped), strict=True))
        lines.append(
            f"{label:<8}   phases p50/p99 ms: "
            + ", ".join(
                f"{n} {statistics.median(v):.1f}/{_p(list(v), 0.99):.1f}"
                for n, v in zip(names, per, strict=True)
            )
        )
    cpu = [w.cpu_ms for w in wakes]
    gcs = [w.gc_ms for w in wakes]
    lines.append(
        f"{label:<8}   CPU per wake p50/p99 {_p(cpu, 0.5):.1f}/{_p(cpu, 0.99):.1f} ms; "
        f"GC in a wake p99/max {_p(gcs, 0.99):.1f}/{max(gcs):.1f} ms"
    )
    slowest = sorted(shaped, key=lambda w: -w.total_ms)[: max(1, len(shaped) // 50)]
    for w in slowest:
        lines.append(
            f"{label:<8}   slow wake {w.total_ms:6.1f} ms "
            f"(CPU {w.cpu_ms:5.1f}, GC {w.gc_ms:4.1f}): "
            + ", ".join(f"{n} {v:.1f}" for n, v in zip(names, spans(w), strict=True))
            + f"; longest statement {w.slowest_statement[0]:.1f} ms"
            f" ({w.slowest_statement[1]}), longest gap between statements"
            f" {w.longest_gap_ms:.1f} ms"
        )
    return "\n".join(lines)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _latency(
    world: World,
    hints: list[ResolvedRun],
    seats: LocalWakeSeats | None,
    samples: int,
    tag: str,
) -> tuple[list[_Wake], list[float]]:
    """``samples`` wakes, each followed by one raw single-row commit on the same database:
    the commits sample the server at the same moments as the wakes, so a tail the server
    has (an fsync stall, page flushing after the bulk clone) shows in both."""
    async with world.engine.begin() as conn:
        await conn.run_sync(_RAW.metadata.create_all)
    wakes: list[_Wake] = []
    commits: list[float] = []
    for i in range(samples):
        wakes.append(await _wake(world, hints, seats, f"{tag}-{i}"))
        commits.append(await _raw_commit(world.engine))
    return wakes, commits


async def _all_due(engine: AsyncEngine, org: str) -> None:
    """Bench setup: every pending dependency's probe is due again (the worst case)."""
    d = flow_dependencies.c
    async with db.transaction(engine) as conn:
        now = await db.db_now(conn)
        await conn.execute(
            sa.update(flow_dependencies)
            .where(d.org_id == org, d.state == DependencyState.PENDING.code)
            .values(next_probe_at=now - timedelta(seconds=1), reconciliation_attempts=0)
        )


async def _sweep_cost(world: World, passes: int) -> tuple[float, float, int]:
    """Median ms and statements of one org sweep pass with every probe due, and the
    probes one pass made."""
    times: list[float] = []
    statements: list[float] = []
    probes = 0
    for _ in range(passes):
        await _all_due(world.engine, world.org)
        with _Counter(world.engine) as count:
            t0 = time.perf_counter()
            stats = await world.sweeper.sweep_org(world.org)
            times.append((time.perf_counter() - t0) * 1000)
        statements.append(count.statements)
        probes = max(probes, stats.probes)
    return statistics.median(times), statistics.median(statements), probes


async def _bench(
    label: str, url: str, populations: tuple[int, ...], samples: int, preclaim: bool
) -> None:
    await migrate.upgrade(url, "runtime_svc")
    engine = db.create_engine(url, pool_size=8)
    try:
        world = World(engine, new_scope())  # its clock is the database clock (no shift)
        # The runtime process's wiring: a resolution hands its run to the workers.
        hints: list[ResolvedRun] = []
        world.rt = WaitRuntime.build(
            engine,
            clock=world.clock,
            signal_kinds=SIGNAL_KINDS,
            watch_ttl_s=0.0,
            on_resolved=hints.append,
        )
        world.sweeper = world.rt.sweeper(batch=_BATCH)
        seats = None
        if preclaim:
            # A runtime process with a local worker with room (``start_background``):
            # the worker that parks each run holds its plan; no admission controller
            # (the bench measures the wake, not §16 — as the hinted claim above).
            seats = LocalWakeSeats([world.worker])
            world.rt.matcher.preclaim = PreClaimer(world.store, seats)
        template = await _template(world)
        # The service process freezes its start-up heap once it serves
        # (``services.service_main``); so does the bench, once its world is built.
        gc.collect()
        gc.freeze()
        cloned = 0
        results: dict[int, list[_Wake]] = {}
        raw: dict[int, list[float]] = {}
        for population in populations:
            await _clone(engine, world.org, template, cloned, population - cloned)
            cloned = population
            settled = await settle(
                engine, (flow_runs, flow_step_executions, flow_checkpoints, flow_dependencies)
            )
            print(f"{label:<8} {population:>7,} waiting loaded and settled: {settled}")
            results[population], raw[population] = await _latency(
                world, hints, seats, samples, f"p{population}"
            )
            ms, sql, probes = await _sweep_cost(world, 3)
            print(
                f"{label:<8} reconciler sweep, {population:>7,} waiting: {ms:8.1f} ms, "
                f"{sql:6.0f} statements, {probes} probes (batch {_BATCH})"
            )
        for population, wakes in results.items():
            totals = [w.total_ms for w in wakes]
            pre = sum(w.preclaimed for w in wakes)
            print(
                f"{label:<8} wake latency, {population:>7,} waiting: "
                f"p50 {_p(totals, 0.5):6.2f} ms  p99 {_p(totals, 0.99):6.2f} ms  "
                f"(accept+resolve p50 {statistics.median(w.accept_ms for w in wakes):6.2f} ms;"
                f" pre-claimed {pre} of {len(wakes)})"
            )
            print(_tail(label, wakes))
            commits = raw[population]
            print(
                f"{label:<8}   raw single-row commit between the wakes: p50 "
                f"{_p(commits, 0.5):6.2f} ms  p99 {_p(commits, 0.99):6.2f} ms  max "
                f"{max(commits):6.1f} ms (a wake makes 2 durable commits pre-claimed, 3 hinted)"
            )
        small, large = results[populations[0]], results[populations[-1]]
        ratio = _p([w.total_ms for w in large], 0.99) / _p([w.total_ms for w in small], 0.99)
        print(
            f"{label:<8} wake p99 ratio {populations[-1]:,} / {populations[0]:,} waiting: "
            f"{ratio:5.2f}"
        )
        w = large[-1]
        if w.preclaimed:
            print(
                f"{label:<8} cost per wake (pre-claimed): accept+resolve+claim+running "
                f"{w.accept_tx} transactions, {w.accept_sql} statements; no claim "
                f"transaction ({w.claim_tx}/{w.claim_sql}); 2 durable commits: signal, "
                f"resolution with the claim and Running"
            )
        else:
            print(
                f"{label:<8} cost per wake (hinted): accept+resolve {w.accept_tx} "
                f"transactions, {w.accept_sql} statements; claim+running {w.claim_tx} "
                f"transactions, {w.claim_sql} statements (3 durable commits: signal, "
                f"resolution, claim with Running)"
            )
        async with db.transaction(engine, readonly=True) as conn:
            d = flow_dependencies.c
            pending = (
                await conn.execute(
                    sa.select(sa.func.count())
                    .select_from(flow_dependencies)
                    .where(d.org_id == world.org, d.state == DependencyState.PENDING.code)
                )
            ).scalar_one()
        print(f"{label:<8} pending dependencies at the end: {pending:,}")
    finally:
        await engine.dispose()


async def _main(populations: tuple[int, ...], samples: int, preclaim: bool) -> None:
    async def one(label: str, url: str) -> None:
        await _bench(label, url, populations, samples, preclaim)

    await on_each_database("waits", one)


def run(seconds: float) -> None:
    """Print the durable-wait figures (``BENCH_WAIT_POPULATION`` caps the largest waiting
    population, ``BENCH_WAIT_SAMPLES`` the wakes measured per population,
    ``BENCH_WAIT_PRECLAIM=0`` measures the hinted path of a process without a local
    worker instead of the pre-claimed wake)."""
    top = int(os.environ.get("BENCH_WAIT_POPULATION", "100000"))
    samples = int(os.environ.get("BENCH_WAIT_SAMPLES", "200"))
    preclaim = os.environ.get("BENCH_WAIT_PRECLAIM", "1") != "0"
    populations = tuple(sorted({min(1_000, top), min(10_000, top), top}))
    path = "pre-claimed wake (ADR 0007)" if preclaim else "hinted path (no local worker)"
    print(f"Durable wait bench ({samples} wakes per population, {path}; {seconds:.0f}s unused)")
    asyncio.run(_main(populations, samples, preclaim))


if __name__ == "__main__":
    on_service_loop()
    run(float(os.environ.get("BENCH_SECONDS", "3")))
