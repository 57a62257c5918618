"""``EffectSubmit`` (§15.1, §22.5) on SQLite and MariaDB: one transaction commits the
outbox message, the link, the completion dependency, the checkpoint, the committed
attempt, the succeeded submit, the waiting completion and the waiting root — or nothing;
identities are deterministic; the payload is the frozen, safe evaluation of the inputs;
no owner command (and no remote call) exists before that commit."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from sqlalchemy import event, select

from runtime_svc.compiler.kinds import EFFECT_COMPLETION_PRODUCER
from runtime_svc.effects import submit_identities
from runtime_svc.effects.links import link_insert
from runtime_svc.kernel import RunState
from runtime_svc.kernel.wait_model import DependencyState, ExpiryPolicyCode
from runtime_svc.outbox import EffectHandoff
from runtime_svc.schema import flow_checkpoints, flow_runs, flow_step_attempts
from runtime_svc.worker import StepWorker
from services.db import strategy_for, transaction
from services.db_batch import Write, statements_of
from services.effect_contract import effect_payload_digest
from services.outbox import DeliveryResult, DeliveryState, OutboxMessage
from tests.integration.flow_effects.world import EffectWorld, email_flow
from tests.integration.waits.support import dependencies


async def _attempts(world: EffectWorld, step_id: str) -> list[str]:
    a = flow_step_attempts.c
    async with transaction(world.runtime.engine, readonly=True) as conn:
        rows = await conn.execute(
            select(a.transaction_outcome)
            .where(a.org_id == world.org, a.step_execution_id == step_id)
            .order_by(a.attempt_number)
        )
        return [str(r[0]) for r in rows]


async def _step_ids(world: EffectWorld, run_id: str) -> dict[str, str]:
    from runtime_svc.schema import flow_step_executions

    s = flow_step_executions.c
    async with transaction(world.runtime.engine, readonly=True) as conn:
        rows = await conn.execute(
            select(s.plan_step_key, s.step_execution_id).where(
                s.org_id == world.org, s.flow_run_id == run_id
            )
        )
        return {str(k): str(v) for k, v in rows}


async def test_submit_commits_message_link_dependency_checkpoint_and_the_waiting_transition_together(  # noqa: E501
    world: EffectWorld,
) -> None:
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    ids = submit_identities(
        world.runtime.scope,
        flow_run_id=run.flow_run_id,
        submit_step_key="send#submit",
        invocation_ordinal=0,
    )

    await world.work()

    root = await world.run(run.flow_run_id)
    steps = await world.steps(run.flow_run_id)
    assert steps == [("send#submit", "Succeeded"), ("send#completion", "Waiting")]
    step_ids = await _step_ids(world, run.flow_run_id)
    # Root Waiting, pointing at the completion step (whose identity was precomputed).
    assert root.state is RunState.WAITING
    assert root.current_step_execution_id == step_ids["send#completion"] == ids.completion_step_id
    assert await _attempts(world, step_ids["send#submit"]) == ["Committed"]
    # The canonical outbox message: deterministic id, Pending, frozen payload + digest.
    message = await world.message(run.flow_run_id)
    assert message is not None and message.message_id == ids.message_id
    assert message.key == ids.handoff_key
    assert message.delivery_state is DeliveryState.PENDING
    payload = {"to": "ada@example.com", "subject": "Welcome", "body": "Hello Ada"}
    assert json.loads(message.payload) == payload
    assert message.payload_digest == effect_payload_digest(payload)
    assert message.extra["effect_owner_kind"] == "email-gateway"
    assert message.extra["failure_policy"] == "fault_path"
    assert message.extra["step_execution_id"] == step_ids["send#submit"]
    # The completion dependency, bound to the completion step (never the submit).
    [dep] = await dependencies(world.runtime.engine, world.org, run.flow_run_id)
    assert dep.dependency_id == ids.dependency_id
    assert dep.step_execution_id == ids.completion_step_id
    assert (dep.producer_kind, dep.producer_key) == (EFFECT_COMPLETION_PRODUCER, ids.handoff_key)
    assert dep.state is DependencyState.PENDING
    assert dep.expiry_policy is ExpiryPolicyCode.FAULT_PATH
    assert message.deadline is not None and message.deadline == dep.deadline
    # One immutable link; the checkpoint the root points at is the completion's input.
    assert await world.links(run.flow_run_id) == 1
    c = flow_checkpoints.c
    async with transaction(world.runtime.engine, readonly=True) as conn:
        created_by = (
            await conn.execute(
                select(c.created_by_attempt_id).where(
                    c.org_id == world.org, c.checkpoint_id == root.current_checkpoint_id
                )
            )
        ).scalar_one()
    assert created_by == message.extra["submission_attempt_id"]
    assert await world.commands_count() == 0  # nothing left the runtime yet


async def test_the_submits_rows_ride_in_its_commits_round_trip(
    world: EffectWorld,
) -> None:
    """§15.1 step 4's three INSERTs — completion dependency, outbox message, link, in
    that order — follow the commit's own writes (checkpoint, root/step/attempt, the
    completion step) in the same round trip where the backend batches writes (ADR 0010,
    ``CommitTail``); one by one, in the same order, elsewhere. No clock statement."""
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    trips: list[list[str]] = []

    def on_execute(*args: Any) -> None:
        trips.append([" ".join(p.split()).split(" (")[0] for p in statements_of(str(args[2]))])

    engine = world.runtime.engine
    event.listen(engine.sync_engine, "before_cursor_execute", on_execute)
    try:
        await world.work()
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", on_execute)
    assert await world.links(run.flow_run_id) == 1
    inserts = [
        "INSERT INTO flow_dependencies",
        "INSERT INTO runtime_outbox",
        "INSERT INTO flow_effect_links",
    ]
    at = next(i for i, t in enumerate(trips) if "INSERT INTO flow_dependencies" in t)
    if strategy_for(engine.dialect).multi_statements:
        commit = trips[at]
        assert commit[0] == "INSERT INTO flow_checkpoints" and commit[-3:] == inserts
        assert "INSERT INTO flow_step_executions" in commit  # the completion step
        assert not any("TIMESTAMP" in s for s in trips[at - 1])
    else:
        assert [t[0] for t in trips[at : at + 3]] == inserts


async def test_a_failure_at_the_end_of_the_submit_transaction_writes_none_of_it(
    world: EffectWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")

    def broken_link(link: Any, now: Any) -> Write:
        async def failed(_rowcount: int) -> None:
            raise RuntimeError("the link insert failed")

        return dataclasses.replace(link_insert(link, now), check=failed)

    monkeypatch.setattr("runtime_svc.effects.steps.link_insert", broken_link)
    await world.work()

    # The dependency and the outbox message were written before the link in the same
    # transaction: all of it rolled back, and the attempt's rollback is recorded.
    assert await dependencies(world.runtime.engine, world.org, run.flow_run_id) == []
    assert await world.outbox_rows(run.flow_run_id) == 0
    assert await world.links(run.flow_run_id) == 0
    assert await world.steps(run.flow_run_id) == [("send#submit", "RetryScheduled")]
    root = await world.run(run.flow_run_id)
    assert root.state is RunState.RUNNABLE

    # The retry (after its durable backoff) commits once, under the same identities.
    monkeypatch.undo()
    world.runtime.clock.advance(hours=2)
    await world.work()
    ids = submit_identities(
        world.runtime.scope,
        flow_run_id=run.flow_run_id,
        submit_step_key="send#submit",
        invocation_ordinal=0,
    )
    message = await world.message(run.flow_run_id)
    assert message is not None and message.message_id == ids.message_id
    assert await world.outbox_rows(run.flow_run_id) == 1
    assert await world.links(run.flow_run_id) == 1
    step_ids = await _step_ids(world, run.flow_run_id)
    assert await _attempts(world, step_ids["send#submit"]) == ["RolledBack", "Committed"]


async def test_a_payload_with_credential_material_never_leaves_the_runtime(
    world: EffectWorld,
) -> None:
    flow = email_flow()
    # The checkpoint holds no credential; the payload's expression builds one.
    flow["elements"][0]["inputs"]["body"] = "CONCAT('Bearer ', name)"
    await world.seed(flow)
    run = await world.start("effect_email", to="ada@example.com", name="abcdefghijklmnop0123456789")
    await world.work()

    done = await world.run(run.flow_run_id)
    assert done.state is RunState.TERMINAL_FAILED
    assert done.terminal_cause_code == "effect_payload_credential"
    assert await world.outbox_rows(run.flow_run_id) == 0
    assert await world.commands_count() == 0


async def test_no_owner_command_exists_while_the_submit_transaction_is_open(
    world: EffectWorld,
) -> None:
    """§22.5: the owner learns of the effect only from the committed outbox message."""
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    seen: list[tuple[int, int]] = []

    async def in_txn(phase: str, fence: Any, conn: Any) -> None:
        if phase == "in_txn":
            # Inside the submit's business transaction: the dispatcher runs a full pass
            # (it can see nothing uncommitted) and the owner holds no command.
            await world.deliver()
            seen.append((await world.commands_count(), await world.outbox_rows()))

    rt = world.runtime
    worker = StepWorker(
        rt.engine,
        rt.store,
        rt.worker._views,
        owner="hooked",
        waits=rt.rt.steps,
        effects=world.effects,
        heartbeat=False,
        hook=in_txn,
    )
    await worker.run_batch(world.org)
    assert seen == [(0, 0)]
    assert await world.outbox_rows(run.flow_run_id) == 1
    await world.deliver()
    assert await world.commands_count() == 1


class _ProbingHandoff(EffectHandoff):
    """The runtime's real handoff calls, each preceded by a probe of the runtime database
    from a fresh connection: what the remote call may rely on is already committed."""

    def __init__(self, inner: EffectHandoff, world: EffectWorld) -> None:
        self.__dict__.update(inner.__dict__)
        self.world = world
        self.probes: list[dict[str, Any]] = []

    async def deliver(self, m: OutboxMessage) -> DeliveryResult:
        self.probes.append(await _probe(self.world, m))
        return await super().deliver(m)


async def _probe(world: EffectWorld, m: OutboxMessage) -> dict[str, Any]:
    engine = world.runtime.engine
    r = flow_runs.c
    run_id = str(m.extra["flow_run_id"])
    async with transaction(engine, readonly=True) as conn:
        state = (
            await conn.execute(
                select(r.runtime_state).where(r.org_id == m.org_id, r.flow_run_id == run_id)
            )
        ).scalar_one()
    result: dict[str, Any] = {"root": str(state), "rows": await world.outbox_rows(run_id)}
    if engine.dialect.name != "sqlite":
        # No open Flow transaction holds the root: a NOWAIT lock gets it at once.
        async with engine.connect() as conn:
            await conn.begin()
            try:
                await conn.execute(
                    select(r.flow_run_id)
                    .where(r.org_id == m.org_id, r.flow_run_id == run_id)
                    .with_for_update(nowait=True)
                )
                result["root_lockable"] = True
            finally:
                await conn.rollback()
    return result


async def test_no_remote_call_happens_inside_a_flow_business_transaction(
    world: EffectWorld,
) -> None:
    """§15/§22.5: the worker's EffectSubmit makes no call at all; the handoff call is
    made by the dispatcher after the Flow transaction committed (root Waiting, message
    visible) and while no transaction holds the root."""
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    base = world.dispatcher._families["flow.effect.submit"].deliver.__self__  # type: ignore[union-attr]
    probing = _ProbingHandoff(base, world)
    world.dispatcher = world.runtime_dispatcher(handoff=probing)

    await world.work()
    assert probing.probes == [] and await world.commands_count() == 0
    done = await world.settle(run.flow_run_id)

    assert done.state is RunState.SUCCEEDED
    assert len(probing.probes) == 1
    probe = probing.probes[0]
    assert probe["root"] == "Waiting" and probe["rows"] == 1
    if world.runtime.engine.dialect.name != "sqlite":
        assert probe["root_lockable"] is True
    assert len(world.sink.received) == 1
