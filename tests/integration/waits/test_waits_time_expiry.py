"""Time waits and the four expiry outcomes on SQLite and MariaDB (§14.3, §14.4, §22.4).

Every delay is reached by shifting the database clock (``ShiftedClock``), never by
sleeping: a time wait is a durable due time on its dependency, found by the sweep's
bounded index scan, not a process timer.
"""

from __future__ import annotations

from datetime import timedelta

from runtime_svc.definitions.policy import (
    DEFAULT_POLICY_DOCUMENT,
    PolicyGeneration,
    normalize_policy_document,
    policy_document_digest,
)
from runtime_svc.definitions.repository import insert_policy_txn
from runtime_svc.kernel import RunState, StepState
from runtime_svc.kernel.wait_model import DependencyState
from services import db
from tests.integration.waits.support import (
    World,
    dependencies,
    events_of,
    signal_flow,
    step_states,
    task_subjects,
    timer_flow,
    until_flow,
)


async def test_time_wait_commits_dependency_with_resume_point_and_projects_paused(
    world: World,
) -> None:
    await world.seed(timer_flow("PT1H"))
    run = await world.start("wait_timer")
    waiting = await world.drive(run.flow_run_id)

    assert waiting.state is RunState.WAITING
    assert waiting.interview_status == "Paused"  # §18.2 projection
    assert waiting.paused_at is not None
    dep = await world.dependency(run.flow_run_id)
    assert dep.state is DependencyState.PENDING
    assert dep.producer_kind == "runtime.timer"
    assert dep.next_probe_at is not None and dep.deadline > dep.next_probe_at
    assert (dep.next_probe_at - dep.created_at) == timedelta(hours=1)
    # The wait's output checkpoint is the root's resume point.
    steps = await step_states(world.engine, world.org, run.flow_run_id)
    assert steps == {"pause": StepState.WAITING.code}
    assert waiting.current_checkpoint_id is not None

    # Not due yet: the sweep leaves it alone.
    stats = await world.sweep()
    assert stats.resolved == 0
    assert (await world.run(run.flow_run_id)).state is RunState.WAITING

    world.clock.advance(hours=1, seconds=1)
    stats = await world.sweep()
    assert stats.resolved == 1
    resumed = await world.run(run.flow_run_id)
    assert resumed.state is RunState.RUNNABLE
    assert resumed.interview_status == "Running"
    assert (await world.dependency(run.flow_run_id)).state is DependencyState.RESOLVED

    done = await world.drive(run.flow_run_id)
    assert done.state is RunState.SUCCEEDED
    assert await task_subjects(world.engine, world.org) == ["resumed"]
    assert await events_of(world.engine, world.org, run.flow_run_id) == 1


async def test_time_wait_until_an_absolute_instant_in_the_past_resumes_at_once(
    world: World,
) -> None:
    await world.seed(until_flow())
    run = await world.start("wait_until", key="2001-01-01T00:00:00Z")
    # The wait commits, and its fresh reconciliation finds the instant already passed.
    await world.drive(run.flow_run_id)
    done = await world.drive(run.flow_run_id)
    assert done.state is RunState.SUCCEEDED
    dep = await world.dependency(run.flow_run_id)
    assert dep.state is DependencyState.RESOLVED
    assert dep.resolution_receipt is not None and "2001-01-01" in dep.resolution_receipt


async def test_time_wait_until_a_value_that_is_no_date_fails_the_step_and_writes_no_dependency(
    world: World,
) -> None:
    await world.seed(until_flow())
    run = await world.start("wait_until", key="next tuesday")
    done = await world.drive(run.flow_run_id)
    assert done.state is RunState.TERMINAL_FAILED
    assert done.terminal_cause_code == "wait_until_invalid"
    assert await dependencies(world.engine, world.org, run.flow_run_id) == []


async def test_time_wait_due_before_its_deadline_resumes_even_when_swept_after_the_deadline(
    world: World,
) -> None:
    # The runtime was down past both times: the timer was due first, so it resumes.
    await world.seed(timer_flow("PT1H", deadline="PT2H"))
    run = await world.start("wait_timer")
    await world.drive(run.flow_run_id)
    world.clock.advance(hours=3)
    await world.sweep()
    assert (await world.dependency(run.flow_run_id)).state is DependencyState.RESOLVED
    assert (await world.drive(run.flow_run_id)).state is RunState.SUCCEEDED


