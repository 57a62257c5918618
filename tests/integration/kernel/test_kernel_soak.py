"""A bounded, seeded soak: concurrent workers, injected lease expiries, worker deaths,
rollbacks, deletes and a retry policy lowered mid-flight over a few dozen runs, then an
invariant check over the database (no root/step divergence, one committed attempt per
step, every business write backed by exactly one committed attempt, nothing stranded
``Running`` without a live lease, and — after a drain of the due work under the lowered
policy — no run left non-terminal without a future transition, ``tests/support/
invariants``)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter

from runtime_svc.kernel import (
    FailureClass,
    FinishRun,
    LeaseFence,
    RetryPolicy,
    RunState,
    StepFailure,
    StepState,
)
from runtime_svc.kernel.states import TERMINAL_RUN_STATES
from runtime_svc.kernel.tables import root_step_consistent
from runtime_svc.schema import flow_runs, flow_step_attempts, flow_step_executions, records
from services.errors import FenceLostError
from tests.integration.kernel.conftest import TEST_POLICY, World
from tests.integration.kernel.helpers import QUEUE, claim, next_step, rows, start
from tests.integration.kernel.test_kernel_commit import business_commit
from tests.support.invariants import stranded_runs

RUNS, WORKERS, ROUNDS = 24, 4, 30
SEED = 20240601


#: The policy a redeployed worker runs with: fewer attempts than the steps were scheduled
#: under, so some due steps have already spent their budget (issue 10, item 4).
LOWERED = dataclasses.replace(TEST_POLICY, max_attempts=2)


async def worker(
    world: World, rng: random.Random, name: str, policy: RetryPolicy = TEST_POLICY
) -> Counter[str]:
    seen: Counter[str] = Counter()
    store = world.other_store(policy=policy)
    for _ in range(ROUNDS):
        batch = await store.eligible_work(world.org, QUEUE, limit=5)
        if not batch:
            await asyncio.sleep(0)
            continue
        fence = await store.claim(world.org, rng.choice(batch), lease_owner=name)
        if not isinstance(fence, LeaseFence):
            seen["not_eligible"] += 1
            continue
        roll = rng.random()
        try:
            if roll < 0.1:
                seen["died_after_claim"] += 1  # lease left to expire
                continue
            fence = await store.mark_running(world.org, fence)
            if roll < 0.2:
                seen["died_while_running"] += 1
                continue
            if roll < 0.35:
                await store.record_rollback(
                    world.org, fence, StepFailure(FailureClass.RETRYABLE, "soak")
                )
                seen["rolled_back"] += 1
                continue
            advance = FinishRun() if rng.random() < 0.4 else next_step(f"s_{fence.attempt_id}")
            await business_commit(world, fence, fence.attempt_id, advance)
            seen["committed"] += 1
        except FenceLostError:
            seen["fence_lost"] += 1
    return seen


async def chaos(world: World, rng: random.Random, run_ids: list[str]) -> None:
    for _ in range(ROUNDS):
        await asyncio.sleep(0)
        roll = rng.random()
        if roll < 0.3:
            world.clock.advance(milliseconds=TEST_POLICY.lease_duration_ms + 1)
            await world.store.recover_expired(world.org)
        elif roll < 0.45:
            world.clock.advance(milliseconds=TEST_POLICY.max_delay_ms)
        elif roll < 0.55:
            await world.store.delete_run(world.org, rng.choice(run_ids))
        elif roll < 0.6:
            for run_id in await world.store.pending_cancellations(world.org):
                await world.store.complete_cancel(world.org, run_id)


async def test_randomized_soak_keeps_the_database_invariants(world: World) -> None:
    rng = random.Random(SEED)
    run_ids = [await start(world) for _ in range(RUNS)]
    results = await asyncio.gather(
        *(
            worker(world, random.Random(rng.random()), f"w{i}", LOWERED if i == 0 else TEST_POLICY)
            for i in range(WORKERS)
        ),
        chaos(world, random.Random(rng.random()), run_ids),
    )
    # One run is certain to have spent the lowered budget: two rolled-back attempts.
    spent_run = await start(world)
    for _ in range(LOWERED.max_attempts):
        world.clock.advance(milliseconds=TEST_POLICY.max_delay_ms)
        fence = await world.store.mark_running(world.org, await claim(world, spent_run))
        await world.store.record_rollback(
            world.org, fence, StepFailure(FailureClass.RETRYABLE, "soak")
        )
    # Drain: recover whatever died, finish cancellations, then — once every backoff has
    # passed — offer every due step to a claim under the lowered policy (a step whose
    # budget is spent ends its run there, in the claim transaction).
    world.clock.advance(days=1)
    await world.store.recover_expired(world.org)
    for run_id in await world.store.pending_cancellations(world.org):
        await world.store.complete_cancel(world.org, run_id)
    world.clock.advance(days=1)
    lowered = world.other_store(policy=LOWERED)
    spent = 0
    for candidate in await lowered.eligible_work(world.org, QUEUE, limit=RUNS * 4):
        claimed = await lowered.claim(world.org, candidate, lease_owner="drain")
        if isinstance(claimed, LeaseFence):
            fence = await lowered.mark_running(world.org, claimed)
            await business_commit(world, fence, fence.attempt_id, FinishRun())
        elif claimed.reason == "attempt_budget_spent":
            spent += 1

    totals: Counter[str] = sum((r for r in results if r is not None), Counter())
    assert totals["committed"] > 0, totals

    runs = {r["flow_run_id"]: r for r in await rows(world.engine, flow_runs, org_id=world.org)}
    steps = {
        s["step_execution_id"]: s
        for s in await rows(world.engine, flow_step_executions, org_id=world.org)
    }
    attempts = await rows(world.engine, flow_step_attempts, org_id=world.org)
    business = await rows(world.engine, records, org_id=world.org)

    for run in runs.values():
        current = steps.get(run["current_step_execution_id"])
        state = RunState.from_code(run["runtime_state"])
        step_state = None if current is None else StepState.from_code(current["state"])
        assert root_step_consistent(state, step_state), (run, current)
        assert state is not RunState.RUNNING  # nothing stranded after the drain
    committed = [a for a in attempts if a["transaction_outcome"] == "Committed"]
    per_step = Counter(a["step_execution_id"] for a in committed)
    assert all(n == 1 for n in per_step.values()), per_step
    assert sorted(r["record_id"] for r in business) == sorted(a["attempt_id"] for a in committed)
    started = [a for a in attempts if a["transaction_outcome"] == "Started"]
    for a in started:
        assert steps[a["step_execution_id"]]["state"] in ("Claimed", "Running")
    assert len(started) == 0  # every lease was recovered or ended
    # No run is left with no future transition: after the drain, every one is terminal.
    stranded = stranded_runs(runs.values(), steps, max_attempts=LOWERED.max_attempts, drained=True)
    assert stranded == []
    assert spent > 0, "no step had spent its budget under the lowered policy"
    assert {RunState.from_code(r["runtime_state"]) for r in runs.values()} <= TERMINAL_RUN_STATES
