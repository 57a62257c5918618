"""Seeded, bounded soak of the WORKER (the kernel soak in
``tests/integration/kernel/test_kernel_soak.py`` drives the store directly; this one runs
real ``StepWorker`` s and ``Sweeper`` s over compiled plans): N concurrent workers,
injected lease expiries (clock jumps + recovery while a step is executing), worker kills
(a worker dies mid-step, inside or before its business transaction, and never comes back
to that step: only lease recovery can move it on) and cancellations, over hundreds of
runs, then an invariant checker over the database. SIGKILLs of real processes are proven
in ``tests/crash``."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter
from collections.abc import Awaitable

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, LeaseFence, RunState
from runtime_svc.schema import flow_runs, flow_step_executions
from runtime_svc.worker import Outcome, StepWorker, Sweeper
from tests.integration.kernel.conftest import ShiftedClock
from tests.integration.kernel.helpers import rows
from tests.integration.worker.conftest import WORKER_POLICY
from tests.integration.worker.support import TERMINAL, make_worker, seed, start_run
from tests.support.invariants import TerminalAttempts, check_exactly_once, stranded_runs

SEED = 20261129
RUNS = 200
WORKERS = 4
ROUNDS = 200
#: The chaos below expires leases by the dozen (one injected expiry fences every lease in
#: flight, and each kill leaves one to expire), so with the default budgets whether some
#: step exhausts its lease-expiry or attempt budget depends on how the four workers
#: interleave — a legitimate, policy-driven TerminalFailed that the exactly-once checker
#: (which expects every non-cancelled run to succeed) would report. The soak proves
#: exactly-once and the state invariants, so it runs with budgets chaos cannot exhaust;
#: the budgets themselves are proven in the kernel and recovery tests.
SOAK_POLICY = dataclasses.replace(WORKER_POLICY, max_attempts=1_000, max_lease_expiries=1_000)


class SimulatedKill(BaseException):
    """A worker dying mid-step: not an ``Exception``, so no handler in the worker sees it
    (its open transaction rolls back the way a lost connection's would)."""


async def _survive(batch: Awaitable[list[Outcome]]) -> list[Outcome]:
    """A killed worker's batch ends where it died; the worker is replaced next round."""
    try:
        return await batch
    except SimulatedKill:
        return []


@pytest.mark.timeout(900)  # hundreds of runs; generous under CPU contention
async def test_worker_soak_keeps_exactly_once_and_state_invariants(
    engine: AsyncEngine, clock: ShiftedClock
) -> None:
    store = FlowRunStateStore(engine, policy=SOAK_POLICY, clock=clock)
    rng = random.Random(SEED)
    seeded = await seed(engine)
    org = seeded.org
    run_ids = [(await start_run(store, seeded, label=f"r{i}")).flow_run_id for i in range(RUNS)]
    sweeper = Sweeper(engine, store)
    cancelled: set[str] = set()
    injected = Counter[str]()

    async def chaos(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "in_txn" and rng.random() < 0.03:
            injected["kill_in_txn"] += 1
            raise SimulatedKill
        if at != "executed":
            return
        roll = rng.random()
        if roll >= 0.97:
            injected["kill_before_txn"] += 1
            raise SimulatedKill
        if roll < 0.04:
            injected["lease_expiry"] += 1
            clock.advance(seconds=store.policy.lease_duration_ms / 1000 + 1)
            await sweeper.sweep_org(org)
        elif roll < 0.06 and fence.flow_run_id not in cancelled:
            injected["cancel"] += 1
            cancelled.add(fence.flow_run_id)
            await store.request_cancel(org, fence.flow_run_id)

    workers: list[StepWorker] = [
        make_worker(engine, store, owner=f"w{i}", hook=chaos, batch_size=5) for i in range(WORKERS)
    ]
    terminal = TerminalAttempts()
    totals = Counter[Outcome]()
    for round_ in range(ROUNDS):
        results = await asyncio.gather(*(_survive(w.run_batch(org)) for w in workers))
        for r in results:
            totals.update(r)
        await sweeper.sweep_org(org)
        await terminal.snapshot(engine, org)
        run_rows = await rows(engine, flow_runs, org_id=org)
        if round_ % 10 == 0:
            # Between rounds every non-terminal run still has a future transition: a due
            # claimable step, a lease with a deadline, or a pending cleanup (item 4).
            step_rows = {
                s["step_execution_id"]: s
                for s in await rows(engine, flow_step_executions, org_id=org)
            }
            assert stranded_runs(run_rows, step_rows, max_attempts=store.policy.max_attempts) == []
        states = [RunState.from_code(r["runtime_state"]) for r in run_rows]
        if all(s in TERMINAL for s in states):
            break
        if not any(results):
            clock.advance(minutes=30)  # past every backoff: retries become due
    else:
        raise AssertionError(f"soak did not finish in {ROUNDS} rounds: {totals}, {injected}")

    assert injected["lease_expiry"] > 0 and injected["cancel"] > 0, injected
    assert injected["kill_in_txn"] > 0 and injected["kill_before_txn"] > 0, injected
    assert totals[Outcome.FENCE_LOST] > 0, totals
    summary = await check_exactly_once(
        engine, org, expected_runs=run_ids, cancelled=cancelled, terminal=terminal
    )
    # Real work was done: counted in the database, because a killed worker's batch
    # returns no outcomes — with step continuation a batch holds whole chains of steps.
    committed = [a for a in summary.attempts.values() if a["transaction_outcome"] == "Committed"]
    assert len(committed) > RUNS * 3, (totals, len(committed))
