"""Operator reconciliation of a commit-unknown quarantine (``runtime_svc.kernel.reconcile``,
``store_reconcile``, ``python -m runtime_svc.ops``): the marker is read, the decision is
audited, the quarantined attempt is never rewritten, and a retry starts a new attempt from
the same input checkpoint."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from runtime_svc import ops
from runtime_svc.kernel import (
    AttemptOutcome,
    CheckpointInput,
    FinishRun,
    LeaseFence,
    RunState,
    StepState,
)
from runtime_svc.kernel.decisions import Quarantined
from runtime_svc.kernel.reconcile import CAUSE_QUARANTINE_FAILED, Resolution
from runtime_svc.kernel.store_reconcile import inspect_quarantine, reconcile_quarantine
from runtime_svc.schema import audit_records, flow_checkpoints, flow_step_attempts
from services import db
from services.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from tests.integration.kernel.conftest import TEST_POLICY, World
from tests.integration.kernel.helpers import claim, rows, start

MAX = TEST_POLICY.max_attempts


async def _quarantined(world: World) -> tuple[str, LeaseFence]:
    run_id = await start(world)
    fence = await world.store.mark_running(world.org, await claim(world, run_id))
    decision = await world.store.quarantine_commit_unknown(world.org, fence)
    assert isinstance(decision, Quarantined)
    return run_id, fence


async def test_show_reads_a_marker_without_a_commit(world: World) -> None:
    run_id, fence = await _quarantined(world)
    report = await inspect_quarantine(world.engine, world.org, run_id)
    assert report.run_state is RunState.QUARANTINED
    assert report.attempt_id == fence.attempt_id
    assert report.attempt_outcome is AttemptOutcome.COMMIT_UNKNOWN
    assert report.evidence is not None and not report.evidence.shows_commit


async def test_retry_reschedules_the_step_and_a_new_attempt_commits_it_once(
    world: World,
) -> None:
    run_id, fence = await _quarantined(world)
    result = await reconcile_quarantine(
        world.engine,
        world.org,
        run_id,
        Resolution.RETRY,
        operator="alice",
        reason="INC-1",
        max_attempts=MAX,
    )
    assert result.run_state is RunState.RUNNABLE

    view = await world.store.support_view(world.org, run_id)
    assert view.run.state is RunState.RUNNABLE
    assert view.current_step is not None
    assert view.current_step.state is StepState.RETRY_SCHEDULED
    again = await world.store.mark_running(world.org, await claim(world, run_id, owner="w2"))
    assert again.attempt_id != fence.attempt_id
    assert again.input_checkpoint_id == fence.input_checkpoint_id  # the same immutable input
    await world.store.commit_step(world.org, again, output=_output(), advance=FinishRun())
    attempts = {
        a["attempt_id"]: a for a in await rows(world.engine, flow_step_attempts, org_id=world.org)
    }
    assert attempts[fence.attempt_id]["transaction_outcome"] == "CommitUnknown"  # never rewritten
    assert attempts[again.attempt_id]["transaction_outcome"] == "Committed"
    assert (await world.store.get_run(world.org, run_id)).state is RunState.SUCCEEDED
    [audit] = await rows(world.engine, audit_records, org_id=world.org, flow_run_id=run_id)
    assert (audit["actor_kind"], audit["actor_id"], audit["action"]) == (
        "operator",
        "alice",
        "reconcile_quarantine",
    )
    assert audit["attempt_id"] == fence.attempt_id
    assert json.loads(audit["details"])["resolution"] == "retry"


async def test_fail_ends_the_run_terminally_with_its_cause(world: World) -> None:
    run_id, _ = await _quarantined(world)
    result = await reconcile_quarantine(
        world.engine,
        world.org,
        run_id,
        Resolution.FAIL,
        operator="alice",
        reason="INC-2",
        max_attempts=MAX,
    )
    assert result.run_state is RunState.TERMINAL_FAILED
    run = await world.store.get_run(world.org, run_id)
    assert run.state is RunState.TERMINAL_FAILED
    assert run.terminal_cause_code == CAUSE_QUARANTINE_FAILED
    with pytest.raises(FailedPreconditionError) as caught:
        await reconcile_quarantine(
            world.engine,
            world.org,
            run_id,
            Resolution.RETRY,
            operator="alice",
            reason="again",
            max_attempts=MAX,
        )
    assert caught.value.reason == "not_quarantined"


async def test_refusals_change_nothing(world: World) -> None:
    running = await start(world)
    with pytest.raises(FailedPreconditionError) as caught:
        await reconcile_quarantine(
            world.engine,
            world.org,
            running,
            Resolution.RETRY,
            operator="alice",
            reason="x",
            max_attempts=MAX,
        )
    assert caught.value.reason == "not_quarantined"

    run_id, fence = await _quarantined(world)
    with pytest.raises(FailedPreconditionError) as caught:
        await reconcile_quarantine(
            world.engine,
            world.org,
            run_id,
            Resolution.RETRY,
            operator="alice",
            reason="x",
            max_attempts=fence.attempt_number,
        )
    assert caught.value.reason == "attempt_budget_spent"

    # A marker that shows a commit (an output checkpoint of the quarantined attempt, as
    # if its lost COMMIT had landed): both resolutions are refused.
    async with db.transaction(world.engine) as conn:
        await conn.execute(
            flow_checkpoints.insert().values(
                org_id=world.org,
                checkpoint_id=f"ckpt_{uuid.uuid4().hex}",
                flow_run_id=run_id,
                sequence=99,
                plan_cursor="{}",
                context_schema_version=1,
                context_payload="{}",
                context_digest="test/v1:sha256:" + "0" * 64,
                created_by_attempt_id=fence.attempt_id,
                created_at=await db.db_now(conn),
            )
        )
    report = await inspect_quarantine(world.engine, world.org, run_id)
    assert report.evidence is not None and report.evidence.shows_commit
    for resolution in Resolution:
        with pytest.raises(FailedPreconditionError) as caught:
            await reconcile_quarantine(
                world.engine,
                world.org,
                run_id,
                resolution,
                operator="alice",
                reason="x",
                max_attempts=MAX,
            )
        assert caught.value.reason == "marker_shows_commit"
    assert (await world.store.get_run(world.org, run_id)).state is RunState.QUARANTINED
    assert await rows(world.engine, audit_records, org_id=world.org, flow_run_id=run_id) == []

    with pytest.raises(InvalidArgumentError):
        await reconcile_quarantine(
            world.engine,
            world.org,
            run_id,
            Resolution.FAIL,
            operator=" ",
            reason="x",
            max_attempts=MAX,
        )
    with pytest.raises(NotFoundError):
        await inspect_quarantine(world.engine, "org_other", run_id)


async def test_ops_cli_shows_and_retries(
    world: World, kernel_db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id, fence = await _quarantined(world)

    async def cli(*argv: str) -> int:
        # The CLI runs its own event loop (asyncio.run): give it a thread.
        return await asyncio.to_thread(ops.main, list(argv), db_url=kernel_db_url)

    assert await cli("quarantine", "show", "--org", world.org, "--run", run_id) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["attempt_id"] == fence.attempt_id
    assert shown["marker_shows_commit"] is False
    retry = ("quarantine", "retry", "--org", world.org, "--run", run_id)
    assert await cli(*retry, "--operator", "bob", "--reason", "INC-3") == 0
    assert json.loads(capsys.readouterr().out)["run_state"] == "RUNNABLE"
    assert await cli(*retry, "--operator", "bob", "--reason", "INC-3") == 1
    assert "not_quarantined" in capsys.readouterr().err
    assert await cli("quarantine", "retry", "--org", world.org) == 2


def _output() -> CheckpointInput:
    return CheckpointInput(context={"n": 1})
