"""§15.1/§15.4/§22.5 (and §22.3 "dead-letter finalization … locks root first") on
MariaDB: an ``EffectSubmit`` retry and the outbox finalization of the same handoff both
discover their candidates without a lower-row lock and acquire the Flow root before the
deterministic outbox row — their race has no outbox→root edge.

The "retry" is the real one: a worker that claimed the submit, prepared it and stalled;
its lease expired, recovery fenced it and a second attempt committed the submit; the
message was then refused and the owner durably rejected it (pre-final). A blocker holds
the run root; the stale worker resumes its commit and the finalizer starts. Both are seen
queued inside their root ``SELECT … FOR UPDATE`` (the process list) while a probe
connection locks the submit step, the completion step, the dependency, the outbox row
and the link with ``FOR UPDATE NOWAIT`` at once — neither holds any of them. When the
blocker goes, the stale commit loses its fence (nothing written twice) and the finalizer
converges the Flow and makes the message terminal. (The observation method is validated
by the control test of ``tests/integration/waits/test_waits_lock_order.py``.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from runtime_svc.effects import submit_identities
from runtime_svc.kernel import RunState
from runtime_svc.schema import (
    flow_dependencies,
    flow_effect_links,
    flow_step_executions,
    runtime_outbox,
)
from runtime_svc.worker import Outcome, StepWorker, Sweeper
from services.outbox import DeliveryState, Disposition, FinalizationTicket
from tests.integration.flow_effects.test_effect_finalizer import _base_handoff, _Partitioned
from tests.integration.flow_effects.world import EffectWorld, email_flow
from tests.integration.waits.support import task_subjects
from tests.integration.waits.test_waits_lock_order import (
    _hold_root,
    _lockable_now,
    _queued_on_the_root,
)
from tests.support.dbs import migrated_database

pytestmark = pytest.mark.mariadb


@pytest.fixture(
    scope="module", params=[pytest.param("mariadb", marks=pytest.mark.mariadb)], ids=["mariadb"]
)
def effect_dbs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    with (
        migrated_database(request, tmp_path_factory, "runtime_svc") as runtime,
        migrated_database(request, tmp_path_factory, "effect_owner_svc") as owner,
    ):
        yield runtime, owner


async def test_a_submit_retry_and_the_finalizer_queue_on_the_root_never_on_the_outbox_row(
    world: EffectWorld,
) -> None:
    rt = world.runtime
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    ids = submit_identities(
        rt.scope, flow_run_id=run.flow_run_id, submit_step_key="send#submit", invocation_ordinal=0
    )
    stalled, resume = asyncio.Event(), asyncio.Event()

    async def stall(phase: str, fence: Any, conn: Any) -> None:
        if phase == "executed":
            stalled.set()
            await resume.wait()

    stale = StepWorker(
        rt.engine,
        rt.store,
        rt.worker._views,
        owner="stale",
        waits=rt.rt.steps,
        effects=world.effects,
        heartbeat=False,
        hook=stall,
    )
    [candidate] = await rt.store.eligible_work(world.org, "durable_mutation")
    stale_task = asyncio.create_task(stale.process(world.org, candidate))
    await asyncio.wait_for(stalled.wait(), 20)
    # Its lease expires; recovery fences it; a second attempt commits the submit.
    rt.clock.advance(minutes=10)
    recovered, _ = await Sweeper(rt.engine, rt.store).sweep_org(world.org)
    assert recovered == 1
    rt.clock.advance(hours=1)
    await world.work()
    assert (await world.run(run.flow_run_id)).state is RunState.WAITING
    # The owner is unreachable for AcceptHandoff; the fence durably rejects: pre-final.
    world.dispatcher = world.runtime_dispatcher(
        handoff=_Partitioned(_base_handoff(world)), finalizer=None
    )
    for _ in range(10):
        await world.deliver()
        message = await world.message(run.flow_run_id)
        assert message is not None
        if message.delivery_state is DeliveryState.REJECTED:
            break
    assert message.delivery_state is DeliveryState.REJECTED

    blocker = await _hold_root(rt.engine, world.org, run.flow_run_id)
    ticket = FinalizationTicket(message, Disposition.REJECTED, world.dispatcher.spec)
    resume.set()  # the stale submit attempt goes on to its commit
    finalizing = asyncio.create_task(world.finalizer.finalize(ticket))
    try:
        await _queued_on_the_root(rt.engine, 2)
        assert await _lower_rows_free(world, run.flow_run_id, ids.message_id)
        assert not stale_task.done() and not finalizing.done()
    finally:
        await blocker.rollback()
        await blocker.close()
    outcome = await stale_task
    await finalizing

    assert outcome is Outcome.FENCE_LOST  # the stale submit wrote nothing
    assert await world.outbox_rows(run.flow_run_id) == 1
    assert await world.links(run.flow_run_id) == 1
    final = await world.message(run.flow_run_id)
    assert final is not None and final.delivery_state is DeliveryState.HANDOFF_REJECTED
    await world.work()
    assert (await world.run(run.flow_run_id)).state is RunState.SUCCEEDED
    assert await task_subjects(rt.engine, world.org) == ["email failed"]


async def _lower_rows_free(world: EffectWorld, run_id: str, message_id: str) -> bool:
    s, d, o, k = (
        flow_step_executions.c,
        flow_dependencies.c,
        runtime_outbox.c,
        flow_effect_links.c,
    )
    org = world.org
    probes = [
        select(s.step_execution_id)
        .where(s.org_id == org, s.flow_run_id == run_id)
        .with_for_update(nowait=True),
        select(d.dependency_id)
        .where(d.org_id == org, d.flow_run_id == run_id)
        .with_for_update(nowait=True),
        select(o.runtime_outbox_message_id)
        .where(o.org_id == org, o.runtime_outbox_message_id == message_id)
        .with_for_update(nowait=True),
        select(k.effect_link_id)
        .where(k.org_id == org, k.flow_run_id == run_id)
        .with_for_update(nowait=True),
    ]
    return all([await _lockable_now(world.runtime.engine, p) for p in probes])
