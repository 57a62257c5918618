"""§22.7 fairness and throughput at configured admission (issue 14 item 3), on SQLite and
MariaDB, with real compiled plans, real claims and real business transactions.

* one hot tenant with ten times the load cannot starve a cold tenant: the deficit
  scheduler serves the cold tenant at every visit, so all its runs finish within the
  first passes while most of the hot backlog is still queued (asserted on the order the
  worker processed candidates in, never on wall-clock time);
* 500 orgs with due work are all served, each exactly once per rotation, and the
  admission pass adds no second visit of an org before every org had one;
* durable steps run to completion at a configured admission budget: every admitted
  attempt commits and nothing is deferred by a budget a serial worker cannot exceed.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.admission.controller import AdmissionController, Decision
from runtime_svc.kernel import FlowRunStateStore
from runtime_svc.worker import Outcome
from tests.integration.admission.support import (
    RecordingWorker,
    publish_admission,
    seed_org,
    states,
)
from tests.integration.worker.support import new_org, start_run

HOT_RUNS = 40
COLD_RUNS = 4
QUANTUM = 2


async def test_a_hot_tenant_at_ten_times_the_load_cannot_starve_a_cold_tenant(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    # The hot org sorts first, so the rotation visits it first in every pass.
    stem = new_org()
    hot = await seed_org(engine, store, f"{stem}-a-hot", HOT_RUNS)
    cold = await seed_org(engine, store, f"{stem}-b-cold", COLD_RUNS)
    admission = AdmissionController(engine, budget=4, quantum=QUANTUM)
    worker = RecordingWorker(engine, store, admission=admission, org_batch=100)

    for _ in range(HOT_RUNS):  # bounded: far more passes than the cold tenant needs
        await worker.run_once()
        done = await states(engine, cold.org, cold.run_ids)
        if set(done.values()) == {"Succeeded"}:
            break
    assert set((await states(engine, cold.org, cold.run_ids)).values()) == {"Succeeded"}

    ours = [p for p in worker.log if p.org in (hot.org, cold.org)]
    cold_positions = [i for i, p in enumerate(ours) if p.org == cold.org]
    assert len(cold_positions) == COLD_RUNS
    # Each pass serves at most one quantum of each org: the k-th cold step is processed
    # within the first (k // QUANTUM + 1) passes, i.e. behind at most that many hot
    # quanta — however long the hot backlog is.
    for k, position in enumerate(cold_positions):
        assert position < (k // QUANTUM + 1) * 2 * QUANTUM, (
            k,
            position,
            [p.org[-4:] for p in ours][:12],
            admission.decisions,
        )
    hot_states = await states(engine, hot.org, hot.run_ids)
    assert sum(1 for s in hot_states.values() if s == "Runnable") >= HOT_RUNS - 2 * COLD_RUNS
    assert all(p.outcome is Outcome.COMMITTED for p in ours)


async def test_durable_steps_run_to_completion_at_a_configured_admission(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    org = new_org()
    runs = await seed_org(engine, store, org, 6, mutations=3)
    await publish_admission(
        engine,
        org,
        {
            "org": {"max_inflight": 2, "weight": 2},
            "lanes": {"durable_mutation": {"max_inflight": 1, "weight": 4}},
            "profiles": {"durable_orchestration": {"max_inflight": 2}},
            "object_classes": {"Account": {"max_inflight": 1}},
        },
    )
    admission = AdmissionController(engine, budget=4, quantum=3)
    worker = RecordingWorker(engine, store, admission=admission)
    for _ in range(30):
        await worker.run_batch(org)
        if set((await states(engine, org, runs.run_ids)).values()) == {"Succeeded"}:
            break
    assert set((await states(engine, org, runs.run_ids)).values()) == {"Succeeded"}
    # 6 runs x 3 durable steps, each admitted once and committed once.
    assert [p.outcome for p in worker.log] == [Outcome.COMMITTED] * 18
    # Each durable step is either admitted (claimed) or continued under its run's ticket
    # (step continuation is charged to the org like an admission).
    assert admission.decisions[Decision.ADMITTED] + admission.decisions[Decision.CONTINUED] == 18
    assert admission.decisions[Decision.ADMITTED] >= 6
    assert admission.decisions[Decision.POLICY] == 0
    assert admission.inflight() == 0  # every ticket released


async def test_a_budget_of_zero_in_flight_defers_without_writing(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    org = new_org()
    runs = await seed_org(engine, store, org, 2)
    await publish_admission(
        engine, org, {"flows": {runs.seeded.plan.flow.api_name: {"max_inflight": 0}}}
    )
    admission = AdmissionController(engine, budget=4)
    worker = RecordingWorker(engine, store, admission=admission)
    assert await worker.run_batch(org) == [Outcome.NOT_ELIGIBLE, Outcome.NOT_ELIGIBLE]
    assert worker.log == []  # never claimed
    assert set((await states(engine, org, runs.run_ids)).values()) == {"Runnable"}
    assert admission.decisions[Decision.POLICY] == 2


async def test_a_step_continuation_is_charged_to_the_org_and_stops_without_credit(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    org = new_org()
    runs = await seed_org(engine, store, org, 1, mutations=3)
    # One admission per visit: the admitted step spends the org's credit, so the commit
    # must not continue the run into its next step (that waits for the next visit).
    admission = AdmissionController(engine, budget=4, quantum=1)
    worker = RecordingWorker(engine, store, admission=admission)
    assert await worker.run_batch(org) == [Outcome.COMMITTED]
    assert admission.decisions[Decision.ADMITTED] == 1
    assert admission.decisions[Decision.CONTINUED] == 0
    assert set((await states(engine, org, runs.run_ids)).values()) == {"Runnable"}

    # With credit for the whole run, the two later steps are continued, each charged.
    generous = AdmissionController(engine, budget=4, quantum=8)
    chained = RecordingWorker(engine, store, admission=generous)
    assert await chained.run_batch(org) == [Outcome.COMMITTED] * 2
    assert generous.decisions[Decision.ADMITTED] == 1
    assert generous.decisions[Decision.CONTINUED] == 1
    assert generous.scheduler.credit(org) == 8 - 2
    assert set((await states(engine, org, runs.run_ids)).values()) == {"Succeeded"}


async def test_a_sparse_org_is_served_before_a_backlogged_one(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    # The hot org sorts first and keeps a backlog; the cold org's visits drain it. When a
    # new cold run appears, the next pass serves it ahead of the hot org's quantum (DRR++
    # "sparse flows first") — and the hot org is still served in that pass.
    stem = new_org()
    hot = await seed_org(engine, store, f"{stem}-a-hot", HOT_RUNS)
    cold = await seed_org(engine, store, f"{stem}-b-cold", 1)
    admission = AdmissionController(engine, budget=4, quantum=QUANTUM)
    worker = RecordingWorker(engine, store, admission=admission, org_batch=100)

    await worker.run_once()  # both new: rotation order, one quantum of the hot org first
    first = [p.org for p in worker.log if p.org in (hot.org, cold.org)]
    assert first == [hot.org] * QUANTUM + [cold.org]
    assert admission.scheduler.backlogged(hot.org)
    assert not admission.scheduler.backlogged(cold.org)

    later = await start_run(store, cold.seeded, label="late")
    worker.log.clear()
    await worker.run_once()
    second = [(p.org, p.run_id) for p in worker.log if p.org in (hot.org, cold.org)]
    assert second[0] == (cold.org, later.flow_run_id)
    assert [org for org, _ in second[1:]] == [hot.org] * QUANTUM
    assert all(p.outcome is Outcome.COMMITTED for p in worker.log if p.org == cold.org)
    assert admission.scheduler.backlogged(hot.org)
