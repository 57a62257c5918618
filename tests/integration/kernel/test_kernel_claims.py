"""Claim protocol (§12.1) on SQLite and MariaDB: one winner among concurrent claimers,
duplicate delivery, eligibility by due time, bounded and stable candidate batches."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.kernel import (
    CheckpointInput,
    EnterWait,
    FailureClass,
    FlowRunStateStore,
    LeaseFence,
    NotEligible,
    RunState,
    StepFailure,
    StepState,
)
from runtime_svc.kernel.decisions import RetryScheduled
from runtime_svc.kernel.store_reads import eligible_work_txn
from runtime_svc.schema import flow_runs, flow_step_attempts, flow_step_executions
from services.db import strategy_for
from tests.integration.kernel.conftest import TEST_POLICY, World
from tests.integration.kernel.helpers import QUEUE, claim, count, rows, start
from tests.support.databases import status_counters
from tests.support.statements import clock_reads, watched_statements


def _barrier_clock(world: World, parties: int) -> object:
    """On MariaDB, hold every claimer at the start of its transaction until all have
    begun, so their ``FOR UPDATE`` reads truly race; SQLite serialises at ``BEGIN
    IMMEDIATE``, where a barrier would only wait for the busy timeout."""
    if not world.engine.dialect.name.startswith(("mysql", "mariadb")):
        return world.clock
    barrier = asyncio.Barrier(parties)

    async def clock(conn: AsyncConnection) -> datetime:
        now = await world.clock(conn)
        with contextlib.suppress(TimeoutError, asyncio.BrokenBarrierError):
            await asyncio.wait_for(barrier.wait(), timeout=2)
        return now

    return clock


async def test_two_workers_claim_the_same_candidate_and_exactly_one_wins(world: World) -> None:
    run_id = await start(world)
    [candidate] = [c for c in await world.store.eligible_work(world.org, QUEUE)]
    clock = _barrier_clock(world, 2)
    workers = [
        FlowRunStateStore(world.engine, policy=TEST_POLICY, clock=clock)  # type: ignore[arg-type]
        for _ in range(2)
    ]

    results = await asyncio.gather(
        *(w.claim(world.org, candidate, lease_owner=f"w{i}") for i, w in enumerate(workers))
    )

    winners = [r for r in results if isinstance(r, LeaseFence)]
    losers = [r for r in results if isinstance(r, NotEligible)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert losers[0].reason in {"root_not_runnable", "superseded", "lost_race"}
    assert await count(world.engine, flow_step_attempts, org_id=world.org) == 1
    [root] = await rows(world.engine, flow_runs, org_id=world.org, flow_run_id=run_id)
    assert root["runtime_state"] == "Running" and root["state_version"] == 1
    [step] = await rows(world.engine, flow_step_executions, org_id=world.org)
    assert step["state"] == "Claimed" and step["lease_owner"] == winners[0].lease_owner
    # Only the digest of the winner's token is stored, never the token itself.
    assert step["lease_token"] == winners[0].token_digest != winners[0].lease_token


async def test_duplicate_scheduler_delivery_claims_once(world: World) -> None:
    await start(world)
    [candidate] = await world.store.eligible_work(world.org, QUEUE)

    first = await world.store.claim(world.org, candidate, lease_owner="w1")
    again = await world.store.claim(world.org, candidate, lease_owner="w2")

    assert isinstance(first, LeaseFence)
    assert again == NotEligible("root_not_runnable")
    assert await count(world.engine, flow_step_attempts, org_id=world.org) == 1
    assert await world.store.eligible_work(world.org, QUEUE) == []


async def test_a_claims_writes_carry_its_commit_behind_a_row_guard(world: World) -> None:
    """ADR 0014: a claim ends with its fused root/step UPDATE and attempt INSERT; where
    statements share a round trip those carry its COMMIT, the UPDATE's row count guarded
    on the server first, and its frame sends none. Elsewhere the frame commits."""
    await start(world)
    [candidate] = await world.store.eligible_work(world.org, QUEUE)
    sent: list[str] = []

    def watch(*args: Any) -> None:
        sent.append(str(args[2]))

    sa.event.listen(world.engine.sync_engine, "before_cursor_execute", watch)
    try:
        fence = await world.store.claim(world.org, candidate, lease_owner="w1", running=True)
    finally:
        sa.event.remove(world.engine.sync_engine, "before_cursor_execute", watch)
    assert isinstance(fence, LeaseFence)
    writes = [sql for sql in sent if "INSERT INTO flow_step_attempts" in sql]
    assert len(writes) == 1
    if strategy_for(world.engine.dialect).multi_statements:
        assert writes[0].endswith(";\nCOMMIT") and "ROW_COUNT() <> 2" in writes[0]
    else:
        assert "COMMIT" not in writes[0] and "ROW_COUNT" not in writes[0]
    [step] = await rows(world.engine, flow_step_executions, org_id=world.org)
    assert step["state"] == "Running" and step["lease_token"] == fence.token_digest


async def test_claim_records_the_immutable_attempt_inputs(world: World) -> None:
    run_id = await start(world)
    fence = await claim(world, run_id)

    [attempt] = await rows(world.engine, flow_step_attempts, org_id=world.org)
    assert attempt["transaction_outcome"] == "Started"
    assert attempt["attempt_number"] == 1 == fence.attempt_number
    assert attempt["root_state_version_at_claim"] == 1 == fence.root_state_version
    assert attempt["retry_policy_digest"] == TEST_POLICY.digest()
    assert attempt["plan_digest"] == world.plan_digest
    floor = attempt["recovery_backoff_floor_ms"]
    assert floor == TEST_POLICY.backoff_ms(1, fence.step_execution_id)
    assert floor >= TEST_POLICY.floor_ms(1)
    assert attempt["lease_token_digest"] == fence.token_digest


async def test_an_old_epoch_scheduler_neither_sees_nor_claims_v2_work(world: World) -> None:
    await start(world)
    [candidate] = await world.store.eligible_work(world.org, QUEUE)
    old = world.other_store(ownership_epoch=2)

    assert await old.eligible_work(world.org, QUEUE) == []
    assert await old.claim(world.org, candidate, lease_owner="old") == NotEligible("epoch_mismatch")


async def test_eligible_work_is_bounded_stably_ordered_and_skips_waiting_runs(
    world: World,
) -> None:
    runs = [await start(world) for _ in range(5)]
    # Two runs park in Waiting: they must never be part of a candidate batch.
    for run_id in runs[:2]:
        fence = await claim(world, run_id)
        fence = await world.store.mark_running(world.org, fence)
        await world.store.commit_step(
            world.org, fence, output=CheckpointInput({"w": 1}), advance=EnterWait()
        )

    batch = await world.store.eligible_work(world.org, QUEUE, limit=2)
    everything = await world.store.eligible_work(world.org, QUEUE, limit=50)

    assert len(batch) == 2
    assert batch == everything[:2]
    assert {c.flow_run_id for c in everything} == set(runs[2:])
    order = [(c.run_after, c.step_execution_id) for c in everything]
    assert order == sorted(order)
    for run_id in runs[:2]:
        run = await world.store.get_run(world.org, run_id)
        assert run.state is RunState.WAITING and run.interview_status == "Paused"


async def test_eligible_work_reads_both_claimable_states_in_one_bounded_statement(
    world: World,
) -> None:
    """Pending and RetryScheduled candidates come from one statement (one bounded range
    per state), merged in ``(run_after, step id)`` order and cut at the limit."""
    retried = [await start(world) for _ in range(2)]
    for run_id in retried:
        fence = await world.store.mark_running(world.org, await claim(world, run_id))
        decision = await world.store.record_rollback(
            world.org, fence, StepFailure(FailureClass.RETRYABLE, "boom")
        )
        assert isinstance(decision, RetryScheduled)
    pending = [await start(world) for _ in range(2)]
    world.clock.advance(hours=2)  # every retry is due (its backoff is at most an hour)

    with watched_statements(world.engine) as seen:
        everything = await world.store.eligible_work(world.org, QUEUE, limit=50)
    selects = [s for s in seen if not s.startswith("BEGIN")]
    assert len(selects) - len(clock_reads(world.engine, selects)) == 1, seen
    assert {c.flow_run_id for c in everything} == set(retried + pending)
    states = {
        r["flow_run_id"]: r["state"]
        for r in await rows(world.engine, flow_step_executions, org_id=world.org)
    }
    assert {states[c.flow_run_id] for c in everything} == {"Pending", "RetryScheduled"}
    order = [(c.run_after, c.step_execution_id) for c in everything]
    assert order == sorted(order)
    for limit in (1, 2, 3):
        assert (
            await world.store.eligible_work(world.org, QUEUE, limit=limit) == (everything[:limit])
        )


async def test_eligible_work_reads_its_ranges_first_and_keeps_them_in_memory(
    world: World,
) -> None:
    """On MariaDB the discovery statement reads each state's bounded range first and only
    then each candidate's root by primary key (``STRAIGHT_JOIN``): read from the root side,
    the optimizer would scan every run of the org. Its derived tables carry no text column
    (the root's ``trace_context`` is read outside them), so they stay in memory (ADR 0015)."""
    if not strategy_for(world.engine.dialect).multi_statements:
        pytest.skip("MariaDB's join order and temporary tables")
    runs = [await start(world) for _ in range(60)]
    async with world.engine.connect() as conn:
        before = await status_counters(conn)
        found = await eligible_work_txn(conn, world.org, QUEUE, None, 2, 1)
        after = await status_counters(conn)
        await conn.rollback()

    assert len(found) == 2 and {c.flow_run_id for c in found} <= set(runs)
    assert all(c.trace_context is None or isinstance(c.trace_context, str) for c in found)
    reads = sum(
        after[k] - before[k]
        for k in after
        if k.startswith("Handler_read") and k in before and k != "Handler_read_key"
    )
    assert reads < len(runs) // 2, {k: after[k] - before[k] for k in after if k in before}
    assert after["Created_tmp_disk_tables"] == before["Created_tmp_disk_tables"]


async def test_eligible_work_ignores_other_queues_and_other_orgs(world: World) -> None:
    await start(world)
    assert await world.store.eligible_work(world.org, "effect_completion") == []
    assert await world.store.eligible_work("org_elsewhere", QUEUE) == []


async def test_claimed_step_projection_matches_root(world: World) -> None:
    run_id = await start(world)
    await claim(world, run_id)
    view = await world.store.support_view(world.org, run_id)
    assert view.run.state is RunState.RUNNING
    assert view.current_step is not None and view.current_step.state is StepState.CLAIMED
    assert view.run.interview_status == "Running"


async def test_eligible_work_on_the_database_clock_reads_it_in_its_own_query(
    world: World,
) -> None:
    """With the default durable clock (``services.db.db_now``: the server's own), the
    discovery query compares with the server's clock itself on MariaDB — one round trip,
    which also carries the read-only transaction's ``COMMIT`` (ADR 0013) — and decides
    due-ness as the clock read first does: a retry scheduled minutes ahead is not due."""
    due = await start(world)
    later = await start(world)
    fence = await world.store.mark_running(world.org, await claim(world, later))
    decision = await world.store.record_rollback(
        world.org, fence, StepFailure(FailureClass.RETRYABLE, "boom")
    )
    assert isinstance(decision, RetryScheduled)  # due a minute or more from now
    plain = FlowRunStateStore(world.engine, policy=TEST_POLICY)  # the default clock
    sent: list[str] = []

    def on_statement(*args: Any) -> None:
        sent.append(str(args[2]))

    sync = world.engine.sync_engine
    sa.event.listen(sync, "before_cursor_execute", on_statement)
    try:
        found = await plain.eligible_work(world.org, QUEUE)
    finally:
        sa.event.remove(sync, "before_cursor_execute", on_statement)
    assert [c.flow_run_id for c in found] == [due]
    assert found == await world.store.eligible_work(world.org, QUEUE)  # clock read first
    queries = [s for s in sent if not s.startswith("BEGIN")]
    if strategy_for(world.engine.dialect).multi_statements:
        [query] = queries
        assert "UTC_TIMESTAMP(6)" in query and query.endswith("COMMIT")
    else:
        assert len(clock_reads(world.engine, queries)) == 1 and len(queries) == 2
    world.clock.advance(hours=2)
    assert {c.flow_run_id for c in await world.store.eligible_work(world.org, QUEUE)} == {
        due,
        later,
    }
