"""§22.3-08 on MariaDB: a business-mutating worker takes its declared business/parent and
history locks before the Flow root, lifecycle-only cancellation starts at the root and
never takes a business lock — so their race has no root→business reverse edge.

Proven by observing InnoDB's lock waits (``information_schema.INNODB_LOCK_WAITS`` with
``INNODB_LOCKS``) in both interleavings: while the worker holds its business locks the
cancellation runs through without waiting at all; while the cancellation holds the root
the worker waits on the *root* row only (never the cancellation on a business row); the
worker's stale fence then rolls every business write back. No deadlock in either order.
(Real TiDB is not installable here; MariaDB's InnoDB is the real-locking backend.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, LeaseFence, RunState
from runtime_svc.schema import business_events
from runtime_svc.worker import Outcome
from services import db
from tests.integration.kernel.helpers import count
from tests.integration.worker.support import make_worker, run_records, seed, start_run

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


async def _until_waiting(engine: AsyncEngine, polls: int = 200) -> list[dict[str, Any]]:
    for _ in range(polls):
        waits = await _lock_waits(engine)
        if waits:
            return waits
        # InnoDB refreshes its lock snapshot when last read more than 0.1 s ago.
        await asyncio.sleep(0.15)
    raise AssertionError("no lock wait appeared")


def _table(waited: str) -> str:
    return waited.split(".")[-1].strip("`")


async def test_cancellation_never_waits_on_the_workers_business_locks(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    holding, release = asyncio.Event(), asyncio.Event()

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "in_txn" and not holding.is_set():
            holding.set()  # business locks held, writes done, the root not yet locked
            await release.wait()

    worker = make_worker(engine, store, hook=hook)
    task = asyncio.ensure_future(worker.run_batch(seeded.org))
    await asyncio.wait_for(holding.wait(), 60)
    # Lifecycle-only cancellation: root -> step -> attempt, no business lock; it commits
    # while the worker still holds every business lock of its step.
    cancelled = await asyncio.wait_for(store.request_cancel(seeded.org, run.flow_run_id), 30)
    assert type(cancelled).__name__ == "CancelRecorded"
    assert await _lock_waits(engine) == []
    release.set()
    assert await asyncio.wait_for(task, 60) == [Outcome.FENCE_LOST]
    assert await run_records(engine, seeded.org) == []  # the business write rolled back
    assert await count(engine, business_events, org_id=seeded.org) == 0
    got = await store.get_run(seeded.org, run.flow_run_id)
    assert got.state is RunState.CANCEL_REQUESTED


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
            business_locked.set()  # next: commit_step_txn locks the root

    worker = make_worker(engine, store, hook=hook)
    task = asyncio.ensure_future(worker.run_batch(seeded.org))
    await asyncio.wait_for(ready.wait(), 60)
    async with db.transaction(engine) as cancel:
        cancel_thread = (await cancel.execute(text("SELECT CONNECTION_ID()"))).scalar_one()
        await store.cancel_txn(cancel, seeded.org, run.flow_run_id, delete=False)
        go.set()  # the worker opens its business transaction while we hold the root
        await asyncio.wait_for(business_locked.wait(), 60)
        waits = await _until_waiting(engine)
        assert {_table(w["waited_table"]) for w in waits} == {"flow_runs"}
        assert all(w["blocking_thread"] == cancel_thread for w in waits)
        assert all(w["waiting_thread"] != cancel_thread for w in waits)
    # The cancellation committed; the worker's root fence is stale: everything rolls back.
    assert await asyncio.wait_for(task, 60) == [Outcome.FENCE_LOST]
    assert await run_records(engine, seeded.org) == []
    assert await count(engine, business_events, org_id=seeded.org) == 0
