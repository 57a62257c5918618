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
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pymysql
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.admission.controller import AdmissionController, Decision
from runtime_svc.admission.slots import RunSlots, flow_slot_key, record_slot_key
from runtime_svc.kernel import (
    CheckpointInput,
    FirstStep,
    FlowRunStateStore,
    LeaseFence,
    StartRunRequest,
)
from runtime_svc.worker import Sweeper
from services import db
from tests.integration.admission.support import (
    RecordingWorker,
    live_started_runs,
    publish_admission,
    seed_org,
    states,
)
from tests.integration.worker.support import new_org, seed

LIMIT = 2


class _HoldForARefusal:
    """Parks the first step executions (bounded) until some worker's admission refused a
    run for its concurrency limit. With step continuation a worker runs a whole run in one
    go, so without the hold the workers may happen to run one after another and no limit
    is ever reached; parked, the runs that hold slots are live while the others race."""

    def __init__(self) -> None:
        self.workers: list[RecordingWorker] = []
        self._released = False

    def refusals(self) -> int:
        return sum(w.admission.decisions[Decision.CONCURRENCY] for w in self.workers if w.admission)

    async def until_a_refusal(self) -> None:
        for _ in range(100):  # at most ~5 s, once
            if self._released or self.refusals() > 0:
                break
            await asyncio.sleep(0.05)
        self._released = True


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


@contextmanager
def _deadlock_once(engine: AsyncEngine, prefix: str) -> Iterator[list[str]]:
    """The first statement starting with ``prefix`` fails as the backend reports a
    deadlock victim (MariaDB 1213; SQLite's busy ``database is locked``); the statements
    seen are listed."""
    seen: list[str] = []

    def before(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith(prefix):
            seen.append(statement)
            if len(seen) == 1:
                if engine.dialect.name == "sqlite":
                    raise sqlite3.OperationalError("database is locked")
                raise pymysql.err.OperationalError(1213, "Deadlock found when trying to get lock")

    sa.event.listen(engine.sync_engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        sa.event.remove(engine.sync_engine, "before_cursor_execute", before)


async def test_a_deadlocked_slot_insert_or_reclaim_is_retried_whole(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    """InnoDB may roll back one of two racing slot INSERTs (or an INSERT racing a
    reclaim's DELETE) as a deadlock victim: the acquire retries that transaction instead
    of failing the worker's pass, and the slot is held exactly once."""
    org = new_org()
    first, second = (await seed_org(engine, store, org, 2)).run_ids
    slots = RunSlots(engine)
    key = flow_slot_key("Deadlock")
    with _deadlock_once(engine, "INSERT INTO FLOW_RUN_SLOTS") as inserts:
        assert await slots.acquire(org, key, first, 1)
    assert len(inserts) == 2  # the victim, then its retry
    assert [h.flow_run_id for h in await slots.holders(org, key)] == [first]
    async with db.transaction(engine) as conn:
        await store.cancel_txn(conn, org, first, delete=False)
    await Sweeper(engine, store).sweep_org(org)
    with _deadlock_once(engine, "DELETE FROM FLOW_RUN_SLOTS") as deletes:
        assert await slots.acquire(org, key, second, 1)  # reclaims the terminal holder
    assert len(deletes) == 2
    assert [h.flow_run_id for h in await slots.holders(org, key)] == [second]


async def test_workers_with_separate_controllers_never_exceed_the_per_flow_limit(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    org = new_org()
    runs = await seed_org(engine, store, org, 6, mutations=3)
    flow = runs.seeded.plan.flow.api_name
    await publish_admission(engine, org, {"flows": {flow: {"max_concurrent_runs": LIMIT}}})
    peak: list[int] = []
    hold = _HoldForARefusal()

    async def observe(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "executed":
            live = await live_started_runs(engine, org)
            peak.append(len(live))
            await hold.until_a_refusal()  # the other workers race here

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
    hold.workers = workers
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


async def test_per_record_limit_runs_one_run_per_record_at_a_time_across_flows(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    """``admission.records.<Object>.max_concurrent_runs = 1``: of the runs about one
    record (its after-save trigger's subject), only one is started at a time, whatever
    their Flow and however many workers race; runs about other records go on meanwhile;
    a refused run is left untouched; every run finishes."""
    org = new_org()
    seeded = await seed(engine, org, mutations=3, pure_step=False)
    first = seeded.plan.step(seeded.plan.start_step)
    subjects = ["Account:acc-1"] * 3 + ["Account:acc-2"] * 2 + [None]
    ids = []
    for i, subject in enumerate(subjects):
        result = await store.create_run(
            seeded.scope,
            StartRunRequest(
                plan_id=seeded.plan_id,
                first_step=FirstStep(first.key, first.kind.value, "durable_mutation"),
                input=CheckpointInput(context={"variables": {"label": f"r{i}", "n": i}}),
                subject_record=subject,
            ),
        )
        ids.append(result.run.flow_run_id)
    await publish_admission(engine, org, {"records": {"Account": {"max_concurrent_runs": 1}}})
    by_subject = {s: {r for r, x in zip(ids, subjects, strict=True) if x == s} for s in subjects}
    peaks: dict[str | None, int] = {}
    hold = _HoldForARefusal()

    async def observe(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "executed":
            live = await live_started_runs(engine, org)
            for subject, runs in by_subject.items():
                peaks[subject] = max(peaks.get(subject, 0), len(live & runs))
            await hold.until_a_refusal()  # the other workers race here

    workers = [
        RecordingWorker(
            engine,
            store,
            admission=AdmissionController(engine, budget=6, quantum=6),
            owner=f"w{i}",
            hook=observe,
        )
        # One more worker than runs that may be live at once (one per record, one
        # without a subject), so some worker must meet a full record.
        for i in range(4)
    ]
    hold.workers = workers
    await asyncio.gather(*(w.run_batch(org) for w in workers))
    live = await live_started_runs(engine, org)
    assert len(live & by_subject["Account:acc-1"]) <= 1
    assert len(live & by_subject["Account:acc-2"]) <= 1
    deferred = sum(w.admission.decisions[Decision.CONCURRENCY] for w in workers if w.admission)
    assert deferred > 0
    for _ in range(60):  # bounded
        if set((await states(engine, org, ids)).values()) == {"Succeeded"}:
            break
        await asyncio.gather(*(w.run_batch(org) for w in workers))
    assert set((await states(engine, org, ids)).values()) == {"Succeeded"}
    assert peaks["Account:acc-1"] == 1 and peaks["Account:acc-2"] == 1
    # One slot row per record key at most; the run without a subject took none.
    for subject in ("Account:acc-1", "Account:acc-2"):
        assert len(await RunSlots(engine).holders(org, record_slot_key(subject))) <= 1
