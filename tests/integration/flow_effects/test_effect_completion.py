"""``EffectCompletion`` (§15.2, §15.3, §22.5) on SQLite and MariaDB, end to end with the
real owner and providers: the owner's receipt resumes the Flow through the dependency
protocol and routes success / fault path / terminal failure / quarantine; the receipt may
arrive before the scheduler ever looked at the wait; and no crash, duplicate wake, lease
recovery or retry of the completion step can execute the submit again."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import select

from effect_owner_svc.schema import external_commands
from runtime_svc.api.runs_proto import effect_proto
from runtime_svc.effects import submit_identities
from runtime_svc.effects.support import effect_support_txn
from runtime_svc.kernel import RunState
from runtime_svc.kernel.wait_model import DependencyState
from runtime_svc.schema import flow_step_attempts, flow_step_executions
from runtime_svc.waits.evidence import SignalSubmission
from runtime_svc.worker import StepWorker, Sweeper
from services.db import transaction
from services.effect_contract import CompletionEvidence, CompletionOutcomeCode
from services.outbox import DeliveryState
from services.proto import common_v1
from tests.integration.flow_effects.world import EffectWorld, email_flow
from tests.integration.waits.support import dependencies, signals, task_subjects
from tests.support.effect_servers import DROP


async def _command_id(world: EffectWorld) -> str:
    c = external_commands.c
    async with transaction(world.owner_engine, readonly=True) as conn:
        return str(
            (
                await conn.execute(select(c.external_command_id).where(c.org_id == world.org))
            ).scalar_one()
        )


async def _attempts_of(world: EffectWorld, run_id: str, step_key: str) -> list[str]:
    s, a = flow_step_executions.c, flow_step_attempts.c
    async with transaction(world.runtime.engine, readonly=True) as conn:
        rows = await conn.execute(
            select(a.transaction_outcome)
            .select_from(
                flow_step_attempts.join(
                    flow_step_executions,
                    (s.org_id == a.org_id) & (s.step_execution_id == a.step_execution_id),
                )
            )
            .where(s.org_id == world.org, s.flow_run_id == run_id, s.plan_step_key == step_key)
            .order_by(a.attempt_number)
        )
        return [str(r[0]) for r in rows]


async def test_the_receipt_resumes_the_flow_on_its_success_edge(world: EffectWorld) -> None:
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")

    done = await world.settle(run.flow_run_id)

    assert done.state is RunState.SUCCEEDED, done
    assert await world.steps(run.flow_run_id) == [
        ("send#submit", "Succeeded"),
        ("send#completion", "Succeeded"),
        ("after", "Succeeded"),
    ]
    assert await task_subjects(world.runtime.engine, world.org) == ["sent"]
    # Exactly one of everything, counted on each side.
    assert await world.outbox_rows(run.flow_run_id) == 1
    assert await world.links(run.flow_run_id) == 1
    assert await world.commands_count() == 1
    assert world.sink.data_commands == 1 and len(world.sink.received) == 1
    assert world.sink.received[0].rcpt_tos == ("ada@example.com",)
    message = await world.message(run.flow_run_id)
    assert message is not None and message.delivery_state is DeliveryState.DELIVERED
    # The output variable holds the owner's command id (the receipt reference).
    output = await world.output(run.flow_run_id)
    assert output["msgId"] == await _command_id(world)
    [dep] = await dependencies(world.runtime.engine, world.org, run.flow_run_id)
    assert dep.state is DependencyState.RESOLVED and dep.wake_version == 1
    # The support read correlates the immutable link with its delivery state (§19).
    async with transaction(world.runtime.engine, readonly=True) as conn:
        [effect] = await effect_support_txn(conn, world.org, run.flow_run_id)
    assert effect.delivery_state is DeliveryState.DELIVERED
    proto = effect_proto(effect)
    assert proto.link.effect_handoff_key == message.key
    assert proto.link.runtime_outbox_message_id == message.message_id
    assert proto.link.effect_owner_kind == "email-gateway"
    assert proto.delivery_state == common_v1.OutboxDeliveryState.OUTBOX_DELIVERY_STATE_DELIVERED


async def test_a_provider_failure_takes_the_flows_fault_path(world: EffectWorld) -> None:
    await world.seed(email_flow())
    world.sink.replies = ["550"]  # the mail server refuses the message for good
    run = await world.start("effect_email", to="ada@example.com", name="Ada")

    done = await world.settle(run.flow_run_id)

    assert done.state is RunState.SUCCEEDED  # the fault path ends the run normally
    assert await task_subjects(world.runtime.engine, world.org) == ["email failed"]
    assert world.sink.data_commands == 1 and world.sink.received == []
    assert (await world.output(run.flow_run_id))["msgId"] is None


async def test_a_provider_failure_without_a_fault_connector_fails_the_run(
    world: EffectWorld,
) -> None:
    await world.seed(email_flow(fault=False))
    world.sink.replies = ["550"]
    run = await world.start("effect_email", to="ada@example.com", name="Ada")

    done = await world.settle(run.flow_run_id)

    assert done.state is RunState.TERMINAL_FAILED
    assert done.terminal_cause_code == "effect_failed"
    assert await task_subjects(world.runtime.engine, world.org) == []


@pytest.mark.parametrize("fault", [False, True], ids=["no-fault-path", "fault-path"])
async def test_an_unknown_outcome_follows_the_declared_policy_never_success(
    world: EffectWorld, fault: bool
) -> None:
    """§15.3: the mail server accepted the message but the answer was lost; SMTP has no
    lookup, so the owner quarantines the command (never resends) and reports
    OUTCOME_UNKNOWN; the Flow quarantines — or takes its explicitly declared fault path."""
    await world.seed(email_flow(fault=fault))
    world.sink.replies = [DROP]
    run = await world.start("effect_email", to="ada@example.com", name="Ada")

    done = await world.settle(run.flow_run_id)

    assert world.sink.data_commands == 1  # sent once, never again
    if fault:
        assert done.state is RunState.SUCCEEDED
        assert await task_subjects(world.runtime.engine, world.org) == ["email failed"]
    else:
        assert done.state is RunState.QUARANTINED
        assert done.terminal_cause_code == "effect_outcome_unknown"
        assert await world.steps(run.flow_run_id) == [
            ("send#submit", "Succeeded"),
            ("send#completion", "Quarantined"),
        ]


async def test_the_receipt_arrives_before_the_scheduler_observes_the_wait(
    world: EffectWorld,
) -> None:
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await world.work()  # the submit commits; no worker looks at the run again yet

    await world.deliver()
    await world.execute()
    await world.report()  # the owner's receipt reaches SubmitWakeSignal and resolves

    # Resolved before any scheduler pass saw the Waiting completion: it is Pending.
    mid = await world.run(run.flow_run_id)
    assert mid.state is RunState.RUNNABLE
    assert await world.steps(run.flow_run_id) == [
        ("send#submit", "Succeeded"),
        ("send#completion", "Pending"),
    ]
    assert await _attempts_of(world, run.flow_run_id, "send#completion") == []
    await world.work()
    await world.work()
    done = await world.run(run.flow_run_id)
    assert done.state is RunState.SUCCEEDED


async def test_a_receipt_committed_before_the_dependency_is_matched_by_the_submit_commit(
    world: EffectWorld,
) -> None:
    """§14.2: whichever commits last finds the other — here the receipt signal exists
    before the submit transaction creates the dependency; the submit's fresh
    reconciliation resumes the completion without any probe or sweep."""
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    key = submit_identities(
        world.runtime.scope,
        flow_run_id=run.flow_run_id,
        submit_step_key="send#submit",
        invocation_ordinal=0,
    ).handoff_key
    evidence = CompletionEvidence(
        command_id="cmd_early",
        outcome_version=1,
        outcome=CompletionOutcomeCode.SUCCEEDED,
        effect_owner_kind="email-gateway",
        effect_handoff_key=key,
    )
    await world.runtime.rt.signals.submit(
        world.runtime.work,
        SignalSubmission(
            producer_kind="effect.completion",
            producer_key=key,
            wake_token=evidence.wake_token,
            wake_version=1,
            evidence_digest=evidence.digest(),
            evidence_json=evidence.to_json(),
        ),
    )

    # One worker batch, no sweep, no probe: the submit commits and reconciles its new
    # dependency at once, so the same batch already runs the resumed completion (and, by
    # step continuation, the step after it).
    await world.work()

    assert await world.steps(run.flow_run_id) == [
        ("send#submit", "Succeeded"),
        ("send#completion", "Succeeded"),
        ("after", "Succeeded"),
    ]
    await world.work()
    assert (await world.output(run.flow_run_id))["msgId"] == "cmd_early"


async def test_a_receipt_activates_only_the_completion_step_it_is_bound_to(
    world: EffectWorld,
) -> None:
    await world.seed(email_flow())
    first = await world.start("effect_email", to="ada@example.com", name="Ada")
    second = await world.start("effect_email", to="bob@example.com", name="Bob")
    await world.work()  # both submits commit
    # Only the first run's message is delivered and executed.
    m1 = await world.message(first.flow_run_id)
    assert m1 is not None
    await world.dispatcher.process(m1)
    await world.execute()
    await world.report()

    a, b = await world.run(first.flow_run_id), await world.run(second.flow_run_id)
    assert a.state is RunState.RUNNABLE and b.state is RunState.WAITING
    assert (await world.steps(second.flow_run_id))[-1] == ("send#completion", "Waiting")
    assert [s.rcpt_tos for s in world.sink.received] == [("ada@example.com",)]


async def _count_enqueues(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import runtime_svc.effects.steps as steps

    calls: list[str] = []
    original = steps.enqueue_write

    def counting(spec: Any, message: Any, **kw: Any) -> Any:
        calls.append(message.key)
        return original(spec, message, **kw)

    monkeypatch.setattr(steps, "enqueue_write", counting)
    return calls


async def _at_completion(world: EffectWorld, run_id: str) -> None:
    """Submit committed, effect executed, receipt delivered: the completion is due."""
    await world.work()
    await world.deliver()
    await world.execute()
    await world.report()
    assert (await world.steps(run_id))[-1] == ("send#completion", "Pending")


async def _assert_one_effect(world: EffectWorld, run_id: str, enqueues: list[str]) -> None:
    done = await world.run(run_id)
    assert done.state is RunState.SUCCEEDED, done
    assert len(enqueues) == 1  # only the submit's commit ever enqueued
    assert await _attempts_of(world, run_id, "send#submit") == ["Committed"]
    assert await world.outbox_rows(run_id) == 1
    assert await world.commands_count() == 1
    assert world.sink.data_commands == 1
    assert await task_subjects(world.runtime.engine, world.org) == ["sent"]


async def test_a_duplicate_wake_is_a_no_op(
    world: EffectWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    enqueues = await _count_enqueues(monkeypatch)
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await _at_completion(world, run.flow_run_id)
    before = await signals(world.runtime.engine, world.org)
    # The owner's receipt is delivered again (a redelivery after a lost response), twice.
    [receipt] = [s for s in before if s.producer_kind == "effect.completion"]
    for _ in range(2):
        again = await world.runtime.rt.signals.submit(
            world.runtime.work,
            SignalSubmission(
                producer_kind=receipt.producer_kind,
                producer_key=receipt.producer_key,
                wake_token=receipt.wake_token,
                wake_version=receipt.wake_version or 0,
                evidence_digest=receipt.evidence_digest,
                evidence_json=receipt.evidence_json or "",
            ),
        )
        assert again.signal.wake_signal_id == receipt.wake_signal_id
    await world.settle(run.flow_run_id)
    assert len(await signals(world.runtime.engine, world.org)) == len(before)
    await _assert_one_effect(world, run.flow_run_id, enqueues)


async def test_lease_recovery_of_the_completion_step_never_resubmits(
    world: EffectWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    enqueues = await _count_enqueues(monkeypatch)
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await _at_completion(world, run.flow_run_id)
    rt = world.runtime
    # A worker claims the completion and dies holding its Running lease.
    [candidate] = await rt.store.eligible_work(world.org, "effect_completion")
    fence = await rt.store.claim(world.org, candidate, lease_owner="dead-worker")
    await rt.store.mark_running(world.org, fence)  # type: ignore[arg-type]
    rt.clock.advance(hours=1)  # the lease expired
    recovered, _ = await Sweeper(rt.engine, rt.store).sweep_org(world.org)
    assert recovered == 1
    rt.clock.advance(hours=1)  # past the recovery backoff

    await world.settle(run.flow_run_id)

    assert await _attempts_of(world, run.flow_run_id, "send#completion") == [
        "Fenced",
        "Committed",
    ]
    await _assert_one_effect(world, run.flow_run_id, enqueues)


async def test_a_retried_completion_step_never_resubmits(
    world: EffectWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    enqueues = await _count_enqueues(monkeypatch)
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await _at_completion(world, run.flow_run_id)
    failures = [RuntimeError("the completion's transaction failed before its commit")]

    async def fail_once(phase: str, fence: Any, conn: Any) -> None:
        if phase == "in_txn" and failures:
            raise failures.pop()

    rt = world.runtime
    hooked = StepWorker(
        rt.engine,
        rt.store,
        rt.worker._views,
        owner="flaky",
        waits=rt.rt.steps,
        effects=world.effects,
        heartbeat=False,
        hook=fail_once,
    )
    await hooked.run_batch(world.org)  # rolled back: the completion is RetryScheduled
    assert (await world.steps(run.flow_run_id))[-1] == ("send#completion", "RetryScheduled")
    rt.clock.advance(hours=1)

    await world.settle(run.flow_run_id)

    assert await _attempts_of(world, run.flow_run_id, "send#completion") == [
        "RolledBack",
        "Committed",
    ]
    await _assert_one_effect(world, run.flow_run_id, enqueues)


Tamper = Callable[[dict[str, Any]], dict[str, Any]]


@pytest.mark.parametrize(
    "tamper",
    [
        lambda e: {**e, "effect_owner_kind": "payments"},
        lambda e: {**e, "effect_handoff_key": "ehk1:" + "0" * 64 + ":" + "1" * 64},
    ],
    ids=["other-owner-kind", "other-handoff-key"],
)
async def test_a_receipt_that_does_not_match_its_link_quarantines(
    world: EffectWorld, tamper: Tamper
) -> None:
    """A signal whose evidence names another owner kind (or handoff key) than the link
    is never taken for the effect's outcome: the completion quarantines."""
    await world.seed(email_flow())
    run = await world.start("effect_email", to="ada@example.com", name="Ada")
    await world.work()
    key = submit_identities(
        world.runtime.scope,
        flow_run_id=run.flow_run_id,
        submit_step_key="send#submit",
        invocation_ordinal=0,
    ).handoff_key
    doc = tamper(
        {
            "command_id": "cmd_forged",
            "outcome_version": 1,
            "outcome": "SUCCEEDED",
            "safe_error_code": "",
            "result_digest": "",
            "effect_owner_kind": "email-gateway",
            "effect_handoff_key": key,
        }
    )
    await _force_receipt(world, key, doc)
    await world.work()

    done = await world.run(run.flow_run_id)
    assert done.state is RunState.QUARANTINED
    assert done.terminal_cause_code == "effect_receipt_invalid"


