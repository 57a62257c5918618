"""Delete and cancellation (§10.1 ``DeleteFlowInterview`` steps 2-6, §11.1) on SQLite and
MariaDB: idempotent soft delete through ``IsDeleted``, root→step→attempt fencing, delete
racing a running step's commit in both orders, and cleanup to ``Cancelled``."""

from __future__ import annotations

import asyncio

import pytest

from runtime_svc.kernel import (
    CheckpointInput,
    EnterWait,
    FailureClass,
    FinishRun,
    RunState,
    StepFailure,
    StepState,
)
from runtime_svc.kernel.decisions import (
    CancelCompleted,
    CancelRecorded,
    CancelWon,
    NoChange,
    Tombstoned,
)
from runtime_svc.kernel.errors import StateVersionMismatchError
from runtime_svc.schema import flow_step_attempts, flow_step_executions, records
from services.errors import FenceLostError, NotFoundError
from tests.integration.kernel.conftest import TEST_POLICY, World
from tests.integration.kernel.helpers import claim, count, rows, start
from tests.integration.kernel.test_kernel_commit import assert_consistent, business_commit, running


async def step_states(world: World) -> dict[str, str]:
    return {
        r["plan_step_key"]: r["state"]
        for r in await rows(world.engine, flow_step_executions, org_id=world.org)
    }


async def attempt_outcomes(world: World) -> list[str]:
    found = await rows(world.engine, flow_step_attempts, org_id=world.org)
    return [str(r["transaction_outcome"]) for r in sorted(found, key=lambda r: r["started_at"])]


async def test_delete_is_idempotent_and_hides_the_run_from_every_normal_read(
    world: World,
) -> None:
    run_id = await start(world)
    first = await world.store.delete_run(world.org, run_id)
    again = await world.store.delete_run(world.org, run_id)

    assert isinstance(first, CancelRecorded)
    assert again == NoChange("already_cancelled")
    with pytest.raises(NotFoundError):
        await world.store.get_run(world.org, run_id)
    with pytest.raises(NotFoundError):
        await world.store.support_view(world.org, run_id)
    with pytest.raises(NotFoundError):
        await world.store.request_cancel(world.org, run_id)
    assert run_id not in [r.flow_run_id for r in (await world.store.list_runs(world.org)).runs]
    # Lineage is retained: an authorized include-deleted read reconstructs it.
    run = await world.store.get_run(world.org, run_id, include_deleted=True)
    assert run.is_deleted and run.delete_requested_at is not None
    assert run.state is RunState.CANCEL_REQUESTED and run.interview_status == "Error"
    assert await step_states(world) == {"s1": "Cancelled"}


async def test_delete_fences_a_running_step_and_its_started_attempt(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)

    decision = await world.store.delete_run(world.org, run_id)

    assert isinstance(decision, CancelRecorded)
    assert await step_states(world) == {"s1": "CancelRequested"}
    assert await attempt_outcomes(world) == ["Cancelled"]
    # The stale worker can neither publish, nor reschedule, nor extend its lease.
    with pytest.raises(FenceLostError) as err:
        await business_commit(world, fence, "rec-after-delete")
    assert err.value.attributes["fence_reason"] in {"deleted", "cancel_requested"}
    assert (
        await world.store.record_rollback(
            world.org, fence, StepFailure(FailureClass.RETRYABLE, "x")
        )
        == CancelWon()
    )
    with pytest.raises(FenceLostError):
        await world.store.extend_lease(world.org, fence)
    world.clock.advance(seconds=TEST_POLICY.lease_duration_ms / 1000 + 1)
    assert await world.store.recover_expired(world.org) == []
    assert await count(world.engine, records, org_id=world.org) == 0

    completed = await world.store.complete_cancel(world.org, run_id)

    assert isinstance(completed, CancelCompleted)
    assert await world.store.complete_cancel(world.org, run_id) == NoChange("already_cancelled")
    assert await step_states(world) == {"s1": "Cancelled"}
    assert await attempt_outcomes(world) == ["Cancelled"]  # never rewritten to Fenced
    run = await world.store.get_run(world.org, run_id, include_deleted=True)
    assert (run.state, run.terminal_cause_code) == (RunState.CANCELLED, "cancelled")
    await assert_consistent(world, run_id)


async def test_delete_first_then_the_racing_commit_rolls_back_entirely(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)
    await world.store.delete_run(world.org, run_id)

    with pytest.raises(FenceLostError):
        await business_commit(world, fence, "rec-loser")

    assert await count(world.engine, records, org_id=world.org) == 0
    assert await attempt_outcomes(world) == ["Cancelled"]
    assert set((await step_states(world)).values()) == {"CancelRequested"}


