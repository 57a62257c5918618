"""The pre-claimed wake (``docs/adr/0007-pre-claimed-wake.md``) of an effect completion on
SQLite and MariaDB: the owner's receipt, arriving through ``SubmitWakeSignal``, resolves
the completion dependency and — in a process whose worker has room — claims the
``EffectCompletion`` step Running for that worker in the same transaction; the worker
runs it once and the Flow finishes with exactly one effect."""

from __future__ import annotations

from runtime_svc.kernel import RunState
from runtime_svc.kernel.wait_model import DependencyState
from runtime_svc.waits.preclaim import PreClaimer
from runtime_svc.worker import Outcome
from runtime_svc.worker.background import LocalWakeSeats
from tests.integration.flow_effects.world import EffectWorld, email_flow
from tests.integration.waits.support import dependencies, task_subjects


async def test_an_effect_receipt_preclaims_the_completion_step(world: EffectWorld) -> None:
    rt = world.runtime
    seats = LocalWakeSeats([rt.worker])
    rt.rt.matcher.preclaim = PreClaimer(rt.store, seats)
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    item = None
    for _ in range(40):  # submit, deliver, provider call, receipt (bounded)
        await world.pump()
        item = seats.take()
        if item is not None:
            break
    assert item is not None, "the receipt's resolution handed nothing over"
    wake, _ticket = item
    assert wake.plan_step_key == "send#completion"
    # The receipt's resolution committed with the claim: Running, nothing to claim.
    assert (await world.run(run.flow_run_id)).state is RunState.RUNNING
    assert ("send#completion", "Running") in await world.steps(run.flow_run_id)
    [dep] = await dependencies(rt.engine, world.org, run.flow_run_id)
    assert dep.state is DependencyState.RESOLVED
    outcomes = await rt.worker.process_preclaimed(wake)
    assert outcomes and set(outcomes) == {Outcome.COMMITTED}
    done = await world.settle(run.flow_run_id)
    assert done.state is RunState.SUCCEEDED, done
    assert await world.steps(run.flow_run_id) == [
        ("send#submit", "Succeeded"),
        ("send#completion", "Succeeded"),
        ("after", "Succeeded"),
    ]
    assert await task_subjects(rt.engine, world.org) == ["sent"]
    assert await world.commands_count() == 1
    assert world.sink.data_commands == 1 and len(world.sink.received) == 1