async def _force_receipt(world: EffectWorld, key: str, doc: dict[str, Any]) -> None:
    """Insert a receipt signal for ``key`` below the API's validation (as a buggy or
    hostile producer path would) and let the dependency consume it."""
    from datetime import timedelta

    from runtime_svc.kernel.store_waits import insert_signal_txn
    from runtime_svc.kernel.wait_model import NewSignal
    from services.digest import canonical_json, versioned_digest

    text = canonical_json(doc).decode()
    signal = NewSignal(
        wake_signal_id="sig_forged_" + world.org[-8:],
        producer_kind="effect.completion",
        producer_key=key,
        wake_token=f"{doc['command_id']}/1",
        wake_version=1,
        evidence_digest=versioned_digest("wake-evidence", json.loads(text)),
        evidence_reference=None,
        evidence_json=text,
    )
    rt = world.runtime
    async with transaction(rt.engine) as conn:
        now = await rt.clock(conn)
        await insert_signal_txn(
            conn, rt.work, signal, now, expires_at=now + timedelta(days=1), match_at=None
        )
    [dep] = await dependencies(rt.engine, world.org, (await _run_of(world, key)))
    await rt.rt.matcher.reconcile(world.org, dep.dependency_id)


async def _run_of(world: EffectWorld, key: str) -> str:
    from runtime_svc.schema import runtime_outbox

    o = runtime_outbox.c
    async with transaction(world.runtime.engine, readonly=True) as conn:
        return str(
            (
                await conn.execute(
                    select(o.flow_run_id).where(o.org_id == world.org, o.effect_handoff_key == key)
                )
            ).scalar_one()
        )
