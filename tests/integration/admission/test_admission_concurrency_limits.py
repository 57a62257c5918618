"""Per-key run concurrency limits (issue 14 item 3): "at most N concurrent runs of this
Flow", held as durable slots whose primary key bounds the holders (``flow_run_slots``).
On SQLite and MariaDB.

* racing acquirers — one per run, all at once — never take more than N slots;
* a run racing itself takes one slot, not two;
* several workers with separate admission controllers (separate processes as far as
  in-memory state goes) never run more than N runs of the Flow at once, and every run
  finishes; a refused run is left untouched (no claim, no write);
* a terminal holder's slot is reclaimed by the next acquirer.
"""

from __future__ import annotations

import asyncio

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.admission.controller import AdmissionController, Decision
from runtime_svc.admission.slots import RunSlots, flow_slot_key
from runtime_svc.kernel import FlowRunStateStore, LeaseFence
from runtime_svc.worker import Sweeper
from services import db
from tests.integration.admission.support import (
    RecordingWorker,
    live_started_runs,
    publish_admission,
    seed_org,
    states,
)
from tests.integration.worker.support import new_org

LIMIT = 2


async def test_racing_acquirers_never_take_more_than_n_slots(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    org = new_org()
    runs = await seed_org(engine, store, org, 10)
    slots = RunSlots(engine)
    key = flow_slot_key("Racy")
    won = await asyncio.gather(*(slots.acquire(org, key, run, 3) for run in runs.run_ids))
    assert sum(won) == 3
    holders = await slots.holders(org, key)
    assert len(holders) == 3 and all(h.live for h in holders)
    assert {h.flow_run_id for h in holders} == {
        r for r, w in zip(runs.run_ids, won, strict=True) if w
    }
    # The same run racing itself holds one slot.
    again = await asyncio.gather(
        *(slots.acquire(org, key, holders[0].flow_run_id, 3) for _ in range(4))
    )
    assert all(again)
    assert len(await slots.holders(org, key)) == 3


async def test_a_run_racing_itself_takes_one_slot(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    org = new_org()
    runs = await seed_org(engine, store, org, 1)
    slots = RunSlots(engine)
    key = flow_slot_key("Self")
    assert all(
        await asyncio.gather(*(slots.acquire(org, key, runs.run_ids[0], 5) for _ in range(5)))
    )
    assert [h.flow_run_id for h in await slots.holders(org, key)] == [runs.run_ids[0]]


async def test_a_terminal_holders_slot_is_reclaimed(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    org = new_org()
    first, second = (await seed_org(engine, store, org, 2)).run_ids
    slots = RunSlots(engine)
    key = flow_slot_key("Reclaim")
    assert await slots.acquire(org, key, first, 1)
    assert not await slots.acquire(org, key, second, 1)  # full: refused, nothing written
    async with db.transaction(engine) as conn:
        await store.cancel_txn(conn, org, first, delete=False)
    assert not await slots.acquire(org, key, second, 1)  # cancel requested: still live
    await Sweeper(engine, store).sweep_org(org)
    assert (await states(engine, org, [first]))[first] == "Cancelled"
    assert await slots.acquire(org, key, second, 1)
    assert [h.flow_run_id for h in await slots.holders(org, key)] == [second]
    assert not await slots.acquire(org, key, first, 0)


async def test_workers_with_separate_controllers_never_exceed_the_per_flow_limit(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    org = new_org()
    runs = await seed_org(engine, store, org, 6, mutations=3)
    flow = runs.seeded.plan.flow.api_name
    await publish_admission(engine, org, {"flows": {flow: {"max_concurrent_runs": LIMIT}}})
    peak: list[int] = []

    async def observe(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "executed":
            live = await live_started_runs(engine, org)
            peak.append(len(live))
            await asyncio.sleep(0)  # let the other workers race here

    workers = [
        RecordingWorker(
            engine,
            store,
            admission=AdmissionController(engine, budget=4, quantum=4),
            owner=f"w{i}",
            hook=observe,
        )
        for i in range(3)
    ]
    # After the first passes exactly LIMIT runs have started; the rest are untouched.
    await asyncio.gather(*(w.run_batch(org) for w in workers))
    assert len(await live_started_runs(engine, org)) <= LIMIT
    deferred = sum(w.admission.decisions[Decision.CONCURRENCY] for w in workers if w.admission)
    assert deferred > 0
    for _ in range(40):  # bounded
        if set((await states(engine, org, runs.run_ids)).values()) == {"Succeeded"}:
            break
        await asyncio.gather(*(w.run_batch(org) for w in workers))
        assert len(await live_started_runs(engine, org)) <= LIMIT
    assert set((await states(engine, org, runs.run_ids)).values()) == {"Succeeded"}
    assert peak and max(peak) <= LIMIT
