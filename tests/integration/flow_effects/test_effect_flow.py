"""The effect exchange end to end, in process with real parts (see ``world.py``)."""

from __future__ import annotations

from runtime_svc.kernel import RunState
from tests.integration.flow_effects.world import EffectWorld, email_flow


async def test_smoke(world: EffectWorld) -> None:
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    done = await world.settle(run.flow_run_id)
    print(await world.steps(run.flow_run_id))
    assert done.state is RunState.SUCCEEDED, done
    assert len(world.sink.received) == 1
