"""§22.7 paused/waiting population claim-query behaviour under admission (issue 14 item
3), on SQLite and MariaDB: with far more operator-paused and Waiting runs than runnable
ones, an admission pass reads and admits exactly the runnable candidates — the parked
population never reaches admission (no deferral is counted for it, no budget or credit
is spent on it), each claim query stays bounded by the org's pass limit (plus one peeked
row), and nothing in
the parked population is written."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.admission.controller import AdmissionController, Decision
from runtime_svc.kernel import CheckpointInput, EnterWait, FlowRunStateStore
from runtime_svc.kernel.store_operator import OperatorActor, pause_run_txn
from runtime_svc.worker import Outcome
from services import db
from tests.integration.admission.support import RecordingWorker, seed_org, states
from tests.integration.worker.support import new_org

RUNNABLE, PAUSED, WAITING = 3, 20, 10
QUANTUM = 4


async def test_a_parked_population_is_never_read_or_admitted(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    org = new_org()
    runs = await seed_org(engine, store, org, RUNNABLE + PAUSED + WAITING)
    runnable = runs.run_ids[:RUNNABLE]
    paused = runs.run_ids[RUNNABLE : RUNNABLE + PAUSED]
    waiting = runs.run_ids[RUNNABLE + PAUSED :]
    actor = OperatorActor("alice", "ops-key")
    async with db.transaction(engine) as conn:
        for run_id in paused:
            await pause_run_txn(conn, org, run_id, actor)
    for run_id in waiting:
        [candidate] = [
            c
            for c in await store.eligible_work(org, "durable_mutation", limit=100)
            if c.flow_run_id == run_id
        ]
        fence = await store.claim(org, candidate, lease_owner="parker")
        fence = await store.mark_running(org, fence)  # type: ignore[arg-type]
        await store.commit_step(org, fence, output=CheckpointInput({"w": 1}), advance=EnterWait())
    before = await states(engine, org, [*paused, *waiting])

    admission = AdmissionController(engine, budget=4, quantum=QUANTUM)
    worker = RecordingWorker(engine, store, admission=admission)
    limits: list[int] = []
    seen: list[str] = []
    original = store.eligible_work

    async def eligible_work(org_id: str, lane: str, *, limit: int = 50):  # type: ignore[no-untyped-def]
        limits.append(limit)
        found = await original(org_id, lane, limit=limit)
        seen.extend(c.flow_run_id for c in found)
        return found

    store.eligible_work = eligible_work  # type: ignore[method-assign]
    assert await worker.run_batch(org) == [Outcome.COMMITTED] * RUNNABLE
    assert sorted(seen) == sorted(runnable)
    # Bounded by the pass limit plus the one-row peek that tells a backlogged org from a
    # sparse one (the peeked row is read, never admitted).
    assert limits and max(limits) <= QUANTUM + 1
    assert admission.decisions[Decision.ADMITTED] == RUNNABLE
    assert sum(v for k, v in admission.decisions.items() if k != Decision.ADMITTED) == 0
    assert admission.inflight() == 0
    assert await states(engine, org, [*paused, *waiting]) == before
    assert set(before[r] for r in waiting) == {"Waiting"}
    assert set(before[r] for r in paused) == {"Runnable"}
