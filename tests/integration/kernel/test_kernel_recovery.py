"""Rollback retry, lease expiry recovery and commit ambiguity (§11.3, §12.2-§12.4,
§13.4) on SQLite and MariaDB. Time moves by shifting the database clock of the store."""

from __future__ import annotations

from datetime import timedelta

import pymysql
import pytest
from sqlalchemy.engine import Connection

from runtime_svc.kernel import (
    CheckpointInput,
    FailureClass,
    LeaseFence,
    NotEligible,
    RunState,
    StepFailure,
    StepState,
)
from runtime_svc.kernel.decisions import (
    AlreadyCommitted,
    NoChange,
    Quarantined,
    Recovered,
    RecoveryTerminal,
    RetryExhausted,
    RetryScheduled,
)
from runtime_svc.schema import flow_step_attempts, flow_step_executions, records
from services import db
from services.errors import CommitOutcomeUnknownError, FenceLostError
from tests.integration.kernel.conftest import TEST_POLICY, World
from tests.integration.kernel.helpers import claim, claim_result, count, rows, start
from tests.integration.kernel.test_kernel_commit import business_commit, running

LEASE_S = TEST_POLICY.lease_duration_ms / 1000


async def attempts(world: World) -> list[dict[str, object]]:
    return sorted(
        await rows(world.engine, flow_step_attempts, org_id=world.org),
        key=lambda r: int(r["attempt_number"]),  # type: ignore[call-overload]
    )


async def expire_and_recover(world: World, run_id: str) -> Recovered:
    world.clock.advance(seconds=LEASE_S + 1)
    [result] = [r for r in await world.store.recover_expired(world.org) if r.flow_run_id == run_id]
    assert isinstance(result.decision, Recovered), result
    return result.decision


async def assert_retry_gate(world: World, run_id: str, run_after_delay_ms: int) -> LeaseFence:
    """Pre-due claim fails, due claim succeeds, and the root is never stranded Running."""
    run = await world.store.get_run(world.org, run_id)
    assert run.state is RunState.RUNNABLE and run.interview_status == "Running"
    assert await claim_result(world, run_id) == NotEligible("not_listed")
    world.clock.advance(milliseconds=run_after_delay_ms - 1_000)
    assert await claim_result(world, run_id) == NotEligible("not_listed")
    world.clock.advance(milliseconds=1_001)
    fence = await claim(world, run_id)
    assert fence.attempt_number >= 2
    return fence


async def test_proven_rollback_schedules_retry_with_floor_then_due_claim_succeeds(
    world: World,
) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)
    step_id = fence.step_execution_id

    decision = await world.store.record_rollback(
        world.org, fence, StepFailure(FailureClass.RETRYABLE, "deadlock_victim")
    )

    assert isinstance(decision, RetryScheduled)
    floor = TEST_POLICY.backoff_ms(1, step_id)
    assert decision.delay_ms == floor >= TEST_POLICY.floor_ms(1)
    [first] = await attempts(world)
    assert (first["transaction_outcome"], first["retry_decision"]) == ("RolledBack", "Scheduled")
    [step] = await rows(world.engine, flow_step_executions, org_id=world.org)
    assert step["state"] == "RetryScheduled" and step["run_after"] == decision.run_after
    run = await world.store.get_run(world.org, run_id)
    assert run.current_step_execution_id == step_id and run.run_after == decision.run_after
    # Stale retry attempts of the same worker are fenced now.
    with pytest.raises(FenceLostError):
        await world.store.record_rollback(
            world.org, fence, StepFailure(FailureClass.RETRYABLE, "again")
        )

    second = await assert_retry_gate(world, run_id, floor)
    assert second.step_execution_id == step_id and second.input_checkpoint_id == (
        fence.input_checkpoint_id
    )


async def test_retry_budget_exhaustion_and_terminal_failures_end_the_run(world: World) -> None:
    run_id = await start(world)
    for number in range(1, TEST_POLICY.max_attempts + 1):
        fence = await running(world, run_id)
        decision = await world.store.record_rollback(
            world.org, fence, StepFailure(FailureClass.RETRYABLE, "flaky")
        )
        if number < TEST_POLICY.max_attempts:
            assert isinstance(decision, RetryScheduled)
            world.clock.advance(milliseconds=decision.delay_ms + 1)
    assert isinstance(decision, RetryExhausted)
    run = await world.store.get_run(world.org, run_id)
    assert (run.state, run.terminal_cause_code) == (
        RunState.TERMINAL_FAILED,
        "retry_budget_exhausted",
    )
    assert [a["retry_decision"] for a in await attempts(world)][-1] == "Terminal"

    other = await start(world)
    decision = await world.store.record_rollback(
        world.org, await running(world, other), StepFailure(FailureClass.TERMINAL, "bad_input")
    )
    assert isinstance(decision, RetryExhausted) and decision.cause_code == "bad_input"


