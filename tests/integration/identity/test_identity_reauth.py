"""§22.6 identity bullets, end to end on a real worker (SQLite and MariaDB): a principal
disabled while the run waits, a permission change between steps, and a system-mode step
acting only as its explicit declared identity. Each denial follows the step's versioned
policy and is recorded with a safe reason code in history (the attempt) and audit."""

from __future__ import annotations

from runtime_svc.identity import permission_digest
from runtime_svc.kernel import RunState
from runtime_svc.worker.loop import DEFAULT_QUEUE_CLASSES
from tests.integration.atomic.support import attempts_of
from tests.integration.identity.support import (
    ANN,
    BOT,
    GRANTS,
    IdentityWorld,
    action_flow,
    audit_of,
    two_step_flow,
)
from tests.integration.waits.support import task_subjects

FAULT_PATH = {"principal_mode": "initiating_principal", "reauthorization": "fault_path"}
TERMINAL = {"principal_mode": "initiating_principal", "reauthorization": "terminal_failure"}
HANDOFF = {"principal_mode": "initiating_principal", "reauthorization": "system_handoff"}
SYSTEM = {"principal_mode": "system", "reauthorization": "terminal_failure"}


async def test_principal_disabled_while_waiting_fails_the_run_under_terminal_policy(
    world: IdentityWorld,
) -> None:
    await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS)
    await world.seed_with(action_flow("wait_then_act"), TERMINAL)
    run = await world.start_as("wait_then_act")
    assert (await world.drive(run.flow_run_id)).state is RunState.WAITING

    await world.directory.set_enabled(world.org, ANN, False)
    done = await world.resume_after_wait(run.flow_run_id)

    assert done.state is RunState.TERMINAL_FAILED
    assert done.terminal_cause_code == "principal_disabled"
    assert await task_subjects(world.engine, world.org) == []  # nothing acted
    attempts = await attempts_of(world.engine, world.org, run.flow_run_id)
    assert [a["safe_error_code"] for a in attempts if a["safe_error_code"]] == [
        "principal_disabled"
    ]
    (audit,) = await audit_of(world.engine, world.org, run.flow_run_id)
    assert audit["action"] == "flow_run.reauthorization_denied"
    assert (audit["actor_kind"], audit["actor_id"]) == ("principal", ANN)
    assert (audit["reason"], audit["policy"], audit["outcome"]) == (
        "principal_disabled",
        "terminal_failure",
        "terminal_failure",
    )
    assert audit["plan_step_key"] == "fmt" and audit["attempt_id"]


async def test_principal_disabled_while_waiting_takes_the_fault_path_under_fault_policy(
    world: IdentityWorld,
) -> None:
    await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS)
    await world.seed_with(action_flow("wait_then_act"), FAULT_PATH)
    run = await world.start_as("wait_then_act")
    assert (await world.drive(run.flow_run_id)).state is RunState.WAITING

    await world.directory.set_enabled(world.org, ANN, False)
    done = await world.resume_after_wait(run.flow_run_id)

    # The denied step did not act; the run took its compiled fault path (the Flow's own
    # fault ACCESS_REVOKED), not the runtime's terminal failure.
    (audit,) = await audit_of(world.engine, world.org, run.flow_run_id)
    assert (audit["reason"], audit["outcome"]) == ("principal_disabled", "fault_path")
    assert audit["plan_step_key"] == "fmt"
    assert done.state is RunState.TERMINAL_FAILED
    assert done.terminal_cause_code == "ACCESS_REVOKED"
    assert await task_subjects(world.engine, world.org) == []


async def test_principal_enabled_again_before_the_wait_ends_resumes_normally(
    world: IdentityWorld,
) -> None:
    await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS)
    await world.seed_with(action_flow("wait_then_act"), TERMINAL)
    run = await world.start_as("wait_then_act")
    await world.drive(run.flow_run_id)
    await world.directory.set_enabled(world.org, ANN, False)
    await world.directory.set_enabled(world.org, ANN, True)

    done = await world.resume_after_wait(run.flow_run_id)

    assert done.state is RunState.SUCCEEDED
    assert await task_subjects(world.engine, world.org) == ["resumed"]
    assert await audit_of(world.engine, world.org, run.flow_run_id) == []


async def test_principal_disabled_while_waiting_hands_off_to_the_declared_system_identity(
    world: IdentityWorld,
) -> None:
    await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS)
    await world.directory.put(world.org, BOT, enabled=True, grants=("Task.create",))
    await world.seed_with(action_flow("wait_then_act", system_identity=BOT), HANDOFF)
    run = await world.start_as("wait_then_act")
    await world.drive(run.flow_run_id)

    await world.directory.set_enabled(world.org, ANN, False)
    done = await world.resume_after_wait(run.flow_run_id)

    # ``fmt`` acted as the system identity (audited handoff); ``after`` declares no
    # action, runs as the disabled initiator and fails closed.
    audits = await audit_of(world.engine, world.org, run.flow_run_id)
    handoff = audits[0]
    assert handoff["action"] == "flow_run.system_handoff"
    assert (handoff["reason"], handoff["acting_principal_id"]) == ("principal_disabled", BOT)
    assert handoff["plan_step_key"] == "fmt"
    assert [a["plan_step_key"] for a in audits[1:]] == ["after"]
    assert (
        done.state is RunState.TERMINAL_FAILED and done.terminal_cause_code == "principal_disabled"
    )


