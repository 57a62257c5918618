"""§22.7 backpressure (issue 14 item 3), on SQLite and MariaDB, real plans and claims.

* database pressure reduces admissions before the connection pool is exhausted: with
  three of four pooled connections held elsewhere, no new mutation is admitted (its lane
  is not even queried), the pass completes without waiting for a connection, and
  mutations resume once the pressure is gone;
* cold dependency completions continue under mutation pressure: with the lock-wait rate
  at its threshold, every run on the dependency-wakeup lane finishes while the
  mutation lane is held back;
* a retry storm is contained: when every mutation of a tenant is a deadlock victim, the
  deadlock rate throttles new mutation admissions after the first victims, instead of
  every queued step being attempted — and a cold lane keeps moving through it; once the
  evidence is older than the window's horizon, admission probes again (never stuck).

Admission decides by lane (``queue_class``), so the cold runs here are the worker Flow's
runs whose first step sits on the ``dependency_wakeup`` lane, as a woken wait's does.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pymysql
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.admission.controller import AdmissionController, Decision
from runtime_svc.admission.pressure import PressureSignals
from runtime_svc.kernel import FlowRunStateStore, LeaseFence
from runtime_svc.worker import Outcome
from services import db
from tests.integration.admission.support import RecordingWorker, seed_org, states
from tests.integration.kernel.conftest import ShiftedClock
from tests.integration.worker.conftest import WORKER_POLICY
from tests.integration.worker.support import new_org

POOL = 4


@pytest.fixture
async def small_pool(kernel_db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(kernel_db_url, pool_size=POOL)
    try:
        yield eng
    finally:
        await eng.dispose()


@contextlib.asynccontextmanager
async def held_connections(engine: AsyncEngine, count: int) -> AsyncIterator[None]:
    """``count`` pooled connections checked out (and used) by someone else."""
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(count):
            # Read-only (BEGIN DEFERRED on SQLite): held, but blocking no writer.
            conn = await stack.enter_async_context(db.transaction(engine, readonly=True))
            await conn.execute(text("SELECT 1"))
        yield


async def test_db_pressure_reduces_admissions_before_the_pool_is_exhausted(
    small_pool: AsyncEngine,
) -> None:
    engine = small_pool
    store = FlowRunStateStore(engine, policy=WORKER_POLICY, clock=ShiftedClock())
    org = new_org()
    mutations = await seed_org(engine, store, org, 4)
    admission = AdmissionController(engine, budget=POOL, quantum=4)
    worker = RecordingWorker(engine, store, admission=admission)
    queried: list[str] = []
    original = store.eligible_work

    async def eligible_work(org_id: str, lane: str, *, limit: int = 50):  # type: ignore[no-untyped-def]
        queried.append(lane)
        return await original(org_id, lane, limit=limit)

    store.eligible_work = eligible_work  # type: ignore[method-assign]
    async with held_connections(engine, POOL - 1):
        assert engine.pool.checkedout() == POOL - 1  # type: ignore[attr-defined]
        assert await worker.run_batch(org) == []
        assert "durable_mutation" not in queried  # no claim query under pressure
        assert worker.log == []
        assert admission.decisions[Decision.PRESSURE] > 0
    assert set((await states(engine, org, mutations.run_ids)).values()) == {"Runnable"}
    # Pressure gone: the same pass admits and commits them.
    assert await worker.run_batch(org) == [Outcome.COMMITTED] * 4
    assert set((await states(engine, org, mutations.run_ids)).values()) == {"Succeeded"}


async def test_cold_dependency_completions_continue_under_mutation_pressure(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    org = new_org()
    hot = await seed_org(engine, store, org, 6)
    cold_org = new_org()
    cold = await seed_org(engine, store, cold_org, 3, lane="dependency_wakeup")

    def lock_waits() -> PressureSignals:
        return PressureSignals(lock_wait_rate=1.0)  # every mutation waits on locks

    admission = AdmissionController(engine, budget=4, quantum=4, extra_signals=lock_waits)
    worker = RecordingWorker(engine, store, admission=admission)
    for _ in range(3):
        await worker.run_batch(org)
        await worker.run_batch(cold_org)
    assert set((await states(engine, cold_org, cold.run_ids)).values()) == {"Succeeded"}
    assert set((await states(engine, org, hot.run_ids)).values()) == {"Runnable"}
    assert {p.lane for p in worker.log} == {"dependency_wakeup"}


async def test_a_retry_storm_is_contained(engine: AsyncEngine, store: FlowRunStateStore) -> None:
    storm_org = new_org()
    storm = await seed_org(engine, store, storm_org, 12)
    cold_org = new_org()
    cold = await seed_org(engine, store, cold_org, 3, lane="dependency_wakeup")

    async def deadlock(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "in_txn" and fence.flow_run_id in storm.run_ids:
            raise pymysql.err.OperationalError(1213, "Deadlock found (injected storm)")

    now = [0.0]
    admission = AdmissionController(engine, budget=4, quantum=2, window=20, clock=lambda: now[0])
    worker = RecordingWorker(engine, store, admission=admission, hook=deadlock)
    for _ in range(6):
        await worker.run_batch(storm_org)
        await worker.run_batch(cold_org)
    attempted = [p for p in worker.log if p.org == storm_org]
    # The first victim(s) — at most one quantum — raised the deadlock rate to full
    # pressure: no further mutation was admitted, although ten more were due every pass.
    assert 1 <= len(attempted) <= 2
    assert {p.outcome for p in attempted} == {Outcome.RETRY_SCHEDULED}
    assert admission.decisions[Decision.PRESSURE] > 0
    assert set((await states(engine, cold_org, cold.run_ids)).values()) == {"Succeeded"}
    untouched = await states(engine, storm_org, storm.run_ids)
    assert sum(1 for s in untouched.values() if s == "Runnable") == 12
    # The storm's evidence expires with the window's horizon even though no outcome
    # arrived since: admission probes again (one quantum at most) and is contained again.
    now[0] += 31
    for _ in range(3):
        await worker.run_batch(storm_org)
    probes = [p for p in worker.log if p.org == storm_org][len(attempted) :]
    assert 1 <= len(probes) <= 2
    assert {p.outcome for p in probes} == {Outcome.RETRY_SCHEDULED}
