"""Waiting runs under cancellation, delete, missing producers and repair, on SQLite and
MariaDB (§10.1, §11.1, §10.5, §14.3 repair, §22.4 "producer is missing")."""

from __future__ import annotations

from sqlalchemy import update

from runtime_svc.kernel import RunState, StepState
from runtime_svc.kernel.decisions import CancelRecorded
from runtime_svc.kernel.wait_model import DependencyState, SignalState
from runtime_svc.schema import flow_dependencies
from services import db
from tests.integration.waits.support import (
    World,
    approval,
    signal_flow,
    step_states,
    timer_flow,
    wait_flow,
)


async def _waiting(world: World, key: str = "r1") -> str:
    await world.seed(signal_flow())
    run = await world.start("wait_signal", key=key)
    assert (await world.drive(run.flow_run_id)).state is RunState.WAITING
    return run.flow_run_id


async def test_cancel_of_a_waiting_run_cancels_its_dependency_in_the_same_transaction(
    world: World,
) -> None:
    run_id = await _waiting(world)
    before = await world.run(run_id)
    decision = await world.store.request_cancel(world.org, run_id)
    assert isinstance(decision, CancelRecorded)
    # One root-first transaction: root CancelRequested, step CancelRequested, dependency
    # Cancelled — all visible together.
    mid = await world.run(run_id)
    assert mid.state is RunState.CANCEL_REQUESTED
    assert mid.state_version == before.state_version + 1
    assert await step_states(world.engine, world.org, run_id) == {
        "pause": StepState.CANCEL_REQUESTED.code
    }
    dep = await world.dependency(run_id)
    assert dep.state is DependencyState.CANCELLED and dep.resolved_at is not None

    await world.lease_sweeper.sweep_org(world.org)
    done = await world.run(run_id)
    assert done.state is RunState.CANCELLED
    assert await step_states(world.engine, world.org, run_id) == {"pause": StepState.CANCELLED.code}


async def test_delete_of_a_waiting_run_then_its_signal_changes_nothing_of_the_run(
    world: World,
) -> None:
    run_id = await _waiting(world)
    await world.store.delete_run(world.org, run_id)
    await world.lease_sweeper.sweep_org(world.org)
    deleted = await world.run(run_id)
    assert deleted.is_deleted and deleted.state is RunState.CANCELLED

    # A signal for the deleted run's key is still durably accepted (a producer cannot
    # know), but it matches nothing: no row of the run changes.
    outcome = await world.rt.signals.submit(world.work, approval("r1", "late"))
    assert outcome.signal.state is SignalState.UNMATCHED
    after = await world.run(run_id)
    assert after.state_version == deleted.state_version
    assert (await world.dependency(run_id)).state is DependencyState.CANCELLED
    await world.sweep()
    assert (await world.run(run_id)).state_version == deleted.state_version


async def test_a_dependency_whose_producer_is_not_registered_is_quarantined_not_polled(
    world: World,
) -> None:
    # A wait-class action names producer ``action:await_approval``: no runtime producer.
    source = {
        "api_name": "wait_action",
        "version": 1,
        "process_type": "autolaunched",
        "variables": [{"name": "recordId", "type": "string", "input": True}],
        "start": "ask",
        "elements": [
            {
                "api_name": "ask",
                "type": "ActionCall",
                "action_type": "await_approval",
                "inputs": {"recordId": "recordId"},
            }
        ],
    }
    await world.seed(source)
    run = await world.start("wait_action", recordId="x")
    done = await world.drive(run.flow_run_id)
    assert done.state is RunState.QUARANTINED
    assert done.terminal_cause_code == "dependency_producer_missing"
    dep = await world.dependency(run.flow_run_id)
    assert dep.state is DependencyState.QUARANTINED
    assert dep.next_probe_at is None


async def test_a_producer_unregistered_while_waiting_is_quarantined_by_the_reconciler(
    world: World,
) -> None:
    run_id = await _waiting(world)
    # The deployment dropped the signal kind: a restarted runtime has no such producer.
    restarted = world.other(world.scope)
    restarted.rt = type(world.rt).build(
        world.engine, clock=world.clock, signal_kinds=("approval.decision",)
    )
    restarted.sweeper = restarted.rt.sweeper(batch=10)
    world.clock.advance(minutes=1)  # the first probe is due
    await restarted.sweep()
    assert (await world.run(run_id)).state is RunState.QUARANTINED
    assert (await world.dependency(run_id)).state is DependencyState.QUARANTINED


async def test_repair_replays_the_root_first_finalizer_for_a_terminal_dependency(
    world: World,
) -> None:
    await world.seed(timer_flow("PT1H"))
    run = await world.start("wait_timer")
    await world.drive(run.flow_run_id)
    # Corruption: the dependency is Resolved but root and step still say Waiting.
    async with db.transaction(world.engine) as conn:
        d = flow_dependencies.c
        await conn.execute(
            update(flow_dependencies)
            .where(d.org_id == world.org, d.flow_run_id == run.flow_run_id)
            .values(state=DependencyState.RESOLVED.code, active_slot=None, next_probe_at=None)
        )
    stats = await world.sweep()
    assert stats.repaired == 1
    repaired = await world.run(run.flow_run_id)
    assert repaired.state is RunState.RUNNABLE
    assert (await world.drive(run.flow_run_id)).state is RunState.SUCCEEDED
    # Idempotent: a healthy pair is never touched again.
    assert (await world.sweep()).repaired == 0


async def test_repair_of_an_expired_dependency_under_a_waiting_root_applies_its_policy(
    world: World,
) -> None:
    await world.seed(
        wait_flow(
            "wait_fault", {"kind": "time", "duration": "PT1H"}, fault=True, expiry="fault_path"
        )
    )
    run = await world.start("wait_fault")
    await world.drive(run.flow_run_id)
    async with db.transaction(world.engine) as conn:
        d = flow_dependencies.c
        await conn.execute(
            update(flow_dependencies)
            .where(d.org_id == world.org, d.flow_run_id == run.flow_run_id)
            .values(state=DependencyState.EXPIRED.code, active_slot=None, next_probe_at=None)
        )
    assert (await world.sweep()).repaired == 1
    assert (await world.run(run.flow_run_id)).current_element == "escalate"
    assert (await world.drive(run.flow_run_id)).state is RunState.SUCCEEDED
