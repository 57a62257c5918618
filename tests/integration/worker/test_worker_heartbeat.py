"""Periodic lease heartbeat during long pure compute (§12.3), on SQLite and MariaDB.

The pure step ``calc`` is made "slow" by a ``compute`` phase hook that moves the database
clock forward in slices (never sleeping for a lease): with the heartbeat running, each
slice is followed by a heartbeat and recovery finds nothing to fence; with the heartbeat
disabled, the lease expires, recovery fences the attempt, and the old worker's commit
fails its fence. A heartbeat that loses the fence (cancellation) abandons the step.
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, LeaseFence, RunState
from runtime_svc.schema import flow_step_attempts, flow_step_executions
from runtime_svc.worker import Outcome, Sweeper
from tests.integration.kernel.conftest import ShiftedClock
from tests.integration.kernel.helpers import rows
from tests.integration.worker.support import (
    MUTATION_STEPS,
    Seeded,
    drive,
    make_worker,
    run_records,
    seed,
    start_run,
    step_counts,
)

#: Real heartbeat period of these tests (the lease itself is on the shifted clock).
BEAT_S = 0.01
#: Bound on waiting for one heartbeat (never reached unless the heartbeat is broken).
WAIT_S = 10.0


async def _step_key(engine: AsyncEngine, seeded: Seeded, fence: LeaseFence) -> str:
    [step] = await rows(
        engine, flow_step_executions, org_id=seeded.org, step_execution_id=fence.step_execution_id
    )
    return str(step["plan_step_key"])


async def _calc_attempts(engine: AsyncEngine, seeded: Seeded, run_id: str) -> list[str]:
    [calc] = await rows(
        engine, flow_step_executions, org_id=seeded.org, flow_run_id=run_id, plan_step_key="calc"
    )
    attempts = await rows(
        engine, flow_step_attempts, org_id=seeded.org, step_execution_id=calc["step_execution_id"]
    )
    attempts.sort(key=lambda a: a["attempt_number"])
    return [str(a["transaction_outcome"]) for a in attempts]


async def test_heartbeat_keeps_a_slow_pure_step_leased(
    engine: AsyncEngine, store: FlowRunStateStore, clock: ShiftedClock
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    sweeper = Sweeper(engine, store)
    lease_s = store.policy.lease_duration_ms / 1000
    beat = asyncio.Event()
    slices: list[int] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "heartbeat":
            beat.set()
            return
        if at != "compute" or await _step_key(engine, seeded, fence) != "calc":
            return
        # 3 x 0.4 lease = 1.2 leases of compute: only the heartbeat keeps the lease alive.
        for i in range(3):
            clock.advance(seconds=lease_s * 0.4)
            beat.clear()
            await asyncio.wait_for(beat.wait(), WAIT_S)
            assert (await sweeper.sweep_org(seeded.org))[0] == 0  # nothing expired
            slices.append(i)

    # One step per batch: each step's own claim and lease are what this test watches.
    worker = make_worker(
        engine, store, hook=hook, heartbeat_interval_s=BEAT_S, continuation_limit=0
    )
    assert await worker.run_batch(seeded.org) == [Outcome.COMMITTED]  # bump1
    assert await worker.run_batch(seeded.org) == [Outcome.COMMITTED]  # calc, slow
    assert slices == [0, 1, 2]
    assert await _calc_attempts(engine, seeded, run.flow_run_id) == ["Committed"]
    assert (await drive(worker, seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED
    [account] = await run_records(engine, seeded.org)
    assert account["record_version"] == len(MUTATION_STEPS)


async def test_without_heartbeat_the_lease_expires_and_recovery_fences_the_step(
    engine: AsyncEngine, store: FlowRunStateStore, clock: ShiftedClock
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    sweeper = Sweeper(engine, store)
    lease_s = store.policy.lease_duration_ms / 1000
    recovered: list[int] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        assert at != "heartbeat"
        if at != "compute" or recovered or await _step_key(engine, seeded, fence) != "calc":
            return
        for _ in range(3):
            clock.advance(seconds=lease_s * 0.4)
        recovered.append((await sweeper.sweep_org(seeded.org))[0])

    # One step per batch: each step's own claim and lease are what this test watches.
    worker = make_worker(engine, store, hook=hook, heartbeat=False, continuation_limit=0)
    assert await worker.run_batch(seeded.org) == [Outcome.COMMITTED]  # bump1
    # Recovery took over while calc computed: the old worker's commit fails the fence.
    assert await worker.run_batch(seeded.org) == [Outcome.FENCE_LOST]
    assert recovered == [1]
    assert await _calc_attempts(engine, seeded, run.flow_run_id) == ["Fenced"]
    assert (await step_counts(engine, seeded.org, run.flow_run_id, "calc")).committed_attempts == 0
    clock.advance(hours=1)
    assert (await drive(worker, seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED
    assert await _calc_attempts(engine, seeded, run.flow_run_id) == ["Fenced", "Committed"]


async def test_a_heartbeat_that_loses_the_fence_abandons_the_step(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    abandoned: list[bool] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at != "compute" or abandoned or await _step_key(engine, seeded, fence) != "calc":
            return
        await store.request_cancel(seeded.org, run.flow_run_id)
        try:
            await asyncio.sleep(WAIT_S)  # "compute" until the heartbeat abandons it
        except asyncio.CancelledError:
            abandoned.append(True)
            raise
        abandoned.append(False)

    # One step per batch: each step's own claim and lease are what this test watches.
    worker = make_worker(
        engine, store, hook=hook, heartbeat_interval_s=BEAT_S, continuation_limit=0
    )
    assert await worker.run_batch(seeded.org) == [Outcome.COMMITTED]  # bump1
    assert await worker.run_batch(seeded.org) == [Outcome.FENCE_LOST]
    assert abandoned == [True]
    assert (await step_counts(engine, seeded.org, run.flow_run_id, "calc")).committed_attempts == 0
    await Sweeper(engine, store).sweep_org(seeded.org)
    final = await store.get_run(seeded.org, run.flow_run_id, include_deleted=True)
    assert final.state is RunState.CANCELLED


async def test_a_cancellation_from_outside_stays_a_cancellation_and_stops_the_heartbeat(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    """The step's preparation runs in the worker's own task, the heartbeat beside it
    once one period has passed: cancelling the worker while the heartbeat runs cancels
    it (never read as the heartbeat's lost fence), the heartbeat stops, and nothing of
    the step is committed."""
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    beats: list[LeaseFence] = []
    beating = asyncio.Event()
    computing: list[bool] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "heartbeat":
            beats.append(fence)
            beating.set()
            return
        if at != "compute" or await _step_key(engine, seeded, fence) != "calc":
            return
        computing.append(True)
        await asyncio.sleep(WAIT_S)  # "compute" until cancelled

    worker = make_worker(
        engine, store, hook=hook, heartbeat_interval_s=BEAT_S, continuation_limit=0
    )
    assert await worker.run_batch(seeded.org) == [Outcome.COMMITTED]  # bump1
    batch = asyncio.create_task(worker.run_batch(seeded.org))
    await asyncio.wait_for(beating.wait(), WAIT_S)
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert batch.cancelled() and computing == [True]
    seen = len(beats)
    await asyncio.sleep(BEAT_S * 5)
    assert len(beats) == seen  # the heartbeat stopped with the step
    assert (await step_counts(engine, seeded.org, run.flow_run_id, "calc")).committed_attempts == 0


async def test_a_lost_fence_is_what_is_reported_when_the_step_fails_as_it_is_abandoned(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    """The heartbeat loses the fence and cancels the preparation, which fails with an
    error of its own instead of ending cancelled: the lost fence is the step's outcome
    (nothing committed), and the worker's task is left with no cancellation pending (its
    next batch runs normally)."""
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    converted: list[bool] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at != "compute" or converted or await _step_key(engine, seeded, fence) != "calc":
            return
        await store.request_cancel(seeded.org, run.flow_run_id)
        try:
            await asyncio.sleep(WAIT_S)
        except asyncio.CancelledError:
            converted.append(True)
            raise RuntimeError("the computation failed while being abandoned") from None

    worker = make_worker(
        engine, store, hook=hook, heartbeat_interval_s=BEAT_S, continuation_limit=0
    )
    assert await worker.run_batch(seeded.org) == [Outcome.COMMITTED]  # bump1
    assert await worker.run_batch(seeded.org) == [Outcome.FENCE_LOST]
    assert converted == [True]
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    assert await worker.run_batch(seeded.org) == []  # cancelled run: nothing due
    assert (await step_counts(engine, seeded.org, run.flow_run_id, "calc")).committed_attempts == 0
