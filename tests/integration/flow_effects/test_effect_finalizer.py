"""Handoff dead-letter convergence (§15.4, §22.5) on SQLite and MariaDB with the real
owner's ``RejectIfUnaccepted`` fence: a proven rejection applies the completion
dependency's compiled policy, acceptance-unknown quarantines dependency, step and root,
both in the same transaction that makes the message terminal — so ``DELIVERED`` may
coexist with a ``Waiting`` root while ``DEAD_LETTERED``/``HANDOFF_REJECTED`` never can;
a finalizer that dies before its commit leaves both unchanged, and the repair sweeps
converge any terminal non-delivery message found under a pending dependency."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from sqlalchemy import and_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from effect_owner_svc.schema import owner_inbox
from runtime_svc.kernel import RunState
from runtime_svc.kernel.wait_model import DependencyState
from runtime_svc.outbox import EffectHandoff, owner_channels
from runtime_svc.schema import flow_dependencies, flow_runs, runtime_outbox
from services.db import transaction
from services.errors import FenceLostError
from services.outbox import (
    DeliveryResult,
    DeliveryState,
    Disposition,
    FinalizationTicket,
    OutboxMessage,
    RetryLater,
)
from tests.integration.flow_effects.world import EffectWorld, email_flow
from tests.integration.waits.support import dependencies, task_subjects

_NON_DELIVERY = (DeliveryState.HANDOFF_REJECTED.value, DeliveryState.DEAD_LETTERED.value)


class _Partitioned(EffectHandoff):
    """``AcceptHandoff`` never gets through (the owner is unreachable on that path);
    ``RejectIfUnaccepted`` does: the real owner answers from its durable fence."""

    def __init__(self, inner: EffectHandoff) -> None:
        self.__dict__.update(inner.__dict__)

    async def deliver(self, m: OutboxMessage) -> DeliveryResult:
        return RetryLater("owner_unavailable")


def _base_handoff(world: EffectWorld) -> EffectHandoff:
    handoff = world.dispatcher._families["flow.effect.submit"].deliver.__self__  # type: ignore[union-attr]
    assert isinstance(handoff, EffectHandoff)
    return handoff


async def waiting_over_terminal_non_delivery(world: EffectWorld) -> list[str]:
    """Runs of the world's org still ``Waiting`` on a completion dependency whose handoff
    message is terminal non-delivery (the §15.4 invariant: always empty)."""
    r, d, o = flow_runs.c, flow_dependencies.c, runtime_outbox.c
    stmt = (
        select(r.flow_run_id)
        .select_from(
            flow_runs.join(
                flow_dependencies,
                and_(d.org_id == r.org_id, d.step_execution_id == r.current_step_execution_id),
            ).join(
                runtime_outbox,
                and_(
                    o.org_id == d.org_id,
                    o.app_installation_id == d.app_installation_id,
                    o.runtime_capability_id == d.runtime_capability_id,
                    o.runtime_work_binding_digest == d.runtime_work_binding_digest,
                    o.effect_handoff_key == d.producer_key,
                ),
            )
        )
        .where(
            r.org_id == world.org,
            r.runtime_state == RunState.WAITING.code,
            o.delivery_state.in_(_NON_DELIVERY),
        )
    )
    async with transaction(world.runtime.engine, readonly=True) as conn:
        return [str(x) for x in (await conn.execute(stmt)).scalars()]


async def test_delivered_coexists_with_a_waiting_root_and_a_pending_dependency(
    world: EffectWorld,
) -> None:
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await world.work()
    await world.deliver()

    message = await world.message(run.flow_run_id)
    assert message is not None and message.delivery_state is DeliveryState.DELIVERED
    assert (await world.run(run.flow_run_id)).state is RunState.WAITING
    [dep] = await dependencies(world.runtime.engine, world.org, run.flow_run_id)
    assert dep.state is DependencyState.PENDING  # owner acceptance is not completion


async def test_a_proven_rejection_takes_the_compiled_fault_path(world: EffectWorld) -> None:
    await world.seed(email_flow())
    world.dispatcher = world.runtime_dispatcher(handoff=_Partitioned(_base_handoff(world)))
    run = await world.start("effect_email", to="ada@example.com", name="Ada")

    done = await world.settle(run.flow_run_id)

    # Delivery budget exhausted → RejectIfUnaccepted recorded the owner's durable
    # Rejected tombstone → the finalizer activated the fault successor and only then
    # made the message terminal.
    assert done.state is RunState.SUCCEEDED
    assert await task_subjects(world.runtime.engine, world.org) == ["email failed"]
    message = await world.message(run.flow_run_id)
    assert message is not None and message.delivery_state is DeliveryState.HANDOFF_REJECTED
    [dep] = await dependencies(world.runtime.engine, world.org, run.flow_run_id)
    assert dep.state is DependencyState.EXPIRED
    steps = await world.steps(run.flow_run_id)
    assert steps[:2] == [("send#submit", "Succeeded"), ("send#completion", "Failed")]
    assert await world.commands_count() == 0 and world.sink.data_commands == 0
    fence = owner_inbox.c
    async with transaction(world.owner_engine, readonly=True) as conn:
        state = (
            await conn.execute(select(fence.state).where(fence.org_id == world.org))
        ).scalar_one()
    assert state == "REJECTED"
    assert await waiting_over_terminal_non_delivery(world) == []


async def test_a_proven_rejection_without_a_fault_path_quarantines_by_policy(
    world: EffectWorld,
) -> None:
    await world.seed(email_flow(fault=False))
    world.dispatcher = world.runtime_dispatcher(handoff=_Partitioned(_base_handoff(world)))
    run = await world.start("effect_email", to="ada@example.com", name="Ada")

    done = await world.settle(run.flow_run_id)

    assert done.state is RunState.QUARANTINED
    assert done.terminal_cause_code == "effect_handoff_rejected"
    message = await world.message(run.flow_run_id)
    assert message is not None and message.delivery_state is DeliveryState.HANDOFF_REJECTED


async def test_acceptance_unknown_quarantines_dependency_step_and_root_together(
    world: EffectWorld,
) -> None:
    await world.seed(email_flow())
    base = _base_handoff(world)
    # No owner is configured for the message's kind: neither delivery nor the fence can
    # reach it — acceptance unknown, never proof of rejection (even with a fault path).
    lookup, _ = owner_channels({}, lambda _t: world.owner.channel)
    unroutable = EffectHandoff(lookup, base._credentials, timeout_s=5)
    world.dispatcher = world.runtime_dispatcher(handoff=unroutable)
    run = await world.start("effect_email", to="ada@example.com", name="Ada")

    done = await world.settle(run.flow_run_id)

    assert done.state is RunState.QUARANTINED
    assert done.terminal_cause_code == "effect_acceptance_unknown"
    [dep] = await dependencies(world.runtime.engine, world.org, run.flow_run_id)
    assert dep.state is DependencyState.QUARANTINED
    assert (await world.steps(run.flow_run_id))[-1] == ("send#completion", "Quarantined")
    message = await world.message(run.flow_run_id)
    assert message is not None and message.delivery_state is DeliveryState.DEAD_LETTERED
    assert await task_subjects(world.runtime.engine, world.org) == []  # no fault path taken
    assert await waiting_over_terminal_non_delivery(world) == []


class _DiesBeforeCommit(FinalizationTicket):
    async def commit_txn(self, conn: AsyncConnection) -> OutboxMessage:
        raise RuntimeError("the finalizer died before the message became terminal")


class _DyingFinalizer:
    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    async def finalize(self, ticket: FinalizationTicket) -> None:
        self.calls += 1
        await self.inner.finalize(
            _DiesBeforeCommit(ticket.message, ticket.disposition, ticket.spec)
        )


async def test_a_finalizer_that_dies_before_its_commit_leaves_message_and_flow_unchanged(
    world: EffectWorld,
) -> None:
    await world.seed(email_flow())
    partitioned = _Partitioned(_base_handoff(world))
    dying = _DyingFinalizer(world.finalizer)
    world.dispatcher = world.runtime_dispatcher(handoff=partitioned, finalizer=dying)
    run = await world.start("effect_email", to="ada@example.com", name="Ada")

    await world.settle(run.flow_run_id, lambda r: False, rounds=8)

    # The Flow convergence rolled back with the failed commit: pre-final and Waiting.
    assert dying.calls >= 1
    message = await world.message(run.flow_run_id)
    assert message is not None and message.delivery_state is DeliveryState.REJECTED
    assert (await world.run(run.flow_run_id)).state is RunState.WAITING
    # The repair sweep re-drives the pre-final message through the real finalizer.
    world.dispatcher = world.runtime_dispatcher(handoff=partitioned)
    done = await world.settle(run.flow_run_id)
    assert done.state is RunState.SUCCEEDED
    assert await task_subjects(world.runtime.engine, world.org) == ["email failed"]


async def test_the_repair_sweep_converges_terminal_non_delivery_under_a_pending_dependency(
    world: EffectWorld,
) -> None:
    """Invariant corruption (e.g. a message dead-lettered by an older binary without the
    Flow finalizer) is found and converged root-first."""
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await world.work()
    o = runtime_outbox.c
    async with transaction(world.runtime.engine) as conn:
        await conn.execute(
            update(runtime_outbox)
            .where(o.org_id == world.org, o.flow_run_id == run.flow_run_id)
            .values(delivery_state=DeliveryState.HANDOFF_REJECTED.value)
        )
    assert await waiting_over_terminal_non_delivery(world) == [run.flow_run_id]

    stats = await world.effect_sweeper.sweep_org(world.org)

    assert stats.repaired == 1
    assert await waiting_over_terminal_non_delivery(world) == []
    await world.work()
    done = await world.run(run.flow_run_id)
    assert done.state is RunState.SUCCEEDED
    assert await task_subjects(world.runtime.engine, world.org) == ["email failed"]


async def test_the_finalizer_is_idempotent(world: EffectWorld) -> None:
    await world.seed(email_flow())
    world.dispatcher = world.runtime_dispatcher(handoff=_Partitioned(_base_handoff(world)))
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await world.settle(run.flow_run_id)
    message = await world.message(run.flow_run_id)
    assert message is not None
    before = (await world.run(run.flow_run_id)).state_version

    # A repeat (the repair sweep racing the dispatcher, a second replica) with the
    # pre-final snapshot it discovered: nothing to converge, and the terminal move loses
    # its fence — the whole transaction rolls back.
    stale = dataclasses.replace(message, delivery_state=DeliveryState.REJECTED)
    ticket = FinalizationTicket(stale, Disposition.REJECTED, world.dispatcher.spec)
    with pytest.raises(FenceLostError):
        await world.finalizer.finalize(ticket)
    assert (await world.run(run.flow_run_id)).state_version == before
    assert await task_subjects(world.runtime.engine, world.org) == ["email failed"]
