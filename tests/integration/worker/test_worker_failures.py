"""Worker failure paths (§5.2, §12.2-§12.4, §13.3-§13.4), on SQLite and MariaDB:
deadlock victim, late discovery, commit-outcome ambiguity, stale worker after recovery,
cancellation while running, unsupported step kinds."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pymysql
import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

import runtime_svc.kernel.store as kernel_store
from runtime_svc.kernel import (
    CheckpointInput,
    FailureClass,
    FirstStep,
    FlowRunStateStore,
    LeaseFence,
    RunState,
    StartRunRequest,
    StepFailure,
)
from runtime_svc.resources import LateResourceDiscoveryError, business_key
from runtime_svc.schema import flow_step_attempts, flow_step_executions
from runtime_svc.worker import Outcome, Sweeper
from services.db_batch import Write
from services.errors import CommitOutcomeUnknownError
from services.faults import CrashPoint, connection_lost_after_commit
from tests.integration.kernel.conftest import ShiftedClock
from tests.integration.kernel.helpers import rows
from tests.integration.worker.support import (
    MUTATION_STEPS,
    Seeded,
    drive,
    make_worker,
    run_records,
    seed,
    start_run,
    step_counts,
)

Hook = Callable[[str, LeaseFence, AsyncConnection | None], Awaitable[None]]


def once_at(
    engine: AsyncEngine,
    phase: str,
    step: str,
    seeded: Seeded,
    action: Callable[[LeaseFence], Awaitable[None]],
) -> Hook:
    """A phase hook that runs ``action`` once, when ``step`` reaches ``phase``."""
    fired: list[bool] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at != phase or fired:
            return
        steps = await rows(
            engine,
            flow_step_executions,
            org_id=seeded.org,
            step_execution_id=fence.step_execution_id,
        )
        if steps and steps[0]["plan_step_key"] == step:
            fired.append(True)
            await action(fence)

    return hook


async def _assert_once(engine: AsyncEngine, seeded: Seeded, run_id: str) -> None:
    [account] = await run_records(engine, seeded.org)
    assert account["record_version"] == len(MUTATION_STEPS)
    for key in MUTATION_STEPS:
        c = await step_counts(engine, seeded.org, run_id, key)
        assert (c.step_rows, c.committed_attempts, c.business_events, c.audit_records) == (
            1,
            1,
            1,
            1,
        ), key


async def _step_row(
    engine: AsyncEngine, seeded: Seeded, run_id: str, key: str
) -> dict[str, object]:
    [row] = await rows(
        engine, flow_step_executions, org_id=seeded.org, flow_run_id=run_id, plan_step_key=key
    )
    return row


async def test_deadlock_victim_rolls_back_and_retries_from_the_same_checkpoint(
    engine: AsyncEngine, store: FlowRunStateStore, clock: ShiftedClock
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    fired: list[int] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "in_txn" and not fired:
            step = await _step_row(engine, seeded, run.flow_run_id, "bump1")
            if step["step_execution_id"] == fence.step_execution_id:
                fired.append(1)
                # What the driver raises for ER_LOCK_DEADLOCK: the server rolled back.
                raise pymysql.err.OperationalError(1213, "Deadlock found (injected)")

    worker = make_worker(engine, store, hook=hook)
    assert await worker.run_batch(seeded.org) == [Outcome.RETRY_SCHEDULED]
    before = await _step_row(engine, seeded, run.flow_run_id, "bump1")
    assert before["state"] == "RetryScheduled"
    assert await run_records(engine, seeded.org) == []  # the business write rolled back
    # Not due yet: durable backoff from the database clock.
    assert await worker.run_batch(seeded.org) == []
    clock.advance(hours=1)
    done = await drive(worker, seeded.org, run.flow_run_id)
    assert done.state is RunState.SUCCEEDED
    after = await _step_row(engine, seeded, run.flow_run_id, "bump1")
    assert after["input_checkpoint_id"] == before["input_checkpoint_id"]
    outcomes = sorted(
        a["transaction_outcome"]
        for a in await rows(
            engine,
            flow_step_attempts,
            org_id=seeded.org,
            step_execution_id=after["step_execution_id"],
        )
    )
    assert outcomes == ["Committed", "RolledBack"]
    await _assert_once(engine, seeded, run.flow_run_id)


async def test_late_resource_discovery_rolls_the_whole_step_back_and_retries(
    engine: AsyncEngine, store: FlowRunStateStore, clock: ShiftedClock
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    fired: list[int] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "in_txn" and not fired:
            fired.append(1)
            raise LateResourceDiscoveryError(business_key("Account", "acc-late"))

    worker = make_worker(engine, store, hook=hook)
    assert await worker.run_batch(seeded.org) == [Outcome.RETRY_SCHEDULED]
    assert await run_records(engine, seeded.org) == []
    clock.advance(hours=1)
    assert (await drive(worker, seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED
    await _assert_once(engine, seeded, run.flow_run_id)


async def test_connection_lost_after_commit_reads_the_marker_and_never_repeats_the_step(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    worker = make_worker(engine, store)
    with connection_lost_after_commit(CrashPoint.AFTER_STEP_COMMIT, "bump1"):
        first, *continued = await worker.run_batch(seeded.org)
    assert first is Outcome.ALREADY_COMMITTED
    # The lost COMMIT is proven durable, so the continuation it carried (the run's next
    # step, claimed in the same transaction) is run by the same worker, not stranded.
    assert continued and set(continued) == {Outcome.COMMITTED}
    assert (await drive(worker, seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED
    await _assert_once(engine, seeded, run.flow_run_id)


async def test_commit_outcome_unknown_quarantines_step_and_run_without_retry(
    engine: AsyncEngine, store: FlowRunStateStore, clock: ShiftedClock
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "in_txn":
            raise CommitOutcomeUnknownError("connection lost during commit (injected)")

    worker = make_worker(engine, store, hook=hook)
    assert await worker.run_batch(seeded.org) == [Outcome.QUARANTINED]
    clock.advance(days=1)
    assert await worker.run_batch(seeded.org) == []  # never retried
    assert await Sweeper(engine, store).sweep_org(seeded.org) == (0, 0)
    got = await store.get_run(seeded.org, run.flow_run_id)
    assert got.state is RunState.QUARANTINED
    step = await _step_row(engine, seeded, run.flow_run_id, "bump1")
    assert step["state"] == "Quarantined"
    [attempt] = await rows(
        engine, flow_step_attempts, org_id=seeded.org, step_execution_id=step["step_execution_id"]
    )
    assert attempt["transaction_outcome"] == "CommitUnknown"


async def test_stale_worker_after_lease_recovery_cannot_commit(
    engine: AsyncEngine, store: FlowRunStateStore, clock: ShiftedClock
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    sweeper = Sweeper(engine, store)

    async def expire_and_recover(fence: LeaseFence) -> None:
        clock.advance(seconds=store.policy.lease_duration_ms / 1000 + 1)
        recovered, _ = await sweeper.sweep_org(seeded.org)
        assert recovered == 1

    worker = make_worker(
        engine, store, hook=once_at(engine, "executed", "bump1", seeded, expire_and_recover)
    )
    assert await worker.run_batch(seeded.org) == [Outcome.FENCE_LOST]
    assert await run_records(engine, seeded.org) == []  # its business writes rolled back
    step = await _step_row(engine, seeded, run.flow_run_id, "bump1")
    assert step["state"] == "RetryScheduled"
    assert await worker.run_batch(seeded.org) == []  # pre-due claim rejected
    assert (await store.get_run(seeded.org, run.flow_run_id)).state is RunState.RUNNABLE
    clock.advance(hours=1)
    assert (await drive(worker, seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED
    await _assert_once(engine, seeded, run.flow_run_id)


@pytest.mark.parametrize("delete", [False, True], ids=["cancel", "delete"])
async def test_cancellation_while_running_is_cleaned_up_to_cancelled(
    engine: AsyncEngine, store: FlowRunStateStore, delete: bool
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)

    async def cancel(fence: LeaseFence) -> None:
        if delete:  # delete wins the race with the running step's final commit
            await store.delete_run(seeded.org, fence.flow_run_id)
        else:
            await store.request_cancel(seeded.org, fence.flow_run_id)

    worker = make_worker(engine, store, hook=once_at(engine, "executed", "bump2", seeded, cancel))
    sweeper = Sweeper(engine, store)
    done = await drive(worker, seeded.org, run.flow_run_id, sweeper=sweeper)
    assert done.state is RunState.CANCELLED
    assert (await step_counts(engine, seeded.org, run.flow_run_id, "bump1")).business_events == 1
    bump2 = await step_counts(engine, seeded.org, run.flow_run_id, "bump2")
    assert (bump2.committed_attempts, bump2.business_events) == (0, 0)
    [account] = await run_records(engine, seeded.org)
    assert account["record_version"] == 1  # bump2's write rolled back with its fence


async def test_delete_after_a_committed_step_keeps_the_committed_advancement(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    # One step per batch: the delete lands between bump1's commit and the next claim.
    worker = make_worker(engine, store, continuation_limit=0)
    assert await worker.run_batch(seeded.org) == [Outcome.COMMITTED]  # commit wins
    await store.delete_run(seeded.org, run.flow_run_id)
    sweeper = Sweeper(engine, store)
    done = await drive(worker, seeded.org, run.flow_run_id, sweeper=sweeper)
    assert done.state is RunState.CANCELLED and done.is_deleted
    bump1 = await step_counts(engine, seeded.org, run.flow_run_id, "bump1")
    assert (bump1.committed_attempts, bump1.business_events) == (1, 1)  # not relabelled
    step = await _step_row(engine, seeded, run.flow_run_id, "bump1")
    assert step["state"] == "Succeeded"


async def test_unsupported_step_kind_fails_the_run_closed(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    # A run whose current step names a plan step that does not exist in its plan.
    created = await store.create_run(
        seeded.scope,
        StartRunRequest(
            plan_id=seeded.plan_id,
            first_step=FirstStep("no_such_step", "EffectSubmit", "durable_mutation"),
            input=CheckpointInput(context={}),
        ),
    )
    worker = make_worker(engine, store)
    assert await worker.run_batch(seeded.org) == [Outcome.FAILED]
    got = await store.get_run(seeded.org, created.run.flow_run_id)
    assert got.state is RunState.TERMINAL_FAILED
    assert got.terminal_cause_code


@pytest.mark.parametrize("lane", ["dependency_wakeup", "effect_completion"])
async def test_a_step_on_a_wait_or_effect_lane_is_served_and_fails_closed(
    engine: AsyncEngine, store: FlowRunStateStore, lane: str
) -> None:
    """Issue 10, item 4: no lane a durable step can be on is left unserved (the run would
    stay Runnable for ever); a step the executor cannot run yet ends the run closed."""
    seeded = await seed(engine)
    created = await store.create_run(
        seeded.scope,
        StartRunRequest(
            plan_id=seeded.plan_id,
            first_step=FirstStep("no_such_step", "DependencyWait", lane),
            input=CheckpointInput(context={}),
        ),
    )
    worker = make_worker(engine, store)
    assert await worker.run_batch(seeded.org) == [Outcome.FAILED]
    got = await store.get_run(seeded.org, created.run.flow_run_id)
    assert got.state is RunState.TERMINAL_FAILED


async def test_a_policy_lowered_below_a_steps_attempts_ends_the_run(
    engine: AsyncEngine, store: FlowRunStateStore, clock: ShiftedClock
) -> None:
    """Issue 10, item 4: a step scheduled under a larger attempt budget is ended by the
    claim that finds its budget spent, instead of staying Runnable and unclaimable."""
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    worker = make_worker(engine, store)
    for _ in range(2):  # two attempts under the 4-attempt policy, both rolled back
        candidate = (await store.eligible_work(seeded.org, "durable_mutation"))[0]
        claimed = await store.claim(seeded.org, candidate, lease_owner="w")
        assert isinstance(claimed, LeaseFence)
        fence = await store.mark_running(seeded.org, claimed)
        await store.record_rollback(seeded.org, fence, StepFailure(FailureClass.RETRYABLE, "x"))
        clock.advance(hours=2)
    lowered = FlowRunStateStore(
        engine, policy=dataclasses.replace(store.policy, max_attempts=2), clock=clock
    )
    redeployed = make_worker(engine, lowered)
    assert await redeployed.run_batch(seeded.org) == [Outcome.NOT_ELIGIBLE]
    got = await store.get_run(seeded.org, run.flow_run_id)
    assert got.state is RunState.TERMINAL_FAILED
    assert got.terminal_cause_code == "retry_budget_exhausted"
    assert await worker.run_batch(seeded.org) == []  # nothing left to claim


async def test_a_lost_rollback_response_is_a_proven_rollback_and_retries_once(
    engine: AsyncEngine,
    store: FlowRunStateStore,
    clock: ShiftedClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """V22.3-10: the step's transaction fails (a deadlock victim) and the response to its
    ROLLBACK is lost with the connection. COMMIT was never sent, so nothing of the step
    can be durable (the server rolls an orphaned transaction back): the worker invalidates
    the connection, records a proven rollback and retries the step from the same input —
    never quarantines it, never applies it twice."""
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    lost: list[int] = []
    real_rollback = AsyncConnection.rollback

    async def rollback(self: AsyncConnection) -> None:
        if lost == [1]:
            lost.append(2)
            raise pymysql.err.OperationalError(2013, "Lost connection during ROLLBACK")
        await real_rollback(self)

    monkeypatch.setattr(AsyncConnection, "rollback", rollback)

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "in_txn" and not lost:
            lost.append(1)
            raise pymysql.err.OperationalError(1213, "Deadlock found (injected)")

    worker = make_worker(engine, store, hook=hook)
    assert await worker.run_batch(seeded.org) == [Outcome.RETRY_SCHEDULED]
    assert lost == [1, 2]  # the rollback response really was lost
    assert await run_records(engine, seeded.org) == []
    step = await _step_row(engine, seeded, run.flow_run_id, "bump1")
    assert step["state"] == "RetryScheduled"
    clock.advance(hours=1)
    done = await drive(worker, seeded.org, run.flow_run_id)
    assert done.state is RunState.SUCCEEDED
    outcomes = sorted(
        a["transaction_outcome"]
        for a in await rows(
            engine,
            flow_step_attempts,
            org_id=seeded.org,
            step_execution_id=step["step_execution_id"],
        )
    )
    assert outcomes == ["Committed", "RolledBack"]
    await _assert_once(engine, seeded, run.flow_run_id)


async def test_a_failing_checkpoint_insert_rolls_the_business_writes_back(
    engine: AsyncEngine,
    store: FlowRunStateStore,
    clock: ShiftedClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """V22.3-12: the output checkpoint is inserted in the step's business transaction,
    after its record, history, event and audit writes; when that insert fails, every one
    of them rolls back with it and the step is retried from its input."""
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    failed: list[int] = []
    real_insert = kernel_store.checkpoint_insert

    def checkpoint_insert(*args: Any, **kwargs: Any) -> tuple[Write, Any]:
        write, meta = real_insert(*args, **kwargs)

        async def fail_once(rowcount: int) -> None:
            # The INSERT's outcome is decided after it ran (in the commit's batch on
            # MariaDB): the first one fails as a deadlock would.
            if not failed:
                failed.append(1)
                raise pymysql.err.OperationalError(1213, "checkpoint insert failed (injected)")

        return dataclasses.replace(write, check=fail_once), meta

    monkeypatch.setattr(kernel_store, "checkpoint_insert", checkpoint_insert)
    worker = make_worker(engine, store)
    assert await worker.run_batch(seeded.org) == [Outcome.RETRY_SCHEDULED]
    assert failed == [1]
    assert await run_records(engine, seeded.org) == []  # the business write rolled back
    counts = await step_counts(engine, seeded.org, run.flow_run_id, "bump1")
    assert (counts.business_events, counts.audit_records, counts.committed_attempts) == (0, 0, 0)
    clock.advance(hours=1)
    done = await drive(worker, seeded.org, run.flow_run_id)
    assert done.state is RunState.SUCCEEDED
    await _assert_once(engine, seeded, run.flow_run_id)
