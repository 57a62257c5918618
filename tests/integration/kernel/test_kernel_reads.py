"""Run creation, org scoping and reads (§10.0, §10.1, §18.3, §19) on SQLite and MariaDB:
idempotent ``create_run``, NOT_FOUND across orgs, fences rejected before SQL, stable
keyset pages, the support view without checkpoint payloads, waits and their projection."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from runtime_svc.kernel import (
    CheckpointInput,
    EnterWait,
    RunFilters,
    RunState,
    StartRunRequest,
    StepState,
    TransitionInputError,
)
from runtime_svc.kernel.decisions import NoChange, WaitExpired, WaitResolved
from runtime_svc.schema import flow_checkpoints, flow_runs, flow_step_executions
from services import db
from services.errors import ConflictError, FenceLostError, NotFoundError
from tests.integration.kernel.conftest import World, new_scope, seed_plan
from tests.integration.kernel.helpers import FIRST, QUEUE, claim, count, start
from tests.integration.kernel.test_kernel_commit import running

SECRET_SENTINEL = "payload-sentinel-7f3a"


def request(world: World, key: str | None = "k1", n: int = 0) -> StartRunRequest:
    return StartRunRequest(
        plan_id=world.plan_id,
        first_step=FIRST,
        input=CheckpointInput({"n": n}),
        idempotency_key=key,
    )


async def test_create_run_writes_root_first_step_and_input_checkpoint(world: World) -> None:
    result = await world.store.create_run(world.scope, request(world))

    run = result.run
    assert result.created and run.state is RunState.RUNNABLE and run.state_version == 0
    assert run.execution_owner.code == "FlowRuntimeV2" and run.ownership_epoch == 1
    assert (run.plan_id, run.execution_profile) == (world.plan_id, "durable_orchestration")
    assert run.interview_status == "Running" and run.current_element == "s1"
    view = await world.store.support_view(world.org, run.flow_run_id)
    assert view.current_step is not None and view.current_step.state is StepState.PENDING
    assert view.current_checkpoint is not None and view.current_checkpoint.sequence == 1
    assert view.current_step.input_checkpoint_id == view.current_checkpoint.checkpoint_id


async def test_create_run_is_idempotent_on_the_key_within_the_org(world: World) -> None:
    first = await world.store.create_run(world.scope, request(world))
    again = await world.store.create_run(world.scope, request(world))

    assert not again.created and again.run.flow_run_id == first.run.flow_run_id
    with pytest.raises(ConflictError):
        await world.store.create_run(world.scope, request(world, n=1))
    assert await count(world.engine, flow_runs, org_id=world.org) == 1
    assert await count(world.engine, flow_checkpoints, org_id=world.org) == 1


async def test_concurrent_create_run_with_one_key_makes_one_run(world: World) -> None:
    results = await asyncio.gather(
        *(world.store.create_run(world.scope, request(world, key="same")) for _ in range(4))
    )

    assert len({r.run.flow_run_id for r in results}) == 1
    assert sum(r.created for r in results) == 1
    assert await count(world.engine, flow_runs, org_id=world.org) == 1
    # A losing root INSERT stops its round trip before its checkpoint and step.
    assert await count(world.engine, flow_checkpoints, org_id=world.org) == 1
    assert await count(world.engine, flow_step_executions, org_id=world.org) == 1


async def test_a_plan_outside_the_trusted_work_scope_is_not_found(world: World) -> None:
    foreign = dataclasses.replace(world.scope, app_installation_id="inst_other")
    with pytest.raises(NotFoundError):
        await world.store.create_run(foreign, request(world))
    other_org = new_scope()
    with pytest.raises(NotFoundError):
        await world.store.create_run(other_org, request(world))


async def test_cross_org_reads_and_transitions_answer_not_found(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)
    other = new_scope()
    # Identical idempotency key in another org is a different run.
    twin = dataclasses.replace(request(world), plan_id=(await seed_plan(world.engine, other))[0])
    assert (await world.store.create_run(other, twin)).created

    for read in (
        world.store.get_run(other.org_id, run_id),
        world.store.get_run(other.org_id, run_id, include_deleted=True),
        world.store.support_view(other.org_id, run_id),
        world.store.get_checkpoint(other.org_id, run_id, fence.input_checkpoint_id or ""),
        world.store.delete_run(other.org_id, run_id),
        world.store.request_cancel(other.org_id, run_id),
    ):
        with pytest.raises(NotFoundError):
            await read
    assert run_id not in [r.flow_run_id for r in (await world.store.list_runs(other.org_id)).runs]
    assert run_id not in [
        c.flow_run_id for c in await world.store.eligible_work(other.org_id, QUEUE)
    ]
    # A fence presented under another org is rejected before any SQL...
    with pytest.raises(TransitionInputError):
        await world.store.mark_running(other.org_id, fence)
    # ...and the same fence rewritten to claim the other org finds nothing to fence.
    with pytest.raises(FenceLostError):
        await world.store.extend_lease(
            other.org_id, dataclasses.replace(fence, org_id=other.org_id)
        )
    assert (await world.store.get_run(world.org, run_id)).state is RunState.RUNNING


async def test_fence_input_is_validated_before_sql(world: World) -> None:
    run_id = await start(world)
    fence = await claim(world, run_id)
    for bad in (
        dataclasses.replace(fence, ownership_epoch=0),
        dataclasses.replace(fence, lease_token=""),
        dataclasses.replace(fence, step_state_version=-1),
    ):
        with pytest.raises(TransitionInputError):
            await world.store.mark_running(world.org, bad)
    assert (await world.store.mark_running(world.org, fence)).step_state_version == 2


async def test_support_view_has_checkpoint_metadata_but_no_payload(world: World) -> None:
    run_id = await start(world, context={"note": SECRET_SENTINEL})

    view = await world.store.support_view(world.org, run_id)

    assert view.plan_digest == world.plan_digest and view.run.plan_id == world.plan_id
    assert view.current_checkpoint is not None
    assert view.current_checkpoint.context_digest.startswith("flow-context/v1:sha256:")
    assert SECRET_SENTINEL not in repr(view)
    assert SECRET_SENTINEL not in repr(dataclasses.asdict(view))
    assert view.terminal_cause_code is None
    # The worker's read path does return it.
    checkpoint = await world.store.get_checkpoint(
        world.org, run_id, view.current_checkpoint.checkpoint_id
    )
    assert SECRET_SENTINEL in checkpoint.context_json


async def test_list_runs_pages_are_stable_and_filtered(world: World) -> None:
    started = [await start(world) for _ in range(5)]
    # The listing's order is (created_at, flow_run_id): two runs started in the same
    # millisecond of the id's clock may straddle one of the database clock's, so the ids'
    # own order is not the expectation — the stored creation times are.
    created = {r: (await world.store.get_run(world.org, r)).created_at for r in started}
    runs = sorted(started, key=lambda r: (created[r], r))
    await world.store.delete_run(world.org, runs[0])
    await claim(world, runs[1])

    seen: list[str] = []
    token = ""
    for _ in range(10):
        page = await world.store.list_runs(world.org, page_size=2, page_token=token)
        seen += [r.flow_run_id for r in page.runs]
        token = page.next_page_token
        if not token:
            break
    running_only = await world.store.list_runs(world.org, RunFilters(states=(RunState.RUNNING,)))

    assert seen == runs[1:]
    assert [r.flow_run_id for r in running_only.runs] == [runs[1]]
    with pytest.raises(Exception, match="page_token"):
        await world.store.list_runs(world.org, RunFilters(states=(RunState.RUNNING,)), 2, "x")


async def test_wait_resolution_moves_step_and_root_together(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)
    await world.store.commit_step(world.org, fence, output=CheckpointInput({}), advance=EnterWait())
    expiring = await start(world)
    fence = await running(world, expiring)
    await world.store.commit_step(world.org, fence, output=CheckpointInput({}), advance=EnterWait())

    async with db.transaction(world.engine) as conn:
        resolved = await world.store.resolve_wait_txn(conn, world.org, run_id)
        expired = await world.store.expire_wait_txn(conn, world.org, expiring, quarantine=False)
        repeat = await world.store.resolve_wait_txn(conn, world.org, run_id)

    assert isinstance(resolved, WaitResolved) and isinstance(expired, WaitExpired)
    assert repeat == NoChange("root_not_waiting")
    run = await world.store.get_run(world.org, run_id)
    assert (run.state, run.interview_status, run.paused_at) == (RunState.RUNNABLE, "Running", None)
    assert [c.flow_run_id for c in await world.store.eligible_work(world.org, QUEUE)] == [run_id]
    dead = await world.store.get_run(world.org, expiring)
    assert (dead.state, dead.terminal_cause_code) == (
        RunState.TERMINAL_FAILED,
        "dependency_expired",
    )
