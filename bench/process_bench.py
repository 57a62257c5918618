"""Worker-process figures (issue 13): durable steps/s with 1 and with 2 worker processes.

One Python process executes on one core at most, so ``FLOW_RUNTIME_WORKER_PROCESSES``
(``runtime_svc.processes``) is how a runtime uses a multi-core host. This bench measures
what that buys on SQLite and (when ``FLOW_TEST_MYSQL_URL`` is set) MariaDB:

* the raw single-row commit rate of the database (``bench.durable_bench``'s figure);
* durable steps/s of the 10-step, one-mutation-per-step Flow of ``bench.durable_bench``,
  executed by 1 and by 2 OS processes with 1 and with 4 ``StepWorker`` s each, all on one
  org of one database; each line gives the ratio steps/s ÷ raw commits/s and the worker
  CPU per committed step (``time.process_time`` of every worker process, summed).

The processes are started (spawn) and ready before the clock starts, and each stops after
``seconds`` or when the work runs out. Nothing is asserted: on a shared machine with two
cores the 2-process figures are bounded by whatever CPU the rest of the machine leaves.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from multiprocessing.synchronize import Event as EventType
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from bench import on_service_loop
from bench.databases import on_each_database
from bench.durable_bench import _POLICY, _raw_rate
from runtime_svc.kernel import FlowRunStateStore
from runtime_svc.worker import Outcome
from services import db, event_loop, migrate
from services.config import event_loop_choice
from tests.integration.worker.support import make_worker, seed, start_run

__all__ = ["run"]

#: (worker processes, workers per process) measured on each database.
SHAPES = ((1, 1), (2, 1), (1, 4), (2, 4))
#: How long the parent waits for a worker process to start or to report.
_CHILD_TIMEOUT_S = 180.0


async def _work(
    url: str, org: str, workers: int, seconds: float, ready: Any, go: EventType, slot: int
) -> tuple[int, float, float]:
    engine = db.create_engine(url, pool_size=workers + 1)
    try:
        store = FlowRunStateStore(engine, policy=_POLICY)
        pool = [
            make_worker(engine, store, owner=f"p{slot}w{i}", batch_size=2) for i in range(workers)
        ]
        ready.put(("ready", slot))
        await asyncio.to_thread(go.wait, _CHILD_TIMEOUT_S)
        committed = 0
        cpu0, start = time.process_time(), time.perf_counter()

        async def loop(i: int) -> None:
            nonlocal committed
            while time.perf_counter() - start < seconds:
                done = await pool[i].run_batch(org)
                committed += sum(1 for o in done if o is Outcome.COMMITTED)
                if not done:
                    return

        await asyncio.gather(*(loop(i) for i in range(workers)))
        return committed, time.perf_counter() - start, time.process_time() - cpu0
    finally:
        await engine.dispose()


def _child(
    url: str, org: str, workers: int, seconds: float, out: Any, go: EventType, slot: int
) -> None:
    """One worker process: report ready, wait for the start, run, report the figures."""
    # A spawned child: run on the loop the parent (and the services) run on.
    result = event_loop.run(_work(url, org, workers, seconds, out, go, slot), event_loop_choice())
    out.put(("done", result))


async def _steps_rate(
    engine: AsyncEngine, url: str, processes: int, workers: int, seconds: float
) -> tuple[float, float]:
    """(steps/s, worker CPU ms per committed step) with ``processes`` x ``workers``."""
    store = FlowRunStateStore(engine, policy=_POLICY)
    seeded = await seed(engine, mutations=10, pure_step=False)
    for i in range(processes * workers * 32):  # enough that the window ends the figure
        await start_run(store, seeded, label=f"p{i}")
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_child, args=(url, seeded.org, workers, seconds, out, go, i))
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            kind, _slot = await asyncio.to_thread(out.get, True, _CHILD_TIMEOUT_S)
            if kind != "ready":
                raise RuntimeError(f"a bench worker process reported {kind} before ready")
        go.set()
        results = [
            (await asyncio.to_thread(out.get, True, _CHILD_TIMEOUT_S + seconds))[1] for _ in procs
        ]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    committed = sum(r[0] for r in results)
    elapsed = max(r[1] for r in results)
    cpu = sum(r[2] for r in results)
    return committed / elapsed, (cpu * 1000 / committed if committed else float("nan"))


async def _bench(label: str, url: str, seconds: float) -> None:
    await migrate.upgrade(url, "runtime_svc")
    engine = db.create_engine(url, pool_size=4)
    try:
        raw = await _raw_rate(engine, seconds)
        print(f"{label:<8} raw single-row commits/s                 {raw:9.0f}")
        for processes, workers in SHAPES:
            rate, cpu_ms = await _steps_rate(engine, url, processes, workers, seconds)
            print(
                f"{label:<8} durable steps/s, {processes} process(es) x {workers} worker(s)"
                f" {rate:7.1f}   ratio steps/commits {rate / raw:5.3f}"
                f"   CPU ms/step {cpu_ms:5.1f}"
            )
    finally:
        await engine.dispose()


async def _main(seconds: float) -> None:
    async def one(label: str, url: str) -> None:
        await _bench(label, url, seconds)

    await on_each_database("procs", one)


def run(seconds: float) -> None:
    """Print the worker-process figures (each throughput figure runs ``seconds``)."""
    print(f"Worker-process bench ({seconds:.0f}s per figure, {os.cpu_count()} CPU(s) on this host)")
    asyncio.run(_main(seconds))


if __name__ == "__main__":
    on_service_loop()
    run(float(os.environ.get("BENCH_SECONDS", "3")))
