"""§22.5 "explicit compensation path" on SQLite and MariaDB: a completed effect is never
undone implicitly — a Flow that must undo it declares the compensation as an explicit
fault connector, which runs it as an effect of its own (see ``charge_flow``)."""

from __future__ import annotations

from runtime_svc.kernel import RunState
from tests.integration.flow_effects.world import EffectWorld, charge_flow


async def test_a_later_failure_runs_the_explicit_compensating_effect(world: EffectWorld) -> None:
    await world.seed(charge_flow())
    world.sink.replies = ["550"]  # the confirmation e-mail fails after the charge
    run = await world.start("effect_charge", accountId="acct-1", amount=25, to="ada@example.com")

    done = await world.settle(run.flow_run_id)

    assert done.state is RunState.TERMINAL_FAILED
    assert done.terminal_cause_code == "CHARGE_REVERSED"
    # The charge happened and stays a fact; the refund is a second, explicit effect.
    bodies = [r["body"] for r in world.receiver.requests]
    assert bodies == [
        {"accountId": "acct-1", "amount": 25},
        {"accountId": "acct-1", "amount": -25},
    ]
    assert len(world.receiver.effects) == 2  # two distinct idempotency keys
    assert world.sink.data_commands == 1 and world.sink.received == []
    steps = await world.steps(run.flow_run_id)
    assert [k for k, _ in steps] == [
        "charge#submit",
        "charge#completion",
        "confirm#submit",
        "confirm#completion",
        "refund#submit",
        "refund#completion",
        "reversed",
    ]
    assert await world.outbox_rows(run.flow_run_id) == 3
    assert await world.links(run.flow_run_id) == 3
    assert await world.commands_count() == 3
    output = await world.output(run.flow_run_id)
    assert output["ref"] and output["refundRef"] and output["mailRef"] is None


async def test_without_the_later_failure_no_compensation_runs(world: EffectWorld) -> None:
    await world.seed(charge_flow())
    run = await world.start("effect_charge", accountId="acct-1", amount=25, to="ada@example.com")

    done = await world.settle(run.flow_run_id)

    assert done.state is RunState.SUCCEEDED
    assert [r["body"]["amount"] for r in world.receiver.requests] == [25]
    assert len(world.sink.received) == 1