async def test_terminal_failure_expiry_moves_step_and_root_out_of_waiting_atomically(
    world: World,
) -> None:
    # The instant is far beyond the deadline: the deadline comes first.
    await world.seed(until_flow(deadline="PT2H", expiry="terminal_failure"))
    run = await world.start("wait_until", key="2999-01-01")
    await world.drive(run.flow_run_id)
    before = await world.run(run.flow_run_id)
    world.clock.advance(hours=2, seconds=1)
    stats = await world.sweep()

    assert stats.expired == 1
    after = await world.run(run.flow_run_id)
    dep = await world.dependency(run.flow_run_id)
    assert after.state is RunState.TERMINAL_FAILED
    assert after.terminal_cause_code == "dependency_expired"
    assert after.state_version == before.state_version + 1
    assert after.completed_at is not None
    assert dep.state is DependencyState.EXPIRED and dep.state_version == 1
    assert await step_states(world.engine, world.org, run.flow_run_id) == {
        "pause": StepState.FAILED.code
    }
    assert await task_subjects(world.engine, world.org) == []


async def test_fault_path_expiry_activates_the_compiled_successor_and_makes_the_root_runnable(
    world: World,
) -> None:
    await world.seed(until_flow(deadline="PT2H", expiry="fault_path", fault=True))
    run = await world.start("wait_until", key="2999-01-01")
    await world.drive(run.flow_run_id)
    world.clock.advance(hours=2, seconds=1)
    await world.sweep()

    after = await world.run(run.flow_run_id)
    assert after.state is RunState.RUNNABLE
    assert after.current_element == "escalate"
    assert (await world.dependency(run.flow_run_id)).state is DependencyState.EXPIRED
    assert await step_states(world.engine, world.org, run.flow_run_id) == {
        "pause": StepState.FAILED.code,
        "escalate": StepState.PENDING.code,
    }
    done = await world.drive(run.flow_run_id)
    assert done.state is RunState.SUCCEEDED
    assert await task_subjects(world.engine, world.org) == ["escalated"]


async def test_quarantine_expiry_quarantines_dependency_step_and_root_atomically(
    world: World,
) -> None:
    await world.seed(until_flow(deadline="PT2H", expiry="quarantine"))
    run = await world.start("wait_until", key="2999-01-01")
    await world.drive(run.flow_run_id)
    world.clock.advance(hours=2, seconds=1)
    await world.sweep()

    after = await world.run(run.flow_run_id)
    assert after.state is RunState.QUARANTINED
    assert after.interview_status == "Error"
    assert (await world.dependency(run.flow_run_id)).state is DependencyState.QUARANTINED
    assert await step_states(world.engine, world.org, run.flow_run_id) == {
        "pause": StepState.QUARANTINED.code
    }


async def test_deadline_and_probe_bounds_come_from_the_plans_versioned_runtime_policy(
    world: World,
) -> None:
    # The plan was compiled under policy generation 9; that generation (stored for the
    # org) caps the wait age at one hour and allows two reconciliation probes.
    document = {**normalize_policy_document(DEFAULT_POLICY_DOCUMENT), "max_wait_seconds": 3600}
    document["waits"] = {"max_reconciliation_attempts": 2, "probe_initial_seconds": 10}
    async with db.transaction(world.engine) as conn:
        assert await insert_policy_txn(
            conn,
            PolicyGeneration(world.org, 9, document, policy_document_digest(document)),
            await db.db_now(conn),
        )
    await world.seed(signal_flow(deadline="P1D"))
    run = await world.start("wait_signal", key="r1")
    await world.drive(run.flow_run_id)
    dep = await world.dependency(run.flow_run_id)
    assert dep.deadline - dep.created_at == timedelta(hours=1)  # not the compiled P1D
    assert dep.next_probe_at is not None
    assert timedelta(seconds=5) <= dep.next_probe_at - dep.created_at <= timedelta(seconds=10)
    # Two probes find nothing, then probing stops: only a signal or the deadline remain.
    for _ in range(3):
        world.clock.advance(minutes=5)
        await world.sweep()
    dep = await world.dependency(run.flow_run_id)
    assert dep.reconciliation_attempts == 2
    assert dep.next_probe_at is None
    assert dep.state is DependencyState.PENDING
