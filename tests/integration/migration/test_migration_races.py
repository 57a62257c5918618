"""Concurrency of the migration contract on MariaDB (row locks, READ COMMITTED, real
interleavings): a legacy claim racing a V2 transition, stale legacy recovery racing a V2
row's own progress, and old-writer inserts racing the trusted OrgID backfill.

Bounded loops, no sleeps for correctness: the assertions are about final database state.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import CheckpointInput, FinishRun, LeaseFence
from runtime_svc.kernel.states import RunState
from runtime_svc.legacy.model import Rejected, Rejection
from runtime_svc.legacy.store import LegacyInterviewStore
from runtime_svc.migration import backfill, bridge
from runtime_svc.schema import flow_runs
from services import db, migrate
from tests.integration.kernel.conftest import ShiftedClock
from tests.integration.kernel.helpers import QUEUE, start
from tests.integration.migration.bridge_support import Issuer, prebridge_rows
from tests.integration.migration.conftest import new_scope
from tests.integration.migration.support import raw_run, tamper, v2_world
from tests.support.prebridge import old_insert

pytestmark = pytest.mark.mariadb

RUNS = 12


@pytest.fixture
async def maria(mariadb_url: str) -> AsyncIterator[AsyncEngine]:
    await migrate.upgrade(mariadb_url, "runtime_svc")
    engine = db.create_engine(mariadb_url, pool_size=12)
    try:
        yield engine
    finally:
        await engine.dispose()


async def test_a_legacy_claim_racing_a_v2_transition_never_wins_and_never_disturbs_it(
    maria: AsyncEngine,
) -> None:
    scope, clock = new_scope(), ShiftedClock()
    world = await v2_world(maria, scope, clock)
    legacy = LegacyInterviewStore(maria, clock=clock)
    run_ids = [await start(world) for _ in range(RUNS)]
    candidates = {c.flow_run_id: c for c in await world.store.eligible_work(scope.org_id, QUEUE)}

    async def v2(run_id: str) -> RunState:
        fence = await world.store.claim(scope.org_id, candidates[run_id], lease_owner="v2")
        assert isinstance(fence, LeaseFence)
        fence = await world.store.mark_running(scope.org_id, fence)
        result = await world.store.commit_step(
            scope.org_id, fence, output=CheckpointInput({"done": True}), advance=FinishRun()
        )
        return result.run_state

    async def old_scheduler(run_id: str) -> list[Rejected | object]:
        outcomes = []
        for _ in range(6):  # keep trying while the V2 transition is in flight
            row = await raw_run(maria, scope.org_id, run_id)
            outcomes.append(
                await legacy.claim(
                    scope.org_id,
                    run_id,
                    expected_version=row["state_version"],
                    claimer="old",
                    require_due=False,
                )
            )
            outcomes.append(await legacy.recover_one(scope.org_id, run_id))
        return outcomes

    results = await asyncio.gather(*(v2(r) for r in run_ids), *(old_scheduler(r) for r in run_ids))

    assert results[:RUNS] == [RunState.SUCCEEDED] * RUNS
    for outcomes in results[RUNS:]:
        assert outcomes and all(
            o == Rejected(Rejection.NOT_LEGACY_OWNED)
            for o in outcomes  # type: ignore[union-attr]
        ), outcomes
    for run_id in run_ids:
        row = await raw_run(maria, scope.org_id, run_id)
        assert row["execution_owner"] == "FlowRuntimeV2"
        assert row["runtime_state"] == RunState.SUCCEEDED.code
        assert row["legacy_claimed_by"] is None


async def test_stale_legacy_recovery_on_v2_rows_changes_nothing_while_they_progress(
    maria: AsyncEngine,
) -> None:
    scope, clock = new_scope(), ShiftedClock()
    world = await v2_world(maria, scope, clock)
    legacy = LegacyInterviewStore(maria, clock=clock)
    run_ids = [await start(world) for _ in range(RUNS)]
    for run_id in run_ids:  # V2 rows that *look* like stale legacy claims
        await tamper(maria, scope.org_id, run_id, interview_status="Running")
    candidates = {c.flow_run_id: c for c in await world.store.eligible_work(scope.org_id, QUEUE)}

    async def v2(run_id: str) -> None:
        fence = await world.store.claim(scope.org_id, candidates[run_id], lease_owner="v2")
        assert isinstance(fence, LeaseFence)
        await world.store.mark_running(scope.org_id, fence)

    async def recovery() -> list[object]:
        recovered: list[object] = []
        for run_id in run_ids:  # the due-list sweep and the per-row repair entry point
            recovered += await legacy.recover_stale(scope.org_id)
            outcome = await legacy.recover_one(scope.org_id, run_id)
            if outcome != Rejected(Rejection.NOT_LEGACY_OWNED):
                recovered.append(outcome)
        return recovered

    *_, recovered = await asyncio.gather(*(v2(r) for r in run_ids), recovery())

    assert recovered == []
    for run_id in run_ids:
        row = await raw_run(maria, scope.org_id, run_id)
        assert row["runtime_state"] == RunState.RUNNING.code  # the V2 claim's transition
        # Recovery would have written Paused, a due run_after and cleared the claim.
        assert row["interview_status"] == "Running" and row["run_after"] is None


async def test_old_writer_inserts_during_the_backfill_window_are_all_stamped_exactly_once(
    maria: AsyncEngine,
) -> None:
    await bridge.bridge_begin(maria)
    issuer, scope = Issuer.new(), new_scope()
    authority = issuer.proven(scope)
    writers, per_writer = 3, 15
    done = asyncio.Event()

    async def old_writer(i: int) -> list[str]:
        return [
            await old_insert(maria, flow="legacy_pure", position="calc", interview_id=f"w{i}-{n}")
            for n in range(per_writer)
        ]

    async def sweeper() -> list[backfill.BackfillReceipt]:
        receipts = []
        while not done.is_set():
            receipts.append(await backfill.org_backfill_sweep(maria, authority, batch=7))
        return receipts

    sweeping = asyncio.create_task(sweeper())
    inserted = await asyncio.gather(*(old_writer(i) for i in range(writers)))
    done.set()  # the old fleet is drained: no more pre-bridge writes
    window = await sweeping
    final = await backfill.org_backfill_sweep(maria, authority)

    ids = {i for batch in inserted for i in batch}
    assert len(ids) == writers * per_writer
    rows = await prebridge_rows(maria)
    assert set(rows) == ids
    assert {r["org_id"] for r in rows.values()} == {scope.org_id}
    # Every row was stamped by exactly one sweep (the conditional UPDATE never re-stamps).
    assert sum(r.stamped for r in (*window, final)) == len(ids)
    assert final.complete and (final.null_count, final.mismatch_count) == (0, 0)
    assert all(r.complete for r in window)
    async with db.transaction(maria, readonly=True) as conn:
        assert (await conn.execute(select(flow_runs.c.flow_run_id))).all() == []