async def test_permission_change_between_steps_fails_the_next_step(
    world: IdentityWorld,
) -> None:
    await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS)
    await world.directory.put(world.org, "user-bob", enabled=True, grants=GRANTS)
    await world.seed_with(two_step_flow(), None)
    changed = await world.start_as("two_steps", ANN)
    steady = await world.start_as("two_steps", "user-bob")
    # One pass runs each run's first step only (``process``: no step continuation, so
    # the second step is left due for after the permission change).
    for queue in DEFAULT_QUEUE_CLASSES:
        for candidate in await world.store.eligible_work(world.org, queue, limit=10):
            await world.worker.process(world.org, candidate)
    assert sorted(await task_subjects(world.engine, world.org)) == ["one", "one"]

    # An FLS/RLS grant is withdrawn from Ann between her run's steps.
    await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS[:1])
    done = await world.drive(changed.flow_run_id)
    other = await world.drive(steady.flow_run_id)

    assert done.state is RunState.TERMINAL_FAILED
    assert done.terminal_cause_code == "permission_changed"
    assert other.state is RunState.SUCCEEDED  # Bob's permissions did not change
    assert sorted(await task_subjects(world.engine, world.org)) == ["one", "one", "two"]
    (audit,) = await audit_of(world.engine, world.org, changed.flow_run_id)
    assert (audit["reason"], audit["plan_step_key"]) == ("permission_changed", "two")
    # The stored context digest is a digest, never the grants themselves.
    identity = await world.identity_of(changed.flow_run_id)
    assert identity.authorization_context_digest is not None
    assert "Task.create" not in identity.authorization_context_digest
    assert permission_digest(GRANTS) not in str(audit)


async def test_permission_change_between_steps_takes_the_fault_path_under_fault_policy(
    world: IdentityWorld,
) -> None:
    await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS)
    await world.seed_with(action_flow("act_now", wait=False), FAULT_PATH)
    run = await world.start_as("act_now")
    await world.directory.put(world.org, ANN, enabled=True, grants=("Task.read",))

    done = await world.drive(run.flow_run_id)

    (audit,) = await audit_of(world.engine, world.org, run.flow_run_id)
    assert (audit["reason"], audit["outcome"]) == ("permission_changed", "fault_path")
    assert done.state is RunState.TERMINAL_FAILED
    assert done.terminal_cause_code == "ACCESS_REVOKED"
    assert await task_subjects(world.engine, world.org) == []


async def test_system_mode_step_acts_as_its_declared_identity_not_the_initiator(
    world: IdentityWorld,
) -> None:
    await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS)
    await world.directory.put(world.org, BOT, enabled=True, grants=("Task.create",))
    await world.seed_with(action_flow("system_act", system_identity=BOT), SYSTEM)
    plan = world.plans["system_act"][1]
    declared = plan.step("fmt").principal
    assert declared is not None and declared.system_identity == BOT
    run = await world.start_as("system_act")
    assert (await world.identity_of(run.flow_run_id)).execution_principal_mode == "mixed"
    await world.drive(run.flow_run_id)

    # The initiator's permissions change: the system-mode step does not care.
    await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS)
    done = await world.resume_after_wait(run.flow_run_id)

    assert done.state is RunState.SUCCEEDED
    assert await task_subjects(world.engine, world.org) == ["resumed"]
    assert await audit_of(world.engine, world.org, run.flow_run_id) == []


async def test_system_mode_step_whose_declared_identity_is_disabled_never_acts(
    world: IdentityWorld,
) -> None:
    await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS)
    await world.directory.put(world.org, BOT, enabled=True, grants=("Task.create",))
    await world.seed_with(action_flow("system_act", system_identity=BOT), SYSTEM)
    run = await world.start_as("system_act")
    await world.drive(run.flow_run_id)
    await world.directory.set_enabled(world.org, BOT, False)

    done = await world.resume_after_wait(run.flow_run_id)

    assert done.state is RunState.TERMINAL_FAILED
    assert done.terminal_cause_code == "system_identity_disabled"
    (audit,) = await audit_of(world.engine, world.org, run.flow_run_id)
    assert (audit["actor_id"], audit["reason"]) == (BOT, "system_identity_disabled")
    assert await task_subjects(world.engine, world.org) == []


async def test_system_mode_step_whose_identity_is_not_in_the_directory_never_acts(
    world: IdentityWorld,
) -> None:
    await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS)
    await world.seed_with(action_flow("system_act", wait=False, system_identity=BOT), SYSTEM)
    run = await world.start_as("system_act")

    done = await world.drive(run.flow_run_id)

    assert done.state is RunState.TERMINAL_FAILED
    assert done.terminal_cause_code == "system_identity_unknown"
