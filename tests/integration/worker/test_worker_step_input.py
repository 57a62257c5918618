"""A claimed step's preparation reads the run's plan, the step row and its input
checkpoint with one statement (``loop._step_input_txn``): what the three single reads
returned, and ``NotFoundError`` exactly when one of them found nothing — a soft-deleted
run, another org, a checkpoint of another run, a missing step."""

from __future__ import annotations

import dataclasses
import json

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, LeaseFence
from runtime_svc.schema import flow_checkpoints, flow_runs, flow_step_executions
from runtime_svc.worker import loop
from services import db
from services.errors import NotFoundError
from tests.integration.kernel.helpers import rows
from tests.integration.worker.support import seed, start_run
from tests.support.statements import watched_statements


async def _claimed(store: FlowRunStateStore, engine: AsyncEngine) -> tuple[str, LeaseFence]:
    seeded = await seed(engine)
    await start_run(store, seeded)
    [candidate] = await store.eligible_work(seeded.org, "durable_mutation", limit=1)
    fence = await store.claim(seeded.org, candidate, lease_owner="w", running=True)
    assert isinstance(fence, LeaseFence), fence
    return seeded.org, fence


async def _read(
    engine: AsyncEngine, org: str, fence: LeaseFence, checkpoint: str
) -> tuple[str, loop._StepRow, str, object]:
    async with db.transaction(engine, readonly=True) as conn:
        return await loop._step_input_txn(conn, org, fence, checkpoint)


async def test_the_step_input_is_what_the_single_reads_return_in_one_statement(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    org, fence = await _claimed(store, engine)
    assert fence.input_checkpoint_id is not None
    with watched_statements(engine) as seen:
        plan_id, step, payload, verification = await _read(
            engine, org, fence, fence.input_checkpoint_id
        )
    assert len([s for s in seen if s.startswith("SELECT")]) == 1, seen

    [run] = await rows(engine, flow_runs, org_id=org, flow_run_id=fence.flow_run_id)
    [row] = await rows(
        engine, flow_step_executions, org_id=org, step_execution_id=fence.step_execution_id
    )
    [checkpoint] = await rows(
        engine, flow_checkpoints, org_id=org, checkpoint_id=fence.input_checkpoint_id
    )
    assert plan_id == run["plan_id"]
    assert step == loop._StepRow(row["plan_step_key"], row["step_kind"], row["invocation_ordinal"])
    assert payload == checkpoint["context_payload"]
    raw = checkpoint["read_verification_set"]
    assert verification == (json.loads(raw) if isinstance(raw, str) else raw)


async def test_the_step_input_is_not_found_when_any_of_its_rows_is_missing(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    org, fence = await _claimed(store, engine)
    checkpoint = fence.input_checkpoint_id
    assert checkpoint is not None
    other_org, other = await _claimed(store, engine)
    assert other.input_checkpoint_id is not None
    cases = [
        (other_org, fence, checkpoint),  # the run, step and checkpoint of another org
        (org, fence, other.input_checkpoint_id),  # a checkpoint of another run
        (org, dataclasses.replace(fence, step_execution_id="step_missing"), checkpoint),
        (org, dataclasses.replace(fence, step_execution_id=other.step_execution_id), checkpoint),
        (org, fence, "ckpt_missing"),
    ]
    for case_org, case_fence, case_checkpoint in cases:
        with pytest.raises(NotFoundError):
            await _read(engine, case_org, case_fence, case_checkpoint)
    await _read(engine, org, fence, checkpoint)  # the real one is found
    # A soft-deleted run is not found either (as ``get_run_txn`` read it).
    async with db.transaction(engine) as conn:
        await conn.execute(
            sa.update(flow_runs)
            .where(flow_runs.c.org_id == org, flow_runs.c.flow_run_id == fence.flow_run_id)
            .values(is_deleted=True)
        )
    with pytest.raises(NotFoundError):
        await _read(engine, org, fence, checkpoint)
