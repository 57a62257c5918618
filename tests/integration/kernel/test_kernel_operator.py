"""Operator controls in the state store (issue 14 item 5; ``store_operator``,
``store_reconcile.reconcile_quarantine_txn``) on SQLite and MariaDB: a paused run is
never claimed while a running step still commits, resume makes it claimable, every
decision is audited, and a race of pause/resume with a commit or a wake resolution — in
either order, or concurrently — ends in one consistent state."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from runtime_svc.compiler.kinds import EFFECT_COMPLETION_PRODUCER
from runtime_svc.kernel import (
    AttemptOutcome,
    CheckpointInput,
    FailureClass,
    LeaseFence,
    RunState,
    StepFailure,
    StepState,
)
from runtime_svc.kernel.decisions import EnterWait, NotEligible, Quarantined, WaitResolved
from runtime_svc.kernel.errors import StateVersionMismatchError
from runtime_svc.kernel.reconcile import Resolution
from runtime_svc.kernel.store_operator import (
    OperatorActor,
    pause_run_txn,
    restart_run_txn,
    resume_run_txn,
)
from runtime_svc.kernel.store_reconcile import reconcile_quarantine_txn
from runtime_svc.kernel.tables import root_step_consistent
from runtime_svc.kernel.transitions_operator import OperatorNoChange, PauseChange
from runtime_svc.schema import audit_records, flow_dependencies, flow_runs, flow_step_executions
from services import db
from services.digest import versioned_digest
from services.errors import FailedPreconditionError, NotFoundError
from tests.integration.kernel.conftest import TEST_POLICY, World
from tests.integration.kernel.helpers import QUEUE, claim, next_step, rows, start
from tests.support.invariants import stranded_runs

ALICE = OperatorActor("alice", "ops-key")


async def _txn(world: World, fn: Callable[[Any], Awaitable[Any]]) -> Any:
    return await db.run_in_transaction(world.engine, fn)


async def _pause(world: World, run_id: str, expected: int | None = None) -> Any:
    return await _txn(
        world,
        lambda c: pause_run_txn(c, world.org, run_id, ALICE, expected_state_version=expected),
    )


async def _resume(world: World, run_id: str, expected: int | None = None) -> Any:
    return await _txn(
        world,
        lambda c: resume_run_txn(c, world.org, run_id, ALICE, expected_state_version=expected),
    )


async def _eligible(world: World) -> list[str]:
    return [c.flow_run_id for c in await world.store.eligible_work(world.org, QUEUE)]


async def _audit(world: World, run_id: str) -> list[tuple[str, str, str]]:
    found = await rows(world.engine, audit_records, org_id=world.org, flow_run_id=run_id)
    found.sort(key=lambda a: a["occurred_at"])
    return [(a["actor_kind"], a["actor_id"], a["action"]) for a in found]


async def _assert_consistent(world: World, run_id: str) -> None:
    """No stranded run, root and current step agree (``stranded_runs`` + §18.2)."""
    runs = await rows(world.engine, flow_runs, org_id=world.org, flow_run_id=run_id)
    steps = {
        s["step_execution_id"]: s
        for s in await rows(world.engine, flow_step_executions, org_id=world.org)
    }
    deps = await rows(world.engine, flow_dependencies, org_id=world.org)
    assert (
        stranded_runs(
            runs, steps, max_attempts=TEST_POLICY.max_attempts, drained=True, dependencies=deps
        )
        == []
    )
    view = await world.store.support_view(world.org, run_id)
    assert view.current_step is not None
    assert root_step_consistent(view.run.state, view.current_step.state)


async def test_a_paused_run_is_not_claimed_until_resumed_and_both_are_audited(
    world: World,
) -> None:
    run_id = await start(world)
    [candidate] = [
        c for c in await world.store.eligible_work(world.org, QUEUE) if c.flow_run_id == run_id
    ]
    paused = await _pause(world, run_id)
    assert isinstance(paused, PauseChange)
    run = await world.store.get_run(world.org, run_id)
    assert run.operator_paused_at is not None
    assert (run.state, run.state_version, run.interview_status) == (RunState.RUNNABLE, 0, "Paused")
    assert run_id not in await _eligible(world)
    # A candidate listed before the pause is refused under the root lock.
    refused = await world.store.claim(world.org, candidate, lease_owner="w")
    assert refused == NotEligible("paused")
    assert await world.store.candidate_for_run(world.org, run_id) is None
    await _assert_consistent(world, run_id)  # a paused run is idle, not stranded

    assert isinstance(await _pause(world, run_id), OperatorNoChange)  # idempotent
    assert isinstance(await _resume(world, run_id), PauseChange)
    assert isinstance(await _resume(world, run_id), OperatorNoChange)
    run = await world.store.get_run(world.org, run_id)
    assert (run.operator_paused_at, run.interview_status) == (None, "Running")
    await claim(world, run_id)
    assert await _audit(world, run_id) == [
        ("operator", "alice", "flow_run.pause"),
        ("operator", "alice", "flow_run.resume"),
    ]


async def test_pause_refusals_write_nothing(world: World) -> None:
    run_id = await start(world)
    with pytest.raises(StateVersionMismatchError):
        await _pause(world, run_id, expected=3)
    with pytest.raises(NotFoundError):
        await _pause(world, f"run_{uuid.uuid4().hex}")
    await world.store.request_cancel(world.org, run_id)
    with pytest.raises(FailedPreconditionError) as caught:
        await _pause(world, run_id)
    assert caught.value.reason == "run_cancelling"
    await world.store.complete_cancel(world.org, run_id)
    with pytest.raises(FailedPreconditionError) as caught:
        await _pause(world, run_id)
    assert caught.value.reason == "run_terminal"
    assert (await world.store.get_run(world.org, run_id)).operator_paused_at is None
    assert await _audit(world, run_id) == []


async def _running(world: World, run_id: str) -> LeaseFence:
    return await world.store.mark_running(world.org, await claim(world, run_id))


async def _commit_next(world: World, fence: LeaseFence) -> None:
    await world.store.commit_step(
        world.org, fence, output=CheckpointInput({"n": 1}), advance=next_step()
    )


async def _after_pause_and_commit(world: World, run_id: str) -> None:
    """The one consistent state of "paused while its step committed": the commit landed,
    the next step is Pending and not claimed, the run projects Paused."""
    view = await world.store.support_view(world.org, run_id)
    assert view.run.state is RunState.RUNNABLE and view.run.operator_paused_at is not None
    assert view.run.interview_status == "Paused"
    assert view.current_step is not None and view.current_step.plan_step_key == "s2"
    assert view.current_step.state is StepState.PENDING
    assert run_id not in await _eligible(world)
    await _assert_consistent(world, run_id)
    await _resume(world, run_id)
    await claim(world, run_id)  # claimable again at once


@pytest.mark.parametrize("order", ["pause_first", "commit_first", "concurrent"])
async def test_pause_racing_a_running_steps_commit(world: World, order: str) -> None:
    run_id = await start(world)
    fence = await _running(world, run_id)
    if order == "pause_first":
        await _pause(world, run_id)
        await _commit_next(world, fence)  # the running attempt's commit stays legal
    elif order == "commit_first":
        await _commit_next(world, fence)
        await _pause(world, run_id)
    else:
        other = world.other_store()
        await asyncio.gather(
            _pause(world, run_id),
            other.commit_step(
                world.org, fence, output=CheckpointInput({"n": 1}), advance=next_step()
            ),
        )
    await _after_pause_and_commit(world, run_id)


async def _waiting(world: World) -> str:
    run_id = await start(world)
    fence = await _running(world, run_id)
    await world.store.commit_step(world.org, fence, output=CheckpointInput({}), advance=EnterWait())
    return run_id


async def _wake(world: World, run_id: str) -> Any:
    return await _txn(world, lambda c: world.store.resolve_wait_txn(c, world.org, run_id))


@pytest.mark.parametrize("order", ["wake_first", "pause_first", "concurrent"])
async def test_a_wake_while_paused_makes_the_step_runnable_not_claimed(
    world: World, order: str
) -> None:
    run_id = await _waiting(world)
    if order == "wake_first":
        assert isinstance(await _wake(world, run_id), WaitResolved)
        await _pause(world, run_id)
    elif order == "pause_first":
        await _pause(world, run_id)
        assert (await world.store.get_run(world.org, run_id)).interview_status == "Paused"
        assert isinstance(await _wake(world, run_id), WaitResolved)
    else:
        woke, _ = await asyncio.gather(_wake(world, run_id), _pause(world, run_id))
        assert isinstance(woke, WaitResolved)
    run = await world.store.get_run(world.org, run_id)
    assert (run.state, run.interview_status) == (RunState.RUNNABLE, "Paused")
    assert run_id not in await _eligible(world)
    await _assert_consistent(world, run_id)


@pytest.mark.parametrize("order", ["wake_first", "resume_first", "concurrent"])
async def test_resume_racing_a_wake(world: World, order: str) -> None:
    run_id = await _waiting(world)
    await _pause(world, run_id)
    if order == "wake_first":
        await _wake(world, run_id)
        await _resume(world, run_id)
    elif order == "resume_first":
        await _resume(world, run_id)
        await _wake(world, run_id)
    else:
        await asyncio.gather(_wake(world, run_id), _resume(world, run_id))
    run = await world.store.get_run(world.org, run_id)
    assert (run.state, run.interview_status, run.operator_paused_at) == (
        RunState.RUNNABLE,
        "Running",
        None,
    )
    await _assert_consistent(world, run_id)
    await claim(world, run_id)


async def _quarantined(world: World) -> tuple[str, LeaseFence]:
    run_id = await start(world)
    fence = await _running(world, run_id)
    assert isinstance(await world.store.quarantine_commit_unknown(world.org, fence), Quarantined)
    return run_id, fence


async def _retry(world: World, run_id: str, expected: int | None = None) -> Any:
    return await _txn(
        world,
        lambda c: reconcile_quarantine_txn(
            c,
            world.org,
            run_id,
            Resolution.RETRY,
            actor=ALICE,
            reason="INC-7 marker checked",
            max_attempts=TEST_POLICY.max_attempts,
            expected_state_version=expected,
            request_rpc="RetryQuarantinedRun",
        ),
    )


async def test_retry_quarantined_is_fenced_audited_and_a_new_attempt_runs(world: World) -> None:
    run_id, fence = await _quarantined(world)
    version = (await world.store.get_run(world.org, run_id)).state_version
    with pytest.raises(StateVersionMismatchError):
        await _retry(world, run_id, expected=version + 5)
    with pytest.raises(FailedPreconditionError) as caught:
        await _pause(world, run_id)  # a quarantined run is terminal: no pause
    assert caught.value.reason == "run_terminal"
    await _retry(world, run_id, expected=version)
    view = await world.store.support_view(world.org, run_id)
    assert view.run.state is RunState.RUNNABLE
    assert view.current_step is not None
    assert view.current_step.state is StepState.RETRY_SCHEDULED
    again = await world.store.mark_running(world.org, await claim(world, run_id, owner="w2"))
    assert again.attempt_id != fence.attempt_id
    [audit] = await rows(world.engine, audit_records, org_id=world.org, flow_run_id=run_id)
    details = json.loads(audit["details"])
    assert (audit["actor_id"], audit["action"], details["key_id"]) == (
        "alice",
        "reconcile_quarantine",
        "ops-key",
    )
    assert (details["reason"], details["request_rpc"]) == (
        "INC-7 marker checked",
        "RetryQuarantinedRun",
    )
    with pytest.raises(FailedPreconditionError) as caught:
        await _retry(world, run_id)  # no longer quarantined
    assert caught.value.reason == "not_quarantined"


async def test_retry_is_refused_while_an_effect_outcome_is_unknown(world: World) -> None:
    run_id, _ = await _quarantined(world)
    view = await world.store.support_view(world.org, run_id)
    assert view.current_step is not None
    async with db.transaction(world.engine) as conn:
        await conn.execute(
            flow_dependencies.insert().values(
                org_id=world.org,
                app_installation_id=world.scope.app_installation_id,
                runtime_capability_id=world.scope.runtime_capability_id,
                runtime_work_binding_digest=world.scope.runtime_work_binding_digest,
                dependency_id=f"dep_{uuid.uuid4().hex[:12]}",
                flow_run_id=run_id,
                step_execution_id=view.current_step.step_execution_id,
                producer_kind=EFFECT_COMPLETION_PRODUCER,
                producer_key=f"hk_{uuid.uuid4().hex}",
                condition_digest=versioned_digest("test", {"dep": run_id}),
                state="Pending",
                state_version=0,
                deadline=view.run.created_at,
                expiry_policy="Quarantine",
                created_at=view.run.created_at,
                updated_at=view.run.created_at,
            )
        )
    with pytest.raises(FailedPreconditionError) as caught:
        await _retry(world, run_id)
    assert caught.value.reason == "effect_outcome_unknown"
    assert (await world.store.get_run(world.org, run_id)).state is RunState.QUARANTINED
    assert await _audit(world, run_id) == []


async def _failed_at_second_step(world: World) -> tuple[str, str, str]:
    """A run whose second step failed terminally: ``(run, s1 input, s2 input)``."""
    run_id = await start(world)
    first = await _running(world, run_id)
    await _commit_next(world, first)
    second = await _running(world, run_id)
    failure = StepFailure(FailureClass.TERMINAL, "boom", AttemptOutcome.ROLLED_BACK)
    await world.store.record_rollback(world.org, second, failure)
    run = await world.store.get_run(world.org, run_id)
    assert run.state is RunState.TERMINAL_FAILED
    return run_id, first.input_checkpoint_id, second.input_checkpoint_id


async def _restart(world: World, run_id: str, checkpoint: str, expected: int | None = None) -> Any:
    return await _txn(
        world,
        lambda c: restart_run_txn(
            c,
            world.org,
            run_id,
            checkpoint,
            ALICE,
            reason="INC-8 downstream fixed",
            expected_state_version=expected,
        ),
    )


@pytest.mark.parametrize("from_step", ["s1", "s2"])
async def test_restart_from_a_checkpoint_runs_a_new_step_and_keeps_history(
    world: World, from_step: str
) -> None:
    run_id, s1_input, s2_input = await _failed_at_second_step(world)
    checkpoint = s1_input if from_step == "s1" else s2_input
    before = await world.store.support_view(world.org, run_id)
    old_steps = {s.step_execution_id: s.state for s in before.steps}
    with pytest.raises(StateVersionMismatchError):
        await _restart(world, run_id, checkpoint, expected=before.run.state_version + 1)
    restarted = await _restart(world, run_id, checkpoint, expected=before.run.state_version)
    view = await world.store.support_view(world.org, run_id)
    assert view.run.state is RunState.RUNNABLE
    assert (view.run.terminal_cause_code, view.run.completed_at) == (None, None)
    assert view.run.current_checkpoint_id == checkpoint
    assert view.current_step is not None
    assert view.current_step.step_execution_id == restarted.step_execution_id
    assert (view.current_step.plan_step_key, view.current_step.invocation_ordinal) == (
        from_step,
        1,
    )
    assert view.current_step.input_checkpoint_id == checkpoint
    # Nothing old is rewritten or deleted.
    assert {
        s.step_execution_id: s.state for s in view.steps if s.step_execution_id in old_steps
    } == (old_steps)
    await _assert_consistent(world, run_id)
    fence = await _running(world, run_id)
    assert fence.input_checkpoint_id == checkpoint
    [audit] = await rows(world.engine, audit_records, org_id=world.org, flow_run_id=run_id)
    details = json.loads(audit["details"])
    assert (audit["action"], details["checkpoint_id"], details["terminal_cause_code"]) == (
        "flow_run.restart",
        checkpoint,
        before.run.terminal_cause_code,
    )


async def test_restart_refusals_write_nothing(world: World) -> None:
    running = await start(world)
    ckpt = (await world.store.get_run(world.org, running)).current_checkpoint_id
    assert ckpt is not None
    with pytest.raises(FailedPreconditionError) as caught:
        await _restart(world, running, ckpt)
    assert caught.value.reason == "run_not_failed"

    run_id, s1_input, _ = await _failed_at_second_step(world)
    with pytest.raises(NotFoundError):
        await _restart(world, run_id, ckpt)  # a checkpoint of another run
    last = (await world.store.support_view(world.org, run_id)).steps
    outputs = [s.output_checkpoint_id for s in last if s.output_checkpoint_id]
    quarantined, _ = await _quarantined(world)
    q_ckpt = (await world.store.get_run(world.org, quarantined)).current_checkpoint_id
    assert q_ckpt is not None
    with pytest.raises(FailedPreconditionError) as caught:
        await _restart(world, quarantined, q_ckpt)
    assert caught.value.reason == "run_quarantined"
    assert (await world.store.get_run(world.org, run_id)).state is RunState.TERMINAL_FAILED
    assert await _audit(world, run_id) == []
    assert outputs  # s1's output is s2's input: a step input, so restartable
    await _restart(world, run_id, s1_input)


async def test_an_expired_lease_of_a_paused_run_is_recovered_but_not_reclaimed(
    world: World,
) -> None:
    run_id = await start(world)
    await _running(world, run_id)
    await _pause(world, run_id)
    world.clock.advance(milliseconds=TEST_POLICY.lease_duration_ms + 1)
    [recovered] = await world.store.recover_expired(world.org)
    assert recovered.flow_run_id == run_id
    world.clock.advance(milliseconds=TEST_POLICY.max_delay_ms * 2)  # any backoff is due
    view = await world.store.support_view(world.org, run_id)
    assert view.run.state is RunState.RUNNABLE and view.run.interview_status == "Paused"
    assert view.current_step is not None
    assert view.current_step.state is StepState.RETRY_SCHEDULED
    assert run_id not in await _eligible(world)
    await _assert_consistent(world, run_id)
    await _resume(world, run_id)
    await claim(world, run_id)


async def test_a_run_paused_before_its_quarantine_stays_paused_after_the_retry(
    world: World,
) -> None:
    run_id = await start(world)
    fence = await _running(world, run_id)
    await _pause(world, run_id)  # the running attempt then loses its COMMIT
    assert isinstance(await world.store.quarantine_commit_unknown(world.org, fence), Quarantined)
    assert (await world.store.get_run(world.org, run_id)).interview_status == "Error"
    await _retry(world, run_id)
    run = await world.store.get_run(world.org, run_id)
    assert (run.state, run.interview_status) == (RunState.RUNNABLE, "Paused")
    assert run_id not in await _eligible(world)
    await _resume(world, run_id)
    await claim(world, run_id)
