"""§22.3-08 on MariaDB: a business-mutating worker takes its declared business/parent and
history locks before the Flow root, lifecycle-only cancellation starts at the root and
never takes a business lock — so their race has no root→business reverse edge.

Proven by observing InnoDB's lock waits (``information_schema.INNODB_LOCK_WAITS`` with
``INNODB_LOCKS``) in both interleavings. The worker's first step creates a record: its
record and history INSERTs are its business locks, and its lifecycle locking read rides
right after them in the same round trip (ADR 0016), so the worker never holds business
locks without asking for the root next.

* While the worker holds its business locks and the root, the cancellation waits on the
  *root* only — never on a business row — and runs once the worker's step committed.
* While the cancellation holds the root, the worker waits on the *root* only (never the
  cancellation on a business row); the worker's stale fence then rolls every business
  write back.
* A lease recovered while the worker waits on its root (its business locks held) does
  the same: the recovery commits a new token, the worker's revalidation refuses the old
  one and every business write rolls back; the run then completes with each step once.

No deadlock in any order. (Real TiDB is not installable here; MariaDB's InnoDB is the
real-locking backend.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, LeaseFence, RunState
from runtime_svc.kernel.decisions import Recovered
from runtime_svc.schema import business_events
from runtime_svc.worker import Outcome
from services import db
from tests.integration.kernel.conftest import ShiftedClock
from tests.integration.kernel.helpers import count
from tests.integration.worker.support import (
    MUTATION_STEPS,
    drive,
    make_worker,
    run_records,
    seed,
    start_run,
    step_counts,
)

pytestmark = pytest.mark.parametrize("kernel_db_url", ["mariadb"], indirect=True)

_LOCK_WAITS = text(
    "SELECT r.trx_mysql_thread_id AS waiting_thread, b.trx_mysql_thread_id AS blocking_thread, "
    "l.lock_table AS waited_table "
    "FROM information_schema.INNODB_LOCK_WAITS w "
    "JOIN information_schema.INNODB_TRX r ON r.trx_id = w.requesting_trx_id "
    "JOIN information_schema.INNODB_TRX b ON b.trx_id = w.blocking_trx_id "
    "JOIN information_schema.INNODB_LOCKS l ON l.lock_id = w.requested_lock_id "
    "JOIN information_schema.PROCESSLIST p ON p.ID = r.trx_mysql_thread_id "
    "WHERE p.DB = DATABASE()"
)


async def _lock_waits(engine: AsyncEngine) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        return [dict(r) for r in (await conn.execute(_LOCK_WAITS)).mappings()]


async def _until_waiting(
    engine: AsyncEngine, on: str | None = None, polls: int = 200
) -> list[dict[str, Any]]:
    """The lock waits once one appears (``on``: once one waits on that table)."""
    for _ in range(polls):
        waits = await _lock_waits(engine)
        if waits and (on is None or any(_table(w["waited_table"]) == on for w in waits)):
            return waits
        # InnoDB refreshes its lock snapshot when last read more than 0.1 s ago.
        await asyncio.sleep(0.15)
    raise AssertionError(f"no lock wait{'' if on is None else ' on ' + on} appeared")


def _table(waited: str) -> str:
    return waited.split(".")[-1].strip("`")


async def test_cancellation_never_waits_on_the_workers_business_locks(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    holding, release = asyncio.Event(), asyncio.Event()
    threads: list[int] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "in_txn" and not holding.is_set() and conn is not None:
            # Business locks held (the record and history INSERTs) and, right after them
            # in their round trip, root, step and attempt; nothing written beyond them.
            threads.append((await conn.execute(text("SELECT CONNECTION_ID()"))).scalar_one())
            holding.set()
            await release.wait()

    worker = make_worker(engine, store, hook=hook)
    task = asyncio.ensure_future(worker.run_batch(seeded.org))
    await asyncio.wait_for(holding.wait(), 60)
    # Lifecycle-only cancellation: root -> step -> attempt, no business lock. It waits on
    # the root the worker holds — on nothing else, never on a business row.
    cancelling = asyncio.ensure_future(store.request_cancel(seeded.org, run.flow_run_id))
    waits = await _until_waiting(engine, on="flow_runs")
    assert {_table(w["waited_table"]) for w in waits} == {"flow_runs"}
    assert all(w["blocking_thread"] == threads[0] for w in waits)
    assert not cancelling.done()
    release.set()
    # The worker's fence held: its step committed; the cancellation then ran (a step the
    # worker continued into loses its fence to it).
    outcomes = await asyncio.wait_for(task, 60)
    assert outcomes[0] is Outcome.COMMITTED
    assert all(o is Outcome.FENCE_LOST for o in outcomes[1:])
    cancelled = await asyncio.wait_for(cancelling, 30)
    assert type(cancelled).__name__ == "CancelRecorded"
    assert len(await run_records(engine, seeded.org)) == 1
    assert await count(engine, business_events, org_id=seeded.org) == 1
    assert (await store.get_run(seeded.org, run.flow_run_id)).state in {
        RunState.CANCEL_REQUESTED,
        RunState.CANCELLED,
    }


async def test_the_worker_waits_on_the_root_and_never_the_cancellation_on_a_business_row(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    ready, go, business_locked = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "executed" and not ready.is_set():
            ready.set()
            await go.wait()
        elif at == "in_txn":
            business_locked.set()  # only after the root's lock (never while we hold it)

    worker = make_worker(engine, store, hook=hook)
    task = asyncio.ensure_future(worker.run_batch(seeded.org))
    await asyncio.wait_for(ready.wait(), 60)
    async with db.transaction(engine) as cancel:
        cancel_thread = (await cancel.execute(text("SELECT CONNECTION_ID()"))).scalar_one()
        await store.cancel_txn(cancel, seeded.org, run.flow_run_id, delete=False)
        go.set()  # the worker opens its business transaction while we hold the root
        # Its record and history INSERTs go out with its root lock (ADR 0016): it waits
        # there, inside that round trip, with its business locks held.
        waits = await _until_waiting(engine, on="flow_runs")
        assert not business_locked.is_set()
        assert {_table(w["waited_table"]) for w in waits} == {"flow_runs"}
        assert all(w["blocking_thread"] == cancel_thread for w in waits)
        assert all(w["waiting_thread"] != cancel_thread for w in waits)
    # The cancellation committed; the worker's root fence is stale: everything rolls back.
    assert await asyncio.wait_for(task, 60) == [Outcome.FENCE_LOST]
    assert await run_records(engine, seeded.org) == []
    assert await count(engine, business_events, org_id=seeded.org) == 0


async def test_a_lease_recovered_while_the_worker_waits_on_its_root_rolls_its_writes_back(
    engine: AsyncEngine, store: FlowRunStateStore, clock: ShiftedClock
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    ready, go = asyncio.Event(), asyncio.Event()
    fences: list[LeaseFence] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "executed" and not ready.is_set():
            fences.append(fence)
            ready.set()
            await go.wait()

    worker = make_worker(engine, store, hook=hook)
    task = asyncio.ensure_future(worker.run_batch(seeded.org))
    await asyncio.wait_for(ready.wait(), 60)
    [fence] = fences
    step = {"o": seeded.org, "s": fence.step_execution_id}
    async with db.transaction(engine) as holder:
        # Hold the step: the recovery locks the root, then waits here.
        await holder.execute(
            text(
                "SELECT state FROM flow_step_executions "
                "WHERE org_id = :o AND step_execution_id = :s FOR UPDATE"
            ),
            step,
        )
        clock.advance(seconds=store.policy.lease_duration_ms / 1000 + 1)
        recovery = asyncio.ensure_future(
            store.recover_step(seeded.org, run.flow_run_id, fence.step_execution_id)
        )
        await _until_waiting(engine, on="flow_step_executions")
        go.set()
        # The worker inserts its record and history row, then waits on the root the
        # recovery holds (one round trip, ADR 0016).
        waits = await _until_waiting(engine, on="flow_runs")
        assert {_table(w["waited_table"]) for w in waits} == {
            "flow_runs",
            "flow_step_executions",
        }
    assert isinstance(await asyncio.wait_for(recovery, 60), Recovered)
    # The recovery committed a new token and attempt; the worker's revalidation refuses its
    # own: the record and history INSERTs roll back with its transaction.
    assert await asyncio.wait_for(task, 60) == [Outcome.FENCE_LOST]
    assert await run_records(engine, seeded.org) == []
    assert await count(engine, business_events, org_id=seeded.org) == 0
    clock.advance(hours=1)
    assert (await drive(worker, seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED
    [account] = await run_records(engine, seeded.org)
    assert account["record_version"] == len(MUTATION_STEPS)
    for key in MUTATION_STEPS:
        c = await step_counts(engine, seeded.org, run.flow_run_id, key)
        assert (c.committed_attempts, c.business_events) == (1, 1), key
