"""Cluster figures: durable steps on a MySQL-protocol cluster (issue 17 benchmark).

Runs only when ``FLOW_BENCH_CLUSTER_URLS`` names the server URLs of the cluster's nodes
(comma-separated, no database; ``python -m tests.cluster.galera up --dir DIR`` starts a
local 3-node Galera cluster and prints the line to export). Prints:

* durable steps committed per second (10-step Flow, one record mutation per step) with
  the same number of in-process ``StepWorker`` s spread over every node vs all on the
  first node, and their ratio;
* the certification-conflict rate of each configuration: driver 1213 errors the
  workers' engines saw (claims and step commits that lost certification or a deadlock)
  per committed step, and the nodes' own ``wsrep_local_cert_failures`` +
  ``wsrep_local_bf_aborts`` growth;
* claim latency on the cluster: median and p95 of eligible-work query + claim of a run
  accepted through *another* node (the read is causal, the claim certified cluster-wide).

Nothing is asserted; figures depend on the machine and the cluster's network.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import ExceptionContext, make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from bench import on_service_loop
from runtime_svc.kernel import FlowRunStateStore, NotEligible, RetryPolicy
from runtime_svc.worker import Outcome
from services import db, migrate
from tests.integration.worker.support import make_worker, seed, start_run

__all__ = ["CLUSTER_URLS_ENV", "run"]

#: Comma-separated server URLs of the cluster's nodes.
CLUSTER_URLS_ENV = "FLOW_BENCH_CLUSTER_URLS"
_POLICY = RetryPolicy(lease_duration_ms=120_000, max_attempts=50)
_WORKERS = 6
_DEADLOCK = 1213


@dataclass
class _Conflicts:
    count: int = 0


@contextmanager
def _count_conflicts(engines: list[AsyncEngine]) -> Iterator[_Conflicts]:
    seen = _Conflicts()

    def on_error(ctx: ExceptionContext) -> None:
        orig = ctx.original_exception
        if orig.args and orig.args[0] == _DEADLOCK:
            seen.count += 1

    for engine in engines:
        event.listen(engine.sync_engine, "handle_error", on_error)
    try:
        yield seen
    finally:
        for engine in engines:
            event.remove(engine.sync_engine, "handle_error", on_error)


async def _wsrep_aborts(engines: list[AsyncEngine]) -> int:
    total = 0
    for engine in engines:
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    sa.text(
                        "SHOW GLOBAL STATUS WHERE Variable_name IN "
                        "('wsrep_local_cert_failures', 'wsrep_local_bf_aborts')"
                    )
                )
            ).all()
            await conn.rollback()
        total += sum(int(v) for _, v in rows)
    return total


async def _steps(
    engines: list[AsyncEngine], placement: list[int], seconds: float
) -> tuple[float, float, int]:
    """Steps/s, 1213s per committed step, wsrep abort growth; worker ``i`` on node
    ``placement[i]``."""
    stores = [FlowRunStateStore(e, policy=_POLICY) for e in engines]
    seeded = await seed(engines[0], mutations=10, pure_step=False)
    for i in range(len(placement) * 8):
        await start_run(stores[i % len(stores)], seeded, label=f"c{i}")
    pool = [
        make_worker(engines[node], stores[node], owner=f"cw{i}", batch_size=2)
        for i, node in enumerate(placement)
    ]
    committed = 0
    before = await _wsrep_aborts(engines)
    start = time.perf_counter()

    async def loop(i: int) -> None:
        nonlocal committed
        while time.perf_counter() - start < seconds:
            done = await pool[i].run_batch(seeded.org)
            committed += sum(1 for o in done if o is Outcome.COMMITTED)
            if not done:
                return

    with _count_conflicts(engines) as conflicts:
        await asyncio.gather(*(loop(i) for i in range(len(pool))))
    elapsed = time.perf_counter() - start
    aborts = await _wsrep_aborts(engines) - before
    return committed / elapsed, conflicts.count / max(committed, 1), aborts


async def _claim_latency(engines: list[AsyncEngine], samples: int) -> tuple[float, float]:
    stores = [FlowRunStateStore(e, policy=_POLICY) for e in engines]
    seeded = await seed(engines[0], mutations=1, pure_step=False)
    times: list[float] = []
    for i in range(samples):
        accepted, claimer = i % len(stores), (i + 1) % len(stores)
        run = await start_run(stores[accepted], seeded, label=f"l{i}")
        t0 = time.perf_counter()
        candidates = await stores[claimer].eligible_work(seeded.org, "durable_mutation", limit=1)
        fence = await stores[claimer].claim(seeded.org, candidates[0], lease_owner="bench")
        times.append((time.perf_counter() - t0) * 1000)
        if isinstance(fence, NotEligible):
            raise RuntimeError(f"the bench claim was refused: {fence.reason}")
        await stores[claimer].request_cancel(seeded.org, run.flow_run_id)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.95) - 1]


async def _main(urls: list[str], seconds: float) -> None:
    name = f"bench_cluster_{uuid.uuid4().hex[:8]}"
    admin = db.create_engine(urls[0].rstrip("/") + "/", pool_size=1)
    async with admin.connect() as conn:
        await conn.execute(
            sa.text(f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        )
        await conn.commit()
    node_urls = [
        make_url(u).set(database=name, query={"charset": "utf8mb4"}).render_as_string(False)
        for u in urls
    ]
    engines = [db.create_engine(u, pool_size=_WORKERS + 2) for u in node_urls]
    try:
        await migrate.upgrade(node_urls[0], "runtime_svc")
        spread = [i % len(engines) for i in range(_WORKERS)]
        one = [0] * _WORKERS
        rates = {}
        for label, placement in (("spread over nodes", spread), ("all on node 1", one)):
            rate, per_step, aborts = await _steps(engines, placement, seconds)
            rates[label] = rate
            print(
                f"cluster  durable steps/s, {_WORKERS} workers {label:<18} {rate:8.1f}"
                f"   1213/step {per_step:5.3f}   wsrep cert+bf aborts {aborts}"
            )
        print(
            f"cluster  ratio spread / one node                       "
            f"{rates['spread over nodes'] / rates['all on node 1']:8.2f}"
        )
        median, p95 = await _claim_latency(engines, 40)
        print(f"cluster  claim latency ms (cross-node) median / p95   {median:7.2f} / {p95:7.2f}")
    finally:
        for engine in engines:
            await engine.dispose()
        async with admin.connect() as conn:
            await conn.execute(sa.text(f"DROP DATABASE {name}"))
            await conn.commit()
        await admin.dispose()


def run(seconds: float) -> None:
    """Print the cluster figures when ``FLOW_BENCH_CLUSTER_URLS`` is set."""
    urls = [u.strip() for u in os.environ.get(CLUSTER_URLS_ENV, "").split(",") if u.strip()]
    if not urls:
        print(
            f"cluster  skipped (set {CLUSTER_URLS_ENV}; "
            "`python -m tests.cluster.galera up --dir DIR` starts one)"
        )
        return
    print(f"Cluster bench on {len(urls)} node(s) ({seconds:.0f}s per throughput figure)")
    asyncio.run(_main(urls, seconds))


if __name__ == "__main__":
    on_service_loop()
    run(float(os.environ.get("BENCH_SECONDS", "3")))
