"""A 3-mutation-step Durable Orchestration run executed by the worker (§12.2)."""

from __future__ import annotations

import json

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, RunState
from runtime_svc.schema import flow_checkpoints
from runtime_svc.worker import RUN_OUTPUT_KEY, Outcome
from services import db
from tests.integration.worker.support import (
    MUTATION_STEPS,
    drive,
    final_context,
    make_worker,
    run_records,
    seed,
    start_run,
    step_counts,
)


async def test_three_step_run_finishes_with_expected_records_and_checkpoints(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded, label="Acme", n=41)
    worker = make_worker(engine, store)

    done = await drive(worker, seeded.org, run.flow_run_id)

    assert done.state is RunState.SUCCEEDED
    [account] = await run_records(engine, seeded.org)
    assert account["record_version"] == 3
    fields = (
        account["fields"] if isinstance(account["fields"], dict) else json.loads(account["fields"])
    )
    assert fields["Name"] == "Acme" and fields["Status"] == "s3"
    for key in MUTATION_STEPS:
        counts = await step_counts(engine, seeded.org, run.flow_run_id, key)
        assert (counts.step_rows, counts.committed_attempts) == (1, 1), key
        assert (counts.business_events, counts.audit_records) == (1, 1), key
    ctx = await final_context(engine, seeded.org, done)
    assert ctx[RUN_OUTPUT_KEY]["n"] == 42
    assert ctx[RUN_OUTPUT_KEY]["acct"]["Id"] == account["record_id"]
    c = flow_checkpoints.c
    async with db.transaction(engine, readonly=True) as conn:
        seqs = list(
            (
                await conn.execute(
                    select(c.sequence)
                    .where(c.org_id == seeded.org, c.flow_run_id == run.flow_run_id)
                    .order_by(c.sequence)
                )
            ).scalars()
        )
    # input + one immutable output checkpoint per step (bump1, calc, bump2, bump3)
    assert len(seqs) == 5


async def test_nothing_eligible_returns_no_work(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    # One step per batch (no continuation): the batch's own claim is what is inspected.
    worker = make_worker(engine, store, continuation_limit=0)
    assert await worker.run_batch(seeded.org) == []
    run = await start_run(store, seeded)
    first = await worker.run_batch(seeded.org)
    assert first == [Outcome.COMMITTED]
    assert (await store.get_run(seeded.org, run.flow_run_id)).state is RunState.RUNNABLE