async def test_lease_expires_before_execution(world: World) -> None:
    run_id = await start(world)
    fence = await claim(world, run_id)  # Claimed, never started

    recovered = await expire_and_recover(world, run_id)

    [old] = await attempts(world)
    assert (old["transaction_outcome"], old["failure_class"]) == ("Fenced", "Fenced")
    assert old["finished_at"] == recovered.recovery_observed_at
    floor = int(old["recovery_backoff_floor_ms"])  # type: ignore[call-overload]
    assert recovered.run_after == recovered.recovery_observed_at + timedelta(milliseconds=floor)
    with pytest.raises(FenceLostError):
        await world.store.mark_running(world.org, fence)
    new = await assert_retry_gate(world, run_id, floor)
    assert new.lease_token != fence.lease_token


async def test_lease_expires_during_pure_compute(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)
    fence = await world.store.extend_lease(world.org, fence)  # heartbeats keep it alive...
    world.clock.advance(seconds=LEASE_S / 2)
    fence = await world.store.extend_lease(world.org, fence)
    world.clock.advance(seconds=LEASE_S / 2 + 0.5)
    assert await world.store.recover_expired(world.org) == []  # ...the heartbeat moved it

    await expire_and_recover(world, run_id)

    with pytest.raises(FenceLostError):
        await world.store.extend_lease(world.org, fence)
    with pytest.raises(FenceLostError):
        await world.store.commit_step(
            world.org, fence, output=CheckpointInput({}), advance=_finish()
        )


def _finish() -> object:
    from runtime_svc.kernel import FinishRun

    return FinishRun()


async def test_stale_worker_reaches_its_final_fence_after_the_replacement(world: World) -> None:
    """Lease expires during the mutation transaction: recovery and a replacement worker
    move on; the stale worker's whole business transaction rolls back at its fence."""
    run_id = await start(world)
    stale = await running(world, run_id)
    recovered = await expire_and_recover(world, run_id)
    world.clock.advance(
        seconds=(recovered.run_after - recovered.recovery_observed_at).total_seconds()
    )
    replacement = await world.store.mark_running(world.org, await claim(world, run_id, owner="w2"))
    await business_commit(world, replacement, "rec-new")

    with pytest.raises(FenceLostError):
        await business_commit(world, stale, "rec-stale")

    assert [r["record_id"] for r in await rows(world.engine, records, org_id=world.org)] == [
        "rec-new"
    ]
    outcomes = [a["transaction_outcome"] for a in await attempts(world)]
    assert outcomes == ["Fenced", "Committed"]


async def test_worker_dies_after_rollback_before_rolledback_transition(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)
    # The business transaction rolled back; the worker dies before record_rollback.
    with pytest.raises(RuntimeError):
        async with db.transaction(world.engine) as conn:
            await conn.execute(records.insert().values(**_record(world, "rec-lost")))
            raise RuntimeError("worker crashed")

    recovered = await expire_and_recover(world, run_id)

    [old] = await attempts(world)
    floor = int(old["recovery_backoff_floor_ms"])  # type: ignore[call-overload]
    assert recovered.run_after - recovered.recovery_observed_at == timedelta(milliseconds=floor)
    assert floor >= TEST_POLICY.floor_ms(1) > 0
    assert await count(world.engine, records, org_id=world.org) == 0
    await assert_retry_gate(world, run_id, floor)
    del fence


def _record(world: World, record_id: str) -> dict[str, object]:
    from datetime import datetime

    now = datetime.now().astimezone()
    return {
        "org_id": world.org,
        "object_name": "Task",
        "record_id": record_id,
        "record_version": 1,
        "fields": "{}",
        "created_at": now,
        "updated_at": now,
    }


