from __future__ import annotations

from runtime_svc.kernel import CheckpointInput, FinishRun, RunState
from tests.integration.kernel.conftest import World
from tests.integration.kernel.helpers import claim, next_step, start


async def test_happy_path(world: World) -> None:
    run_id = await start(world)
    fence = await claim(world, run_id)
    fence = await world.store.mark_running(world.org, fence)
    fence = await world.store.extend_lease(world.org, fence)
    result = await world.store.commit_step(
        world.org, fence, output=CheckpointInput({"n": 1}), advance=next_step()
    )
    assert result.run_state is RunState.RUNNABLE
    fence = await claim(world, run_id)
    fence = await world.store.mark_running(world.org, fence)
    result = await world.store.commit_step(
        world.org, fence, output=CheckpointInput({"n": 2}), advance=FinishRun()
    )
    assert result.run_state is RunState.SUCCEEDED
    view = await world.store.support_view(world.org, run_id)
    assert view.run.interview_status == "Finished"
    assert len(view.attempts) == 2
