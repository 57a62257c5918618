"""The final fenced commit (§12.2) on SQLite and MariaDB: it shares the business
transaction, so a lost fence rolls every business write back; terminal attempt outcomes
are never overwritten; two terminal updates of one attempt have exactly one winner."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import update

from runtime_svc.kernel import (
    CheckpointInput,
    FailureClass,
    FinishRun,
    LeaseFence,
    RunState,
    StepFailure,
    StepState,
)
from runtime_svc.kernel.decisions import AlreadyCommitted, RetryScheduled
from runtime_svc.kernel.tables import root_step_consistent
from runtime_svc.schema import (
    flow_checkpoints,
    flow_step_attempts,
    flow_step_executions,
    records,
)
from services import db
from services.errors import FenceLostError, InvalidArgumentError
from tests.integration.kernel.conftest import World
from tests.integration.kernel.helpers import claim, count, next_step, rows, start


async def business_commit(
    world: World, fence: LeaseFence, record_id: str, advance: Any = None
) -> None:
    """A worker's business transaction: a record write, then the kernel's final commit."""
    now = datetime.now().astimezone()
    async with db.transaction(world.engine) as conn:
        await conn.execute(
            records.insert().values(
                org_id=world.org,
                object_name="Task",
                record_id=record_id,
                record_version=1,
                fields="{}",
                created_at=now,
                updated_at=now,
            )
        )
        await world.store.commit_step_txn(
            conn,
            world.org,
            fence,
            output=CheckpointInput({"done": record_id}),
            advance=advance or next_step(),
        )


async def running(world: World, run_id: str) -> LeaseFence:
    return await world.store.mark_running(world.org, await claim(world, run_id))


async def assert_consistent(world: World, run_id: str) -> None:
    view = await world.store.support_view(world.org, run_id, include_deleted=True)
    step_state = None if view.current_step is None else view.current_step.state
    assert root_step_consistent(view.run.state, step_state), (view.run.state, step_state)


async def test_commit_writes_business_rows_checkpoint_attempt_step_and_root_together(
    world: World,
) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)

    await business_commit(world, fence, "rec-1")

    assert await count(world.engine, records, org_id=world.org) == 1
    [attempt] = await rows(world.engine, flow_step_attempts, org_id=world.org)
    assert attempt["transaction_outcome"] == "Committed" and attempt["attempt_state_version"] == 1
    old, new = sorted(
        await rows(world.engine, flow_step_executions, org_id=world.org),
        key=lambda r: r["plan_step_key"],
    )
    assert old["state"] == "Succeeded" and old["lease_token"] is None
    assert new["state"] == "Pending" and new["input_checkpoint_id"] == old["output_checkpoint_id"]
    run = await world.store.get_run(world.org, run_id)
    assert run.state is RunState.RUNNABLE and run.state_version == 2
    assert run.current_step_execution_id == new["step_execution_id"]
    assert run.current_checkpoint_id == old["output_checkpoint_id"]
    assert run.current_element == "s2" and run.interview_status == "Running"
    [checkpoint] = await rows(
        world.engine, flow_checkpoints, org_id=world.org, checkpoint_id=run.current_checkpoint_id
    )
    assert checkpoint["sequence"] == 2 and checkpoint["created_by_attempt_id"] == fence.attempt_id
    await assert_consistent(world, run_id)


async def test_stale_lease_token_commit_loses_the_fence_and_writes_nothing(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)
    stale = dataclasses.replace(fence, lease_token="not-the-token")
    checkpoints_before = await count(world.engine, flow_checkpoints, org_id=world.org)

    with pytest.raises(FenceLostError) as err:
        await business_commit(world, stale, "rec-stale")

    assert err.value.attributes["fence_reason"] == "lease_token"
    assert await count(world.engine, records, org_id=world.org) == 0
    assert await count(world.engine, flow_checkpoints, org_id=world.org) == checkpoints_before
    [attempt] = await rows(world.engine, flow_step_attempts, org_id=world.org)
    assert attempt["transaction_outcome"] == "Started"
    # The real holder still commits.
    await business_commit(world, fence, "rec-real")
    assert await count(world.engine, records, org_id=world.org) == 1


async def test_commit_before_claimed_to_running_is_fenced(world: World) -> None:
    run_id = await start(world)
    fence = await claim(world, run_id)  # still Claimed

    with pytest.raises(FenceLostError) as err:
        await business_commit(world, fence, "rec-early")

    assert err.value.attributes["fence_reason"] == "step_state"
    assert await count(world.engine, records, org_id=world.org) == 0


async def test_a_terminal_attempt_outcome_cannot_be_overwritten(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)
    await business_commit(world, fence, "rec-1")

    # Every later terminal transition through the store is refused...
    with pytest.raises(FenceLostError):
        await world.store.record_rollback(
            world.org, fence, StepFailure(FailureClass.RETRYABLE, "boom")
        )
    assert await world.store.quarantine_commit_unknown(world.org, fence) == AlreadyCommitted()
    with pytest.raises(FenceLostError):
        await business_commit(world, fence, "rec-again")
    # ...and so is a raw conditional UPDATE from Started with the old version.
    async with db.transaction(world.engine) as conn:
        with pytest.raises(FenceLostError):
            await db.cas_update(
                conn,
                flow_step_attempts,
                org_id=world.org,
                key={"attempt_id": fence.attempt_id},
                expected_version=0,
                values={"transaction_outcome": "RolledBack"},
                version_column="attempt_state_version",
            )
    [attempt] = await rows(world.engine, flow_step_attempts, org_id=world.org)
    assert attempt["transaction_outcome"] == "Committed"
    assert await count(world.engine, records, org_id=world.org) == 1


async def test_two_terminal_updates_race_on_one_started_attempt(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)

    async def commit() -> str:
        await business_commit(world, fence, "rec-race")
        return "committed"

    async def rollback() -> str:
        decision = await world.store.record_rollback(
            world.org, fence, StepFailure(FailureClass.RETRYABLE, "boom")
        )
        assert isinstance(decision, RetryScheduled)
        return "rolled_back"

    results = await asyncio.gather(commit(), rollback(), return_exceptions=True)

    winners = [r for r in results if isinstance(r, str)]
    losers = [r for r in results if isinstance(r, BaseException)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert isinstance(losers[0], FenceLostError)
    [attempt] = await rows(world.engine, flow_step_attempts, org_id=world.org)
    expected = "Committed" if winners == ["committed"] else "RolledBack"
    assert attempt["transaction_outcome"] == expected
    assert await count(world.engine, records, org_id=world.org) == (expected == "Committed")
    await assert_consistent(world, run_id)


async def test_checkpoint_with_credentials_is_rejected_before_any_write(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)

    with pytest.raises(InvalidArgumentError) as err:
        await world.store.commit_step(
            world.org,
            fence,
            output=CheckpointInput({"auth": {"Authorization": "Bearer abcdefghijkl"}}),
            advance=FinishRun(),
        )

    assert err.value.reason == "checkpoint_credential_rejected"
    assert err.value.field_path == "context_payload.auth.Authorization"
    assert "abcdefghijkl" not in str(err.value) and "abcdefghijkl" not in repr(err.value.attributes)
    assert await count(world.engine, flow_checkpoints, org_id=world.org) == 1
    with pytest.raises(InvalidArgumentError):
        await world.store.create_run(
            world.scope,
            dataclasses.replace(
                (await _request(world)), input=CheckpointInput({"password": "hunter2"})
            ),
        )


async def _request(world: World) -> Any:
    from runtime_svc.kernel import StartRunRequest
    from tests.integration.kernel.helpers import FIRST

    return StartRunRequest(plan_id=world.plan_id, first_step=FIRST, input=CheckpointInput({}))


async def test_finish_and_terminal_failure_advance_the_root(world: World) -> None:
    from runtime_svc.kernel import FailRun

    done, failed = await start(world), await start(world)
    await world.store.commit_step(
        world.org, await running(world, done), output=CheckpointInput({}), advance=FinishRun()
    )
    await world.store.commit_step(
        world.org,
        await running(world, failed),
        output=CheckpointInput({}),
        advance=FailRun("explicit_fault"),
    )

    ok = await world.store.get_run(world.org, done)
    bad = await world.store.get_run(world.org, failed)
    assert (ok.state, ok.interview_status, ok.completed_at is not None) == (
        RunState.SUCCEEDED,
        "Finished",
        True,
    )
    assert (bad.state, bad.interview_status, bad.terminal_cause_code) == (
        RunState.TERMINAL_FAILED,
        "Error",
        "explicit_fault",
    )
    for run_id in (done, failed):
        await assert_consistent(world, run_id)


async def test_root_and_step_projection_never_diverge_under_direct_tampering(
    world: World,
) -> None:
    """A step moved behind the store's back makes the next commit fail its fence."""
    run_id = await start(world)
    fence = await running(world, run_id)
    async with db.transaction(world.engine) as conn:
        await conn.execute(
            update(flow_step_executions)
            .where(flow_step_executions.c.org_id == world.org)
            .values(state=StepState.PENDING.code)
        )

    with pytest.raises(FenceLostError):
        await business_commit(world, fence, "rec-x")
    assert await count(world.engine, records, org_id=world.org) == 0
