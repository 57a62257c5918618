"""Crash proofs (issue 5; durable-workflow-seam Required Proof; spec §22.2 "process death
after claim, after begin, before fence, after fence, and after commit response").

Each test runs a REAL runtime child process on a shared test database, lets it SIGKILL
itself at one named fault point, asserts it died there (returncode -9 and the marker file
names the point — a child that exits any other way makes the test fail as inconclusive),
restarts it without the hook and waits (bounded) for the run to finish; then every
business effect of every step exists exactly once and no ``Running`` root is stranded.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import Candidate, FlowRunStateStore, NotEligible, RunState
from runtime_svc.schema import flow_runs, flow_step_executions
from runtime_svc.worker import RUN_OUTPUT_KEY
from services import db
from tests.crash.conftest import Child, Harness
from tests.integration.worker.support import (
    MUTATION_STEPS,
    TERMINAL,
    Seeded,
    final_context,
    run_records,
    seed,
    start_run,
    step_counts,
    wait_until,
)

pytestmark = pytest.mark.crash

_CHILD_DEATH_S = 60.0
_FINISH_S = 60.0


async def _expect_sigkill(h: Harness, child: Child, point: str) -> None:
    code = await child.wait_exit(_CHILD_DEATH_S)
    if code != -9:
        pytest.fail(
            f"inconclusive: the child did not die by SIGKILL at {point} "
            f"(returncode {code}):\n{child.log_text()[-3000:]}"
        )
    assert h.marker.read_text().splitlines()[-1] == point
    assert f"SIGKILL at {point}" in child.log_text()


async def _finish(h: Harness, store: FlowRunStateStore, seeded: Seeded, run_id: str) -> Any:
    child = h.spawn()

    async def done() -> bool:
        if child.proc.poll() is not None:
            pytest.fail(f"restarted child exited {child.proc.returncode}:\n{child.log_text()}")
        run = await store.get_run(seeded.org, run_id, include_deleted=True)
        return run.state in TERMINAL

    assert await wait_until(done, timeout_s=_FINISH_S), child.log_text()[-3000:]
    child.stop()
    return await store.get_run(seeded.org, run_id)


async def _assert_exactly_once(engine: AsyncEngine, seeded: Seeded, run: Any) -> None:
    assert run.state is RunState.SUCCEEDED, run
    [account] = await run_records(engine, seeded.org)
    assert account["record_version"] == len(MUTATION_STEPS)  # one change per step
    for key in MUTATION_STEPS:
        counts = await step_counts(engine, seeded.org, run.flow_run_id, key)
        assert counts.step_rows == 1, (key, counts)
        assert counts.committed_attempts == 1, (key, counts)
        assert counts.business_events == 1, (key, counts)
        assert counts.audit_records == 1, (key, counts)
    fields = account["fields"]
    fields = fields if isinstance(fields, dict) else json.loads(fields)
    output = (await final_context(engine, seeded.org, run))[RUN_OUTPUT_KEY]
    # The run's output is the recorded outcome: the record the one bump1 commit created.
    assert output["acct"]["Id"] == account["record_id"]
    assert output["acct"]["Name"] == fields["Name"] == "Crash"
    assert fields["Status"] == f"s{len(MUTATION_STEPS)}"
    r = flow_runs.c
    async with db.transaction(engine, readonly=True) as conn:
        running = (
            await conn.execute(
                select(func.count())
                .select_from(flow_runs)
                .where(r.org_id == seeded.org, r.runtime_state == RunState.RUNNING.code)
            )
        ).scalar_one()
    assert running == 0


async def _step_row(engine: AsyncEngine, seeded: Seeded, run_id: str, key: str) -> Any:
    s = flow_step_executions.c
    async with db.transaction(engine, readonly=True) as conn:
        return (
            (
                await conn.execute(
                    select(flow_step_executions).where(
                        s.org_id == seeded.org, s.flow_run_id == run_id, s.plan_step_key == key
                    )
                )
            )
            .mappings()
            .one()
        )


async def test_durable_seam_crash_between_step_commit_and_acknowledgement_produces_no_duplicate_domain_effects(  # noqa: E501
    harness: Harness, engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    """The seam's Required Proof (step 4's step-entry counter included). In this runtime
    the step's outcome marker *is* its lifecycle commit (attempt ``Committed``, step
    ``Succeeded``, output checkpoint, root advanced — one transaction), so after the kill
    the step is answered from that durable record: a replayed delivery of it is refused
    with nothing written, the restarted worker continues from the recorded outcome
    (the next step's input is bump2's recorded output), and bump2 is never executed
    twice. The kill *inside* the transaction is where a step is re-entered (1 → 2): see
    the parametrized test below."""
    seeded = await seed(engine)
    run = await start_run(store, seeded, label="Crash")
    point = "after_step_commit:bump2"

    await _expect_sigkill(harness, harness.spawn(point), point)

    # The commit is durable (its attempt marker is Committed) but the worker never
    # acknowledged it: it never went on to the next step.
    assert harness.entries("bump2") == 1 and harness.entries("bump3") == 0
    bump2 = await step_counts(engine, seeded.org, run.flow_run_id, "bump2")
    assert (bump2.committed_attempts, bump2.business_events, bump2.audit_records) == (1, 1, 1)
    bump3 = await step_counts(engine, seeded.org, run.flow_run_id, "bump3")
    assert bump3.committed_attempts == 0
    mid = await store.get_run(seeded.org, run.flow_run_id)
    recorded = await _step_row(engine, seeded, run.flow_run_id, "bump2")
    assert recorded["state"] == "Succeeded" and recorded["output_checkpoint_id"]
    # Step continuation (docs/adr/0002-step-continuation.md): the same commit claimed
    # bump3 for the killed worker — the root is Running on bump3, which nobody entered;
    # its lease expires and recovery hands it to the restarted worker.
    assert mid.state is RunState.RUNNING
    assert mid.current_step_execution_id != recorded["step_execution_id"]
    assert (await _step_row(engine, seeded, run.flow_run_id, "bump3"))["state"] == "Running"
    # A replayed delivery of bump2 (the candidate the dead worker held) re-enters the
    # claim and is answered by the recorded outcome: not claimable, nothing written.
    replay = Candidate(
        seeded.org,
        run.flow_run_id,
        str(recorded["step_execution_id"]),
        mid.state_version,
        int(recorded["state_version"]),
        mid.created_at,
        "durable_mutation",
    )
    assert isinstance(await store.claim(seeded.org, replay, lease_owner="replay"), NotEligible)
    assert await step_counts(engine, seeded.org, run.flow_run_id, "bump2") == bump2

    done = await _finish(harness, store, seeded, run.flow_run_id)
    await _assert_exactly_once(engine, seeded, done)
    # Entered once before the kill, never again; the next step ran once, from the
    # outcome recorded before the kill.
    assert harness.entries("bump2") == 1 and harness.entries("bump3") == 1
    nxt = await _step_row(engine, seeded, run.flow_run_id, "bump3")
    assert nxt["input_checkpoint_id"] == recorded["output_checkpoint_id"]


@pytest.mark.parametrize(
    "point",
    [
        "after_claim",
        "after_running",
        "after_step_begin:bump2",
        "before_step_fence:bump2",
        "before_step_commit:bump2",
        "after_step_commit:bump3",
        "after_continuation:bump2",
    ],
)
async def test_sigkill_at_named_point_then_restart_finishes_exactly_once(
    point: str, harness: Harness, engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded, label="Crash")

    await _expect_sigkill(harness, harness.spawn(point), point)
    step = "bump2" if point.endswith("bump2") else "bump3" if point.endswith("bump3") else "bump1"
    entered = harness.entries(step)
    continued = point.startswith("after_continuation")
    if continued:
        # Killed after calc's commit claimed bump2 for this worker (continuation),
        # before bump2 was entered: bump2 is Running under a lease nobody renews.
        assert entered == 0
        assert (await _step_row(engine, seeded, run.flow_run_id, "bump2"))["state"] == "Running"
    elif point.endswith(":bump2"):
        # Killed inside the business transaction (after BEGIN, before the fence, or after
        # the fence before COMMIT): nothing of bump2 became visible.
        bump2 = await step_counts(engine, seeded.org, run.flow_run_id, "bump2")
        assert (bump2.committed_attempts, bump2.business_events) == (0, 0)
        assert entered == 1
    elif point.startswith("after_step_commit"):
        assert entered == 1
    else:
        assert entered == 0  # killed after claiming, before the step was entered
        # The fused claim (ADR 0003): claim and Running committed in one transaction, so
        # both points find the step Running under the dead worker's lease and attempt —
        # never Claimed; only lease expiry hands it on.
        first = await _step_row(engine, seeded, run.flow_run_id, "bump1")
        assert first["state"] == "Running" and first["lease_token"] is not None
        assert first["attempt_count"] == 1

    done = await _finish(harness, store, seeded, run.flow_run_id)
    await _assert_exactly_once(engine, seeded, done)
    # Step-entry counter: a step killed inside its transaction is re-entered once (1 →
    # 2) and still has exactly one effect; a committed step is never re-entered.
    expected = 2 if point.endswith(":bump2") and not continued else 1
    assert harness.entries(step) == expected
    assert all(harness.entries(k) >= 1 for k in MUTATION_STEPS)


async def test_sigkill_during_recovery_then_restart_finishes_exactly_once(
    harness: Harness, engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded, label="Crash")
    # A first child dies holding a Running lease on bump1 ...
    await _expect_sigkill(harness, harness.spawn("after_running"), "after_running")
    # ... a second dies while recovering that expired lease ...
    await _expect_sigkill(harness, harness.spawn("during_recovery"), "during_recovery")
    # ... and a third, without hooks, recovers and finishes.
    done = await _finish(harness, store, seeded, run.flow_run_id)
    await _assert_exactly_once(engine, seeded, done)
