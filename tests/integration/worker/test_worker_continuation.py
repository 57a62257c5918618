"""Step continuation (docs/adr/0002-step-continuation.md), on SQLite and MariaDB: the
commit of a step claims the run's next step for the same worker, so a run's consecutive
steps need no discovery, claim or running transaction of their own — and every race the
separate claim had still ends with each step committed once.

* a run continues through all its steps in one batch, one write transaction per step;
* a worker that dies holding a continued step leaves it to lease expiry (no duplicate);
* cancellation and delete racing a continued step fence its commit;
* a pause before the commit refuses the continuation (the next step stays claimable
  only after ResumeRun); a pause of the continued step stops the chain after it.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, LeaseFence, RunState
from runtime_svc.kernel.store_operator import OperatorActor, pause_run_txn, resume_run_txn
from runtime_svc.schema import flow_runs, flow_step_attempts, flow_step_executions
from runtime_svc.worker import Outcome, Sweeper
from services import db
from services.db import BEGIN_MODE_OPTION
from tests.integration.kernel.conftest import ShiftedClock
from tests.integration.kernel.helpers import rows
from tests.integration.worker.support import (
    MUTATION_STEPS,
    Seeded,
    drive,
    make_worker,
    seed,
    start_run,
    step_counts,
)
from tests.support.invariants import check_exactly_once, stranded_runs

OPS = OperatorActor("ops-test")


class _Died(BaseException):
    """Stands for the worker process dying mid-step (nothing after it runs)."""


async def _key(engine: AsyncEngine, seeded: Seeded, fence: LeaseFence) -> str:
    [step] = await rows(
        engine,
        flow_step_executions,
        org_id=seeded.org,
        step_execution_id=fence.step_execution_id,
    )
    return str(step["plan_step_key"])


async def _step(engine: AsyncEngine, seeded: Seeded, run_id: str, key: str) -> dict[str, Any]:
    [row] = await rows(
        engine, flow_step_executions, org_id=seeded.org, flow_run_id=run_id, plan_step_key=key
    )
    return row


async def _invariants(engine: AsyncEngine, store: FlowRunStateStore, seeded: Seeded) -> None:
    run_rows = await rows(engine, flow_runs, org_id=seeded.org)
    steps = {s["step_execution_id"]: s for s in await rows(engine, flow_step_executions)}
    assert stranded_runs(run_rows, steps, max_attempts=store.policy.max_attempts) == []


async def test_a_run_continues_through_its_steps_with_one_write_transaction_each(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    writes: list[int] = []

    def count(conn: sa.Connection) -> None:
        if conn.get_execution_options().get(BEGIN_MODE_OPTION) != "DEFERRED":
            writes.append(1)

    worker = make_worker(engine, store)
    sa.event.listen(engine.sync_engine, "begin", count)
    try:
        outcomes = await worker.run_batch(seeded.org)
    finally:
        sa.event.remove(engine.sync_engine, "begin", count)
    # bump1 (claimed), then calc, bump2, bump3 continued by the commits before them.
    assert outcomes == [Outcome.COMMITTED] * 4
    # One fused claim + Running transaction for the first step (ADR 0003); then one
    # commit per step.
    assert len(writes) == 1 + 4
    await check_exactly_once(engine, seeded.org, expected_runs=[run.flow_run_id])
    attempts = await rows(engine, flow_step_attempts, org_id=seeded.org)
    # Every step entered with its own attempt and its own lease token.
    assert len(attempts) == 4
    assert len({a["lease_token_digest"] for a in attempts}) == 4
    assert {a["transaction_outcome"] for a in attempts} == {"Committed"}


async def test_a_continuation_limit_bounds_the_chain_and_leaves_the_rest_claimable(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    worker = make_worker(engine, store, continuation_limit=1)
    assert await worker.run_batch(seeded.org) == [Outcome.COMMITTED] * 2  # bump1, calc
    bump2 = await _step(engine, seeded, run.flow_run_id, "bump2")
    assert bump2["state"] == "Pending"  # not claimed: the chain was full
    assert (await drive(worker, seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED
    await check_exactly_once(engine, seeded.org, expected_runs=[run.flow_run_id])


async def test_a_continued_step_whose_worker_dies_is_recovered_by_lease_expiry_once(
    engine: AsyncEngine, store: FlowRunStateStore, clock: ShiftedClock
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "executed" and await _key(engine, seeded, fence) == "bump2":
            raise _Died  # the process is gone: bump2 stays Running under its lease

    dying = make_worker(engine, store, owner="dead", hook=hook, heartbeat=False)
    try:
        await dying.run_batch(seeded.org)
        raise AssertionError("the worker did not die")
    except _Died:
        pass
    bump2 = await _step(engine, seeded, run.flow_run_id, "bump2")
    assert bump2["state"] == "Running" and bump2["lease_owner"] == "dead"
    sweeper = Sweeper(engine, store)
    assert (await sweeper.sweep_org(seeded.org))[0] == 0  # the lease is still live
    clock.advance(seconds=store.policy.lease_duration_ms / 1000 + 1)
    assert (await sweeper.sweep_org(seeded.org))[0] == 1  # expiry fences the attempt
    clock.advance(hours=2)  # past its recovery backoff floor
    other = make_worker(engine, store, owner="other")
    done = await drive(other, seeded.org, run.flow_run_id, sweeper=sweeper)
    assert done.state is RunState.SUCCEEDED
    await check_exactly_once(engine, seeded.org, expected_runs=[run.flow_run_id])
    for key in MUTATION_STEPS:
        counts = await step_counts(engine, seeded.org, run.flow_run_id, key)
        assert (counts.committed_attempts, counts.business_events) == (1, 1), key
    attempts = await rows(
        engine, flow_step_attempts, org_id=seeded.org, step_execution_id=bump2["step_execution_id"]
    )
    assert sorted(a["transaction_outcome"] for a in attempts) == ["Committed", "Fenced"]


async def _race(
    engine: AsyncEngine,
    store: FlowRunStateStore,
    seeded: Seeded,
    run_id: str,
    action: str,
) -> list[Outcome]:
    """Run a batch whose continued step ``calc`` meets ``action`` before its commit."""
    fired: list[bool] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at != "executed" or fired or await _key(engine, seeded, fence) != "bump2":
            return
        fired.append(True)
        if action == "cancel":
            await store.request_cancel(seeded.org, run_id)
        else:
            await store.delete_run(seeded.org, run_id)

    worker = make_worker(engine, store, hook=hook)
    outcomes = await worker.run_batch(seeded.org)
    assert fired
    return outcomes


async def test_cancellation_racing_a_continued_step_fences_its_commit(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    outcomes = await _race(engine, store, seeded, run.flow_run_id, "cancel")
    # bump1 and calc committed; bump2 (continued) lost its fence to the cancellation.
    assert outcomes == [Outcome.COMMITTED, Outcome.COMMITTED, Outcome.FENCE_LOST]
    bump2 = await step_counts(engine, seeded.org, run.flow_run_id, "bump2")
    assert (bump2.committed_attempts, bump2.business_events, bump2.audit_records) == (0, 0, 0)
    sweeper = Sweeper(engine, store)
    assert (await sweeper.sweep_org(seeded.org))[1] == 1
    final = await store.get_run(seeded.org, run.flow_run_id)
    assert final.state is RunState.CANCELLED
    await check_exactly_once(
        engine, seeded.org, expected_runs=[run.flow_run_id], cancelled=[run.flow_run_id]
    )


async def test_delete_racing_a_continued_step_fences_its_commit(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    outcomes = await _race(engine, store, seeded, run.flow_run_id, "delete")
    assert outcomes == [Outcome.COMMITTED, Outcome.COMMITTED, Outcome.FENCE_LOST]
    bump2 = await step_counts(engine, seeded.org, run.flow_run_id, "bump2")
    assert (bump2.committed_attempts, bump2.business_events) == (0, 0)
    sweeper = Sweeper(engine, store)
    await sweeper.sweep_org(seeded.org)
    final = await store.get_run(seeded.org, run.flow_run_id, include_deleted=True)
    assert final.state is RunState.CANCELLED and final.is_deleted
    await check_exactly_once(
        engine, seeded.org, expected_runs=[run.flow_run_id], cancelled=[run.flow_run_id]
    )


async def test_a_pause_before_the_commit_refuses_the_continuation(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    fired: list[bool] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at != "executed" or fired or await _key(engine, seeded, fence) != "calc":
            return
        fired.append(True)
        async with db.transaction(engine) as c:
            await pause_run_txn(c, seeded.org, run.flow_run_id, OPS)

    worker = make_worker(engine, store, hook=hook)
    # bump1, then calc (continued; paused while it ran): calc's commit does not continue.
    assert await worker.run_batch(seeded.org) == [Outcome.COMMITTED] * 2
    paused = await store.get_run(seeded.org, run.flow_run_id)
    assert paused.state is RunState.RUNNABLE and paused.operator_paused_at is not None
    bump2 = await _step(engine, seeded, run.flow_run_id, "bump2")
    assert bump2["state"] == "Pending" and bump2["attempt_count"] == 0
    assert await worker.run_batch(seeded.org) == []  # paused: nothing claimable
    await _invariants(engine, store, seeded)
    async with db.transaction(engine) as c:
        await resume_run_txn(c, seeded.org, run.flow_run_id, OPS)
    assert (await drive(worker, seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED
    await check_exactly_once(engine, seeded.org, expected_runs=[run.flow_run_id])