async def test_repeated_lease_expiry_becomes_a_terminal_policy_signal(world: World) -> None:
    run_id = await start(world)
    for _ in range(TEST_POLICY.max_lease_expiries):
        await claim(world, run_id)
        recovered = await expire_and_recover(world, run_id)
        world.clock.advance(
            seconds=(recovered.run_after - recovered.recovery_observed_at).total_seconds()
        )
    await claim(world, run_id)
    world.clock.advance(seconds=LEASE_S + 1)

    [result] = await world.store.recover_expired(world.org)

    assert isinstance(result.decision, RecoveryTerminal)
    assert result.decision.cause_code == "lease_expiry_limit"
    run = await world.store.get_run(world.org, run_id)
    assert (run.state, run.interview_status) == (RunState.TERMINAL_FAILED, "Error")
    [step] = await rows(world.engine, flow_step_executions, org_id=world.org)
    assert step["state"] == StepState.FAILED.code
    assert await world.store.recover_expired(world.org) == []


async def test_recovery_does_nothing_when_the_commit_already_won(world: World) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)
    await business_commit(world, fence, "rec-1")
    world.clock.advance(seconds=LEASE_S + 1)

    assert await world.store.recover_expired(world.org) == []
    decision = await world.store.recover_step(world.org, run_id, fence.step_execution_id)
    assert decision == NoChange("not_recoverable")


async def test_commit_unknown_quarantines_and_never_retries(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection drops during COMMIT and the server rolled back: quarantine."""
    run_id = await start(world)
    fence = await running(world, run_id)
    real_rollback = Connection.rollback

    def lost_commit(self: Connection) -> None:
        real_rollback(self)  # the server never applied it...
        raise pymysql.err.OperationalError(2013, "Lost connection during query")  # ...we can't tell

    # The COMMIT of services.db.transaction (its sync half, in the driver's greenlet).
    monkeypatch.setattr(Connection, "commit", lost_commit)
    with pytest.raises(CommitOutcomeUnknownError):
        await business_commit(world, fence, "rec-unknown")
    monkeypatch.undo()

    decision = await world.store.quarantine_commit_unknown(world.org, fence)

    assert isinstance(decision, Quarantined)
    run = await world.store.get_run(world.org, run_id)
    assert (run.state, run.interview_status, run.terminal_cause_code) == (
        RunState.QUARANTINED,
        "Error",
        "commit_outcome_unknown",
    )
    [attempt] = await attempts(world)
    assert (attempt["transaction_outcome"], attempt["retry_decision"]) == (
        "CommitUnknown",
        "Quarantined",
    )
    world.clock.advance(days=1)
    assert await world.store.eligible_work(world.org, "durable_mutation") == []
    assert await world.store.recover_expired(world.org) == []


async def test_commit_unknown_after_a_durable_commit_reads_the_marker(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = await start(world)
    fence = await running(world, run_id)
    real_commit = Connection.commit

    def commit_then_lose_response(self: Connection) -> None:
        real_commit(self)
        raise pymysql.err.OperationalError(2013, "Lost connection during query")

    monkeypatch.setattr(Connection, "commit", commit_then_lose_response)
    with pytest.raises(CommitOutcomeUnknownError):
        await business_commit(world, fence, "rec-durable")
    monkeypatch.undo()

    assert await world.store.quarantine_commit_unknown(world.org, fence) == AlreadyCommitted()
    assert (await world.store.get_run(world.org, run_id)).state is RunState.RUNNABLE
    assert await count(world.engine, records, org_id=world.org) == 1


async def test_lease_expires_while_the_mutation_transaction_is_open(world: World) -> None:
    """The worker's business transaction is open (its record written, no lifecycle lock
    yet) when recovery fences the attempt; its final fence then fails and the business
    write rolls back. SQLite admits one writer at a time, so this interleaving exists on
    the MariaDB backend only (the serial order is covered by the replacement test)."""
    if world.engine.dialect.name == "sqlite":
        pytest.skip("SQLite serialises writers: the open transaction would block recovery")
    run_id = await start(world)
    fence = await running(world, run_id)
    async with db.transaction(world.engine) as conn:
        await conn.execute(records.insert().values(**_record(world, "rec-open")))
        await expire_and_recover(world, run_id)  # another connection, commits first
        with pytest.raises(FenceLostError):
            await world.store.commit_step_txn(
                conn,
                world.org,
                fence,
                output=CheckpointInput({}),
                advance=_finish(),  # type: ignore[arg-type]
            )
        await conn.rollback()
    assert await count(world.engine, records, org_id=world.org) == 0
    assert [a["transaction_outcome"] for a in await attempts(world)] == ["Fenced"]