async def test_commit_first_then_delete_sees_the_advanced_root(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)
    await business_commit(world, fence, "rec-winner")

    decision = await world.store.delete_run(world.org, run_id)

    assert isinstance(decision, CancelRecorded)
    # The committed step and attempt are not relabelled; the *next* step is cancelled.
    assert await step_states(world) == {"s1": "Succeeded", "s2": "Cancelled"}
    assert await attempt_outcomes(world) == ["Committed"]
    assert await count(world.engine, records, org_id=world.org) == 1
    view = await world.store.support_view(world.org, run_id, include_deleted=True)
    assert view.run.current_step_execution_id != fence.step_execution_id


async def test_delete_racing_commit_serialises_on_the_root(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)

    results = await asyncio.gather(
        business_commit(world, fence, "rec-race"),
        world.store.delete_run(world.org, run_id),
        return_exceptions=True,
    )

    commit_result, delete_result = results
    assert isinstance(delete_result, CancelRecorded)
    if isinstance(commit_result, FenceLostError):
        assert await count(world.engine, records, org_id=world.org) == 0
        assert await attempt_outcomes(world) == ["Cancelled"]
    else:
        assert commit_result is None
        assert await count(world.engine, records, org_id=world.org) == 1
        assert await attempt_outcomes(world) == ["Committed"]
        assert (await step_states(world))["s1"] == "Succeeded"


async def test_cancel_of_a_claimed_step_and_of_a_waiting_step(world: World) -> None:
    claimed = await start(world)
    await claim(world, claimed)
    waiting = await start(world)
    fence = await running(world, waiting)
    await world.store.commit_step(world.org, fence, output=CheckpointInput({}), advance=EnterWait())

    assert isinstance(await world.store.request_cancel(world.org, claimed), CancelRecorded)
    assert isinstance(await world.store.request_cancel(world.org, waiting), CancelRecorded)

    views = {r: await world.store.support_view(world.org, r) for r in (claimed, waiting)}
    for view in views.values():
        assert view.run.state is RunState.CANCEL_REQUESTED and not view.run.is_deleted
        assert view.current_step is not None
        assert view.current_step.state is StepState.CANCEL_REQUESTED
    # Claimed: its Started attempt is Cancelled. Waiting: the committed attempt stays.
    assert [a.outcome.code for a in views[claimed].attempts] == ["Cancelled"]
    assert [a.outcome.code for a in views[waiting].attempts] == ["Committed"]
    for run_id in (claimed, waiting):
        assert isinstance(await world.store.complete_cancel(world.org, run_id), CancelCompleted)
        assert (await world.store.get_run(world.org, run_id)).state is RunState.CANCELLED


async def test_delete_of_a_terminal_run_only_records_the_soft_delete(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)
    await world.store.commit_step(world.org, fence, output=CheckpointInput({}), advance=FinishRun())

    assert await world.store.request_cancel(world.org, run_id) == NoChange("terminal")
    decision = await world.store.delete_run(world.org, run_id)
    again = await world.store.delete_run(world.org, run_id)

    assert isinstance(decision, Tombstoned)
    assert again == NoChange("terminal")
    run = await world.store.get_run(world.org, run_id, include_deleted=True)
    assert (run.state, run.is_deleted, run.interview_status) == (
        RunState.SUCCEEDED,
        True,
        "Finished",
    )
    assert await attempt_outcomes(world) == ["Committed"]


async def test_cancel_then_delete_adds_the_soft_delete_fact(world: World) -> None:
    run_id = await start(world)
    await world.store.request_cancel(world.org, run_id)
    assert isinstance(await world.store.delete_run(world.org, run_id), Tombstoned)
    run = await world.store.get_run(world.org, run_id, include_deleted=True)
    assert run.is_deleted and run.state is RunState.CANCEL_REQUESTED


async def test_expected_version_is_the_cancel_transitions_compare_and_swap(world: World) -> None:
    """Issue 10, item 3: the caller's expected root version is compared by the transition
    that writes (under the root lock, and carried by its conditional UPDATE), version 0
    included; a mismatch writes nothing; a repeated delete answers whatever the version."""
    run_id = await start(world)
    root = (await world.store.get_run(world.org, run_id)).state_version
    assert root == 0
    with pytest.raises(StateVersionMismatchError) as err:
        await world.store.request_cancel(world.org, run_id, expected_state_version=1)
    assert err.value.attributes["found_version"] == "0"
    assert (await world.store.get_run(world.org, run_id)).state is RunState.RUNNABLE
    fence = await claim(world, run_id)  # the root moves to version 1
    with pytest.raises(StateVersionMismatchError):
        await world.store.delete_run(world.org, run_id, expected_state_version=0)
    assert not (await world.store.get_run(world.org, run_id)).is_deleted
    decision = await world.store.delete_run(
        world.org, run_id, expected_state_version=fence.root_state_version
    )
    assert isinstance(decision, CancelRecorded)
    # Already deleted: a repeat is idempotent whatever version it names.
    assert isinstance(
        await world.store.delete_run(world.org, run_id, expected_state_version=0), NoChange
    )
