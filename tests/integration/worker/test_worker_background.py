"""``start_background`` lifecycle (STYLE 12): workers and sweeps run a Flow to completion
in-process and stop cleanly; ``FLOW_RUNTIME_WORKERS=0`` starts nothing."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, RunState
from runtime_svc.worker import FixedViews, WorkerSettings, start_background
from tests.integration.worker.support import TERMINAL, record_view, seed, start_run, wait_until


async def test_background_workers_finish_a_run_and_stop(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    settings = WorkerSettings(workers=2, sweeps=True, idle_ms=50, sweep_ms=100)
    bg = await start_background(None, engine, views=FixedViews(record_view()), settings=settings)
    try:

        async def finished() -> bool:
            got = await store.get_run(seeded.org, run.flow_run_id)
            return got.state in TERMINAL

        assert await wait_until(finished, timeout_s=30)
    finally:
        await bg.stop()
    assert bg.stopping
    assert (await store.get_run(seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED


async def test_zero_workers_and_no_sweeps_start_nothing(engine: AsyncEngine) -> None:
    bg = await start_background(None, engine, settings=WorkerSettings(workers=0, sweeps=False))
    await bg.stop()
