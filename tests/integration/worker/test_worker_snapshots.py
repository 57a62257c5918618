"""Snapshot verification (§7.5 ``VerifiedSnapshotRead``, §12.2 step 6), on SQLite and
MariaDB: a snapshot read records verification tokens in its output checkpoint, the tokens
travel through the pure step in between, and the mutation that ``verifies`` them re-reads
the records under lock; a changed or vanished record rolls the mutation back with nothing
written and fails the run with ``snapshot_changed`` (no retry churn: a retry from the same
checkpoint can never pass, see ``runtime_svc.worker.snapshots``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler import StepKind
from runtime_svc.kernel import FlowRunStateStore, LeaseFence, RunState
from runtime_svc.schema import (
    business_events,
    flow_checkpoints,
    flow_step_attempts,
    flow_step_executions,
    records,
)
from runtime_svc.worker import SNAPSHOT_CHANGED, Outcome
from services import db
from tests.integration.kernel.helpers import rows
from tests.integration.worker.support import (
    Seeded,
    drive,
    make_worker,
    run_records,
    seed,
    start_run,
    step_counts,
)


def snapshot_source() -> dict[str, Any]:
    """Create an Account; snapshot-read it; a pure step; update it (verifies ``load``)."""
    return {
        "api_name": "worker_snapshot_verify",
        "version": 1,
        "description": "worker test Flow: snapshot read verified by a later mutation",
        "process_type": "autolaunched",
        "variables": [
            {"name": "acct", "type": "record", "object": "Account"},
            {"name": "snap", "type": "record", "object": "Account"},
            {"name": "label", "type": "string", "input": True},
            {"name": "n", "type": "number", "input": True},
        ],
        "start": "bump1",
        "elements": [
            {
                "api_name": "bump1",
                "type": "CreateRecord",
                "object": "Account",
                "fields": {"Name": "label", "Status": "'s1'"},
                "output_variable": "acct",
                "next": "load",
            },
            {
                "api_name": "load",
                "type": "GetRecords",
                "object": "Account",
                "first_only": True,
                "read_mode": "snapshot",
                "filters": [{"field": "Id", "op": "=", "value": "acct.Id"}],
                "output_variable": "snap",
                "next": "calc",
            },
            {
                "api_name": "calc",
                "type": "Assignment",
                "assignments": [{"target": "n", "op": "set", "value": "n + 1"}],
                "next": "upd",
            },
            {
                "api_name": "upd",
                "type": "UpdateRecord",
                "object": "Account",
                "record": "snap",
                "fields": {"Status": "'s2'"},
            },
        ],
    }


async def _seed(engine: AsyncEngine) -> Seeded:
    seeded = await seed(engine, source=snapshot_source())
    assert seeded.plan.step("load").kind is StepKind.VERIFIED_SNAPSHOT_READ
    assert seeded.plan.step("upd").verifies == ("load",)
    return seeded


async def _step_key(engine: AsyncEngine, seeded: Seeded, fence: LeaseFence) -> str:
    [step] = await rows(
        engine,
        flow_step_executions,
        org_id=seeded.org,
        step_execution_id=fence.step_execution_id,
    )
    return str(step["plan_step_key"])


async def _verification_sets(engine: AsyncEngine, org: str, run_id: str) -> list[Any]:
    found = await rows(engine, flow_checkpoints, org_id=org, flow_run_id=run_id)
    found.sort(key=lambda r: r["sequence"])
    return [
        None if r["read_verification_set"] is None else json.loads(r["read_verification_set"])
        for r in found
    ]


async def test_unchanged_snapshot_commits_and_tokens_travel_in_checkpoints(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await _seed(engine)
    run = await start_run(store, seeded)
    worker = make_worker(engine, store)
    assert (await drive(worker, seeded.org, run.flow_run_id)).state is RunState.SUCCEEDED
    [account] = await run_records(engine, seeded.org)
    assert account["record_version"] == 2
    assert json.loads(account["fields"])["Status"] == "s2"
    token = {"object": "Account", "id": account["record_id"]}
    # input, bump1, load (snapshot taken), calc (carried), upd (own write refreshed).
    assert await _verification_sets(engine, seeded.org, run.flow_run_id) == [
        None,
        None,
        {"format": 1, "snapshots": {"load": [{**token, "version": 1}]}},
        {"format": 1, "snapshots": {"load": [{**token, "version": 1}]}},
        {"format": 1, "snapshots": {"load": [{**token, "version": 2}]}},
    ]
    assert (await step_counts(engine, seeded.org, run.flow_run_id, "upd")).committed_attempts == 1


@pytest.mark.parametrize("change", ["version", "deleted"])
async def test_changed_snapshot_rolls_the_mutation_back_and_fails_the_run(
    engine: AsyncEngine, store: FlowRunStateStore, change: str
) -> None:
    seeded = await _seed(engine)
    run = await start_run(store, seeded)
    changed: list[str] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        # Between the snapshot and the verifying mutation: another writer changes the
        # record (a committed concurrent update, or a delete).
        if at != "compute" or changed or await _step_key(engine, seeded, fence) != "calc":
            return
        r = records.c
        values: dict[str, Any] = {"record_version": r.record_version + 1}
        if change == "deleted":
            values["is_deleted"] = True
        async with db.transaction(engine) as c:
            await c.execute(update(records).where(r.org_id == seeded.org).values(**values))
        changed.append(change)

    worker = make_worker(engine, store, hook=hook)
    final = await drive(worker, seeded.org, run.flow_run_id)
    assert changed == [change]
    assert final.state is RunState.TERMINAL_FAILED
    assert final.terminal_cause_code == SNAPSHOT_CHANGED  # the step's safe code
    [account] = await run_records(engine, seeded.org)
    assert account["record_version"] == 2  # only the external change
    assert json.loads(account["fields"])["Status"] == "s1"  # the mutation wrote nothing
    counts = await step_counts(engine, seeded.org, run.flow_run_id, "upd")
    assert counts.step_rows == 1
    assert counts.committed_attempts == 0
    assert counts.business_events == 0
    assert counts.audit_records == 0
    [upd] = await rows(
        engine,
        flow_step_executions,
        org_id=seeded.org,
        flow_run_id=run.flow_run_id,
        plan_step_key="upd",
    )
    attempts = await rows(
        engine, flow_step_attempts, org_id=seeded.org, step_execution_id=upd["step_execution_id"]
    )
    # Bounded: one rolled-back attempt, no retry from the same (stale) checkpoint.
    assert [a["transaction_outcome"] for a in attempts] == ["RolledBack"]
    assert [a["safe_error_code"] for a in attempts] == [SNAPSHOT_CHANGED]
    assert [a["failure_class"] for a in attempts] == ["Terminal"]
    # Only bump1's create event exists.
    assert len(await rows(engine, business_events, org_id=seeded.org)) == 1


async def test_a_worker_outcome_for_the_changed_snapshot_is_failed(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    """The step-level outcome of a failed verification: ``FAILED`` in one process call."""
    seeded = await _seed(engine)
    run = await start_run(store, seeded)
    worker = make_worker(engine, store, continuation_limit=0)  # one step per batch
    outcomes: list[Outcome] = []
    for _ in range(3):  # bump1, load, calc
        outcomes.extend(await worker.run_batch(seeded.org))
    assert outcomes == [Outcome.COMMITTED] * 3
    r = records.c
    async with db.transaction(engine) as c:
        await c.execute(
            update(records)
            .where(r.org_id == seeded.org)
            .values(record_version=r.record_version + 1)
        )
    assert await worker.run_batch(seeded.org) == [Outcome.FAILED]
    final = await store.get_run(seeded.org, run.flow_run_id)
    assert final.state is RunState.TERMINAL_FAILED
