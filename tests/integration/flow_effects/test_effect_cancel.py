"""Cancelling or deleting a run with an effect handoff (§10.1, §11.1, §22.5 "Flow
cancellation after remote effect commit") on SQLite and MariaDB: the cancellation is
root-first; a pending handoff is cancelled only after the owner's durable ``Rejected``
receipt; an accepted one keeps tracking the owner's outcome and the run records that the
effect happened — never that it was rolled back; an unknown outcome quarantines."""

from __future__ import annotations

import json

import grpc
import grpc.aio
import pytest

from runtime_svc.kernel import RunState
from runtime_svc.kernel.decisions import CancelRecorded, NoChange
from runtime_svc.kernel.wait_model import DependencyState
from runtime_svc.worker import Sweeper
from services.outbox import DeliveryState
from tests.integration.effects.harness import Scope, envelope
from tests.integration.flow_effects.world import EffectWorld, email_flow
from tests.integration.waits.support import dependencies, task_subjects
from tests.support.effect_servers import DROP


async def _cleanup(world: EffectWorld) -> None:
    """The kernel's cancellation cleanup (which leaves pending handoffs alone)."""
    await Sweeper(world.runtime.engine, world.runtime.store).sweep_org(world.org)


async def test_cancelling_before_delivery_waits_for_the_owners_rejection(
    world: EffectWorld,
) -> None:
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await world.work()  # submitted; the dispatcher has not delivered yet

    cancelled = await world.runtime.store.request_cancel(world.org, run.flow_run_id)
    assert isinstance(cancelled, CancelRecorded)
    # The dependency takes the handoff disposition, not a plain cancellation.
    [dep] = await dependencies(world.runtime.engine, world.org, run.flow_run_id)
    assert dep.state is DependencyState.PENDING
    result = await world.runtime.store.complete_cancel(world.org, run.flow_run_id)
    assert result == NoChange("handoff_pending")

    await world.effect_sweeper.sweep_org(world.org)  # asks the owner's fence now
    message = await world.message(run.flow_run_id)
    assert message is not None and message.delivery_state is DeliveryState.RECONCILING
    await world.deliver()  # RejectIfUnaccepted → Rejected → the finalizer completes it

    done = await world.run(run.flow_run_id)
    assert done.state is RunState.CANCELLED and done.terminal_cause_code == "cancelled"
    [dep] = await dependencies(world.runtime.engine, world.org, run.flow_run_id)
    assert dep.state is DependencyState.CANCELLED
    message = await world.message(run.flow_run_id)
    assert message is not None and message.delivery_state is DeliveryState.HANDOFF_REJECTED
    assert await world.commands_count() == 0 and world.sink.data_commands == 0
    # A late delivery of the same handoff can no longer create a command.
    scope = Scope(
        world.org,
        world.runtime.scope.app_installation_id,
        world.runtime.scope.runtime_capability_id,
        world.runtime.scope.runtime_work_binding_digest,
    )
    env = envelope(
        scope,
        key=message.key,
        outbox_id=message.message_id,
        payload=json.loads(message.payload),
        owner_kind="email-gateway",
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await world.owner.accept(scope, env)
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert await world.commands_count() == 0


async def test_cancelling_after_the_remote_effect_committed_records_that_it_happened(
    world: EffectWorld,
) -> None:
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await world.work()
    await world.deliver()
    await world.execute()  # the e-mail was sent; its receipt is not delivered yet
    assert world.sink.data_commands == 1

    await world.runtime.store.request_cancel(world.org, run.flow_run_id)
    await _cleanup(world)
    assert (await world.run(run.flow_run_id)).state is RunState.CANCEL_REQUESTED
    await world.report()  # the receipt arrives for a cancelling run
    await world.effect_sweeper.sweep_org(world.org)

    done = await world.run(run.flow_run_id)
    assert done.state is RunState.CANCELLED
    assert done.terminal_cause_code == "cancelled_after_effect"
    [dep] = await dependencies(world.runtime.engine, world.org, run.flow_run_id)
    assert dep.state is DependencyState.RESOLVED  # the owner's receipt is kept
    receipt = json.loads(dep.resolution_receipt or "{}")
    assert receipt["outcome"] == "SUCCEEDED" and receipt["command_id"]
    assert (await world.steps(run.flow_run_id))[-1] == ("send#completion", "Cancelled")
    assert world.sink.data_commands == 1 and await world.commands_count() == 1
    assert await task_subjects(world.runtime.engine, world.org) == []  # never resumed
    assert await world.links(run.flow_run_id) == 1


async def test_cancelling_after_the_receipt_resumed_the_run_names_the_effect(
    world: EffectWorld,
) -> None:
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await world.work()
    await world.deliver()
    await world.execute()
    await world.report()  # the completion is Pending: the effect happened
    await world.runtime.store.request_cancel(world.org, run.flow_run_id)
    await _cleanup(world)

    done = await world.run(run.flow_run_id)
    assert done.state is RunState.CANCELLED
    assert done.terminal_cause_code == "cancelled_after_effect"


async def test_cancelling_with_an_unknown_outcome_quarantines(world: EffectWorld) -> None:
    await world.seed(email_flow())
    world.sink.replies = [DROP]  # accepted, answer lost: the owner quarantines
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await world.work()
    await world.deliver()
    await world.execute()
    await world.execute()  # the interrupted attempt is reconciled: OUTCOME_UNKNOWN
    await world.runtime.store.request_cancel(world.org, run.flow_run_id)
    await world.report()
    await world.effect_sweeper.sweep_org(world.org)

    done = await world.run(run.flow_run_id)
    assert done.state is RunState.QUARANTINED
    assert done.terminal_cause_code == "effect_outcome_unknown"
    assert world.sink.data_commands == 1


async def test_a_cancelled_run_whose_accepted_effect_never_reports_is_quarantined(
    world: EffectWorld,
) -> None:
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await world.work()
    await world.deliver()  # accepted; the owner never reports (its dispatcher is down)
    await world.runtime.store.request_cancel(world.org, run.flow_run_id)
    await world.effect_sweeper.sweep_org(world.org)
    assert (await world.run(run.flow_run_id)).state is RunState.CANCEL_REQUESTED

    world.runtime.clock.advance(days=31)  # past the completion dependency's deadline
    await world.effect_sweeper.sweep_org(world.org)

    done = await world.run(run.flow_run_id)
    assert done.state is RunState.QUARANTINED
    assert done.terminal_cause_code == "effect_outcome_unreported"
    [dep] = await dependencies(world.runtime.engine, world.org, run.flow_run_id)
    assert dep.state is DependencyState.QUARANTINED


async def test_deleting_a_run_with_a_pending_handoff_follows_the_same_disposition(
    world: EffectWorld,
) -> None:
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await world.work()

    await world.runtime.store.delete_run(world.org, run.flow_run_id)
    await world.effect_sweeper.sweep_org(world.org)  # before the dispatcher's next pass
    await world.pump(3)

    done = await world.run(run.flow_run_id)
    assert done.is_deleted
    assert done.state is RunState.CANCELLED and done.terminal_cause_code == "cancelled"
    assert await world.commands_count() == 0
