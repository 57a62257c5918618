"""Worker concurrency (§22.2 duplicate claim / duplicate scheduler delivery; §22.3 Flow vs
ordinary record write on the same business row)."""

from __future__ import annotations

import asyncio
import json

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, LeaseFence, RunState
from runtime_svc.records import Actor, RecordEngine, prepare_update
from runtime_svc.worker import Outcome
from tests.integration.worker.support import (
    drive,
    make_worker,
    record_view,
    run_records,
    seed,
    start_run,
    step_counts,
)


async def test_two_workers_delivered_the_same_candidate_commit_it_once(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    [candidate] = await store.eligible_work(seeded.org, "durable_mutation")
    a, b = make_worker(engine, store, owner="a"), make_worker(engine, store, owner="b")
    outcomes = sorted(
        await asyncio.gather(a.process(seeded.org, candidate), b.process(seeded.org, candidate))
    )
    assert outcomes == sorted([Outcome.COMMITTED, Outcome.NOT_ELIGIBLE])
    # a replayed (stale) delivery of the same candidate is not eligible either
    assert await a.process(seeded.org, candidate) is Outcome.NOT_ELIGIBLE
    assert (await drive(a, seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED
    counts = await step_counts(engine, seeded.org, run.flow_run_id, "bump1")
    assert (counts.committed_attempts, counts.business_events) == (1, 1)


@pytest.mark.parametrize("kernel_db_url", ["mariadb"], indirect=True)
async def test_flow_step_and_ordinary_record_write_contend_on_the_same_row(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    # One step per batch: the hooked worker below must be the one that runs bump2.
    worker = make_worker(engine, store, continuation_limit=0)
    assert await worker.run_batch(seeded.org) == [Outcome.COMMITTED]  # bump1 created it
    assert await worker.run_batch(seeded.org) == [Outcome.COMMITTED]  # calc (pure)
    [account] = await run_records(engine, seeded.org)
    records = RecordEngine(engine)
    view = record_view()
    ordinary: list[asyncio.Task[object]] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "in_txn" and not ordinary:
            mutation = prepare_update(
                view, "Account", account["record_id"], None, {"Industry": "Retail"}
            )
            ordinary.append(
                asyncio.create_task(
                    records.mutate(seeded.org, view, mutation, actor=Actor("user", "u1"))
                )
            )
            await asyncio.sleep(0.3)
            assert not ordinary[0].done()  # blocked on the Flow step's business lock

    hooked = make_worker(engine, store, hook=hook, continuation_limit=0)
    assert await hooked.run_batch(seeded.org) == [Outcome.COMMITTED]  # bump2
    await asyncio.wait_for(ordinary[0], timeout=30)
    assert (await drive(worker, seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED
    [after] = await run_records(engine, seeded.org)
    fields = after["fields"] if isinstance(after["fields"], dict) else json.loads(after["fields"])
    assert after["record_version"] == 4
    assert fields["Industry"] == "Retail" and fields["Status"] == "s3"
