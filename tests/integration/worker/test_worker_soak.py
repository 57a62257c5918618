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
import random
from collections import Counter
from collections.abc import Awaitable
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, LeaseFence, RunState, StepState
from runtime_svc.kernel.tables import root_step_consistent
from runtime_svc.schema import business_events, flow_runs, flow_step_attempts, flow_step_executions
from runtime_svc.worker import Outcome, StepWorker, Sweeper
from tests.integration.kernel.conftest import ShiftedClock
from tests.integration.kernel.helpers import rows
from tests.integration.worker.support import TERMINAL, make_worker, seed, start_run
from tests.support.invariants import stranded_runs

SEED = 20261129
RUNS = 200
WORKERS = 4
ROUNDS = 200
_TERMINAL_OUTCOMES = frozenset(
    {
        "Committed",
        "RolledBack",
        "CommitUnknown",
        "RollbackUnknown",
        "Fenced",
        "Cancelled",
        "Abandoned",
        "PreTransactionFailed",
    }
)


class SimulatedKill(BaseException):
    """A worker dying mid-step: not an ``Exception``, so no handler in the worker sees it
    (its open transaction rolls back the way a lost connection's would)."""


async def _snapshot_terminal(
    engine: AsyncEngine, org: str, seen: dict[str, tuple[Any, ...]]
) -> None:
    """Record every terminal attempt; a later change of one is a rewrite."""
    for a in await rows(engine, flow_step_attempts, org_id=org):
        if a["transaction_outcome"] in _TERMINAL_OUTCOMES:
            now = (a["transaction_outcome"], a["attempt_state_version"], a["finished_at"])
            before = seen.setdefault(a["attempt_id"], now)
            assert before == now, f"terminal attempt {a['attempt_id']} rewritten: {before} -> {now}"


async def _survive(batch: Awaitable[list[Outcome]]) -> list[Outcome]:
    """A killed worker's batch ends where it died; the worker is replaced next round."""
    try:
        return await batch
    except SimulatedKill:
        return []


@pytest.mark.timeout(900)  # hundreds of runs; generous under CPU contention
async def test_worker_soak_keeps_exactly_once_and_state_invariants(
    engine: AsyncEngine, store: FlowRunStateStore, clock: ShiftedClock
) -> None:
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
    seen: dict[str, tuple[Any, ...]] = {}
    totals = Counter[Outcome]()
    for round_ in range(ROUNDS):
        results = await asyncio.gather(*(_survive(w.run_batch(org)) for w in workers))
        for r in results:
            totals.update(r)
        await sweeper.sweep_org(org)
        await _snapshot_terminal(engine, org, seen)
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

    assert totals[Outcome.COMMITTED] > RUNS * 3, totals
    assert injected["lease_expiry"] > 0 and injected["cancel"] > 0, injected
    assert injected["kill_in_txn"] > 0 and injected["kill_before_txn"] > 0, injected
    assert totals[Outcome.FENCE_LOST] > 0, totals
    runs = {r["flow_run_id"]: r for r in await rows(engine, flow_runs, org_id=org)}
    steps = {
        s["step_execution_id"]: s for s in await rows(engine, flow_step_executions, org_id=org)
    }
    attempts = {a["attempt_id"]: a for a in await rows(engine, flow_step_attempts, org_id=org)}
    events = await rows(engine, business_events, org_id=org)

    # no root/step divergence, nothing stranded Running
    for run in runs.values():
        state = RunState.from_code(run["runtime_state"])
        current = steps.get(run["current_step_execution_id"])
        step_state = None if current is None else StepState.from_code(current["state"])
        assert root_step_consistent(state, step_state), (run, current)
        assert state in TERMINAL
        if run["flow_run_id"] not in cancelled:
            assert state is RunState.SUCCEEDED, run
    # at most one Committed attempt per step, and every step that Succeeded has one
    committed = Counter(
        a["step_execution_id"] for a in attempts.values() if a["transaction_outcome"] == "Committed"
    )
    assert all(n == 1 for n in committed.values()), committed
    for s in steps.values():
        if s["state"] == "Succeeded":
            assert committed[s["step_execution_id"]] == 1, s
    # every committed business change belongs to exactly one Committed attempt of its step
    per_step = Counter(e["step_execution_id"] for e in events)
    for e in events:
        attempt = attempts[e["attempt_id"]]
        assert attempt["transaction_outcome"] == "Committed", (e, attempt)
        assert attempt["step_execution_id"] == e["step_execution_id"]
    assert all(n == 1 for n in per_step.values()), per_step
    await _snapshot_terminal(engine, org, seen)
    assert set(run_ids) == set(runs)
