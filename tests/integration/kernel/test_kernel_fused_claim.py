"""The fused claim (ADR 0003) on SQLite and MariaDB: a claim with ``running=True`` and
a commit with ``continue_as`` leave the rows a separate claim and running transaction
would leave (state ``Running``, the lease of the fence, a ``Started`` attempt that
records the root version it was claimed at) at exactly the versions the fence carries —
so the step's own final commit holds — and a declined continuation writes nothing of it.
"""

from __future__ import annotations

from typing import Any

from runtime_svc.kernel import CheckpointInput, ContinueAs, LeaseFence
from runtime_svc.kernel.states import AttemptOutcome, RunState, StepState
from runtime_svc.kernel.store_rows import lock_fenced, lock_run, lock_step
from services import db
from tests.integration.kernel.conftest import World
from tests.integration.kernel.helpers import QUEUE, claim, next_step, start


async def _assert_running_under(world: World, fence: LeaseFence) -> None:
    async with db.transaction(world.engine) as conn:
        root, step, attempt = await lock_fenced(conn, world.org, fence)
    assert root.state is RunState.RUNNING
    assert root.current_step_execution_id == fence.step_execution_id
    assert root.state_version == fence.root_state_version
    assert step.state is StepState.RUNNING
    assert step.state_version == fence.step_state_version
    assert step.lease_token_digest == fence.token_digest
    assert step.lease_owner == fence.lease_owner and step.lease_until == fence.lease_until
    assert step.attempt_count == fence.attempt_number
    assert attempt.outcome is AttemptOutcome.STARTED
    assert attempt.root_state_version_at_claim == root.state_version


async def _commit(world: World, fence: LeaseFence, key: str = "s2", **kw: Any) -> Any:
    async with db.transaction(world.engine) as conn:
        return await world.store.commit_step_txn(
            conn, world.org, fence, output=CheckpointInput({"n": 1}), advance=next_step(key), **kw
        )


async def test_a_fused_claim_leaves_the_step_running_at_the_fence_version(world: World) -> None:
    run_id = await start(world)
    [candidate] = [
        c for c in await world.store.eligible_work(world.org, QUEUE) if c.flow_run_id == run_id
    ]
    fence = await world.store.claim(world.org, candidate, lease_owner="w1", running=True)
    assert isinstance(fence, LeaseFence), fence
    await _assert_running_under(world, fence)
    # A second claimer finds nothing claimable; the fence's own commit holds.
    again = await world.store.claim(world.org, candidate, lease_owner="w2", running=True)
    assert not isinstance(again, LeaseFence)
    result = await _commit(world, fence)
    assert result.run_state is RunState.RUNNABLE


async def test_a_continued_commit_claims_the_next_step_running_in_its_own_writes(
    world: World,
) -> None:
    run_id = await start(world)
    fence = await world.store.mark_running(world.org, await claim(world, run_id))
    result = await _commit(world, fence, continue_as=ContinueAs("w2", "trace-1"))
    continued = result.continued
    assert continued is not None and continued.lease_owner == "w2"
    assert continued.step_execution_id == result.next_step_execution_id
    assert continued.attempt_number == 1 and continued.step_state_version == 1
    assert continued.input_checkpoint_id == result.output_checkpoint.checkpoint_id
    await _assert_running_under(world, continued)
    # The continued step's final fence holds, with the sequence the commit handed on.
    again = await _commit(world, continued, "s3", input_sequence=result.output_checkpoint.sequence)
    assert again.run_state is RunState.RUNNABLE


async def test_a_declined_continuation_writes_only_the_commit(world: World) -> None:
    run_id = await start(world)
    fence = await world.store.mark_running(world.org, await claim(world, run_id))
    asked: list[str] = []

    def refuse(lane: str) -> bool:
        asked.append(lane)
        return False

    result = await _commit(world, fence, continue_as=ContinueAs("w2", admit=refuse))
    assert asked == [QUEUE] and result.continued is None
    assert result.next_step_execution_id is not None
    async with db.transaction(world.engine) as conn:
        root = await lock_run(conn, world.org, run_id)
        step = await lock_step(conn, world.org, result.next_step_execution_id)
    assert root is not None and root.state is RunState.RUNNABLE
    assert step is not None and step.state is StepState.PENDING and step.lease_token_digest is None
    # Left to an ordinary (fused) claim.
    nxt = await claim(world, run_id, owner="w3")
    assert nxt.step_execution_id == result.next_step_execution_id
