"""Declared resource bounds (§13.3, §22.3), on SQLite and MariaDB: a mutation step's actual
resource set is checked against its plan step's declarations before any business lock.
Within the bound the step commits (and a late discovery within the bound rolls the whole
step back and retries once from the same input checkpoint); beyond the declared class or
bound the step rolls back with nothing written and the run ends ``TerminalFailed`` with
``resource_bound_exceeded`` after exactly one attempt, never retried."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import (
    CheckpointInput,
    FirstStep,
    FlowRunStateStore,
    RunRecord,
    RunState,
    StartRunRequest,
)
from runtime_svc.records import (
    Actor,
    RecordEngine,
    acquire_locks_txn,
    new_record_id,
    prepare_create,
)
from runtime_svc.resources import LateResourceDiscoveryError, LockRole, business_key
from runtime_svc.schema import business_events, flow_step_attempts, flow_step_executions
from runtime_svc.worker import RESOURCE_BOUND_EXCEEDED, Outcome
from tests.integration.kernel.conftest import ShiftedClock
from tests.integration.kernel.helpers import rows
from tests.integration.worker.support import (
    Seeded,
    drive,
    make_worker,
    record_view,
    run_records,
    seed,
    step_counts,
)

#: The collection's declared ``max_items``: the step's declared Account record bound.
MAX_ITEMS = 2


def bulk_source() -> dict[str, Any]:
    """One durable step updating every Account of an input collection (``max_items`` 2)."""
    return {
        "api_name": "worker_bulk_update",
        "version": 1,
        "description": "worker test Flow: a bounded collection update",
        "process_type": "autolaunched",
        "variables": [
            {
                "name": "accts",
                "type": "record",
                "object": "Account",
                "collection": True,
                "input": True,
                "max_items": MAX_ITEMS,
            },
        ],
        "start": "upd",
        "elements": [
            {
                "api_name": "upd",
                "type": "UpdateRecord",
                "object": "Account",
                "record": "accts",
                "fields": {"Status": "'bulk'"},
            },
        ],
    }


async def _seed(engine: AsyncEngine) -> Seeded:
    seeded = await seed(engine, source=bulk_source())
    [decl] = seeded.plan.step("upd").resources
    assert (decl.resource_class, decl.object, decl.bound) == ("record", "Account", MAX_ITEMS)
    return seeded


async def _accounts(engine: AsyncEngine, org: str, n: int) -> list[str]:
    view, rec = record_view(), RecordEngine(engine)
    ids = [new_record_id() for _ in range(n)]
    for i, rid in enumerate(ids):
        mutation = prepare_create(view, "Account", rid, {"Name": f"acct {i}", "Status": "s0"})
        await rec.mutate(org, view, mutation, actor=Actor("user", "seed"))
    return ids


async def _start(store: FlowRunStateStore, seeded: Seeded, ids: list[str]) -> RunRecord:
    step = seeded.plan.step(seeded.plan.start_step)
    result = await store.create_run(
        seeded.scope,
        StartRunRequest(
            plan_id=seeded.plan_id,
            first_step=FirstStep(step.key, step.kind.value, "durable_mutation"),
            input=CheckpointInput(context={"variables": {"accts": [{"Id": rid} for rid in ids]}}),
        ),
    )
    return result.run


async def _attempts(engine: AsyncEngine, seeded: Seeded, run_id: str) -> list[dict[str, Any]]:
    [upd] = await rows(
        engine, flow_step_executions, org_id=seeded.org, flow_run_id=run_id, plan_step_key="upd"
    )
    found = await rows(
        engine, flow_step_attempts, org_id=seeded.org, step_execution_id=upd["step_execution_id"]
    )
    return sorted(found, key=lambda a: str(a["attempt_id"]))


async def _statuses(engine: AsyncEngine, org: str) -> dict[str, tuple[str, int]]:
    return {
        str(r["record_id"]): (json.loads(r["fields"])["Status"], int(r["record_version"]))
        for r in await run_records(engine, org)
    }


async def _assert_terminal_nothing_written(
    engine: AsyncEngine, seeded: Seeded, run: RunRecord, ids: list[str]
) -> None:
    assert run.state is RunState.TERMINAL_FAILED
    assert run.terminal_cause_code == RESOURCE_BOUND_EXCEEDED  # the step's safe code
    assert await _statuses(engine, seeded.org) == {rid: ("s0", 1) for rid in ids}
    counts = await step_counts(engine, seeded.org, run.flow_run_id, "upd")
    assert (counts.step_rows, counts.committed_attempts) == (1, 0)
    assert (counts.business_events, counts.audit_records) == (0, 0)
    attempts = await _attempts(engine, seeded, run.flow_run_id)
    assert [a["transaction_outcome"] for a in attempts] == ["RolledBack"]
    assert [a["safe_error_code"] for a in attempts] == [RESOURCE_BOUND_EXCEEDED]
    assert [a["failure_class"] for a in attempts] == ["Terminal"]
    # Only the seeding creates exist.
    assert len(await rows(engine, business_events, org_id=seeded.org)) == len(ids)


async def test_step_within_its_declared_bound_commits(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await _seed(engine)
    ids = await _accounts(engine, seeded.org, MAX_ITEMS)
    run = await _start(store, seeded, ids)
    worker = make_worker(engine, store)
    assert await worker.run_batch(seeded.org) == [Outcome.COMMITTED]
    final = await drive(worker, seeded.org, run.flow_run_id)
    assert final.state is RunState.SUCCEEDED
    assert await _statuses(engine, seeded.org) == {rid: ("bulk", 2) for rid in ids}
    counts = await step_counts(engine, seeded.org, run.flow_run_id, "upd")
    assert (counts.step_rows, counts.committed_attempts) == (1, 1)
    assert (counts.business_events, counts.audit_records) == (MAX_ITEMS, MAX_ITEMS)


async def test_mutation_count_above_the_declared_bound_fails_terminally_without_retry(
    engine: AsyncEngine, store: FlowRunStateStore, clock: ShiftedClock
) -> None:
    seeded = await _seed(engine)
    ids = await _accounts(engine, seeded.org, MAX_ITEMS + 1)  # more rows than declared
    run = await _start(store, seeded, ids)
    worker = make_worker(engine, store)
    assert await worker.run_batch(seeded.org) == [Outcome.FAILED]
    clock.advance(hours=2)  # a retry, if one had been scheduled, would now be due
    assert await worker.run_batch(seeded.org) == []
    final = await store.get_run(seeded.org, run.flow_run_id)
    await _assert_terminal_nothing_written(engine, seeded, final, ids)


@pytest.fixture
def inject_late_discovery(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The first lock acquisition discovers the Account whose id is appended to the
    returned list (a row found only under lock); later acquisitions proceed."""
    discovered: list[str] = []
    fired: list[int] = []
    real = acquire_locks_txn

    async def acquire(conn: AsyncConnection, *args: Any, **kw: Any) -> Any:
        if discovered and not fired:
            fired.append(1)
            raise LateResourceDiscoveryError(
                business_key("Account", discovered[0]), LockRole.RECORD
            )
        return await real(conn, *args, **kw)

    monkeypatch.setattr("runtime_svc.worker.executor.acquire_locks_txn", acquire)
    return discovered


async def test_late_discovery_within_the_bound_retries_once_and_commits_once(
    engine: AsyncEngine,
    store: FlowRunStateStore,
    clock: ShiftedClock,
    inject_late_discovery: list[str],
) -> None:
    seeded = await _seed(engine)
    ids = await _accounts(engine, seeded.org, MAX_ITEMS - 1)
    inject_late_discovery.append("acc-discovered")  # plan 1 + discovered 1 <= bound 2
    run = await _start(store, seeded, ids)
    worker = make_worker(engine, store)
    assert await worker.run_batch(seeded.org) == [Outcome.RETRY_SCHEDULED]
    assert await _statuses(engine, seeded.org) == {rid: ("s0", 1) for rid in ids}
    clock.advance(hours=1)
    final = await drive(worker, seeded.org, run.flow_run_id)
    assert final.state is RunState.SUCCEEDED
    assert await _statuses(engine, seeded.org) == {rid: ("bulk", 2) for rid in ids}
    counts = await step_counts(engine, seeded.org, run.flow_run_id, "upd")
    assert (counts.step_rows, counts.committed_attempts) == (1, 1)
    assert (counts.business_events, counts.audit_records) == (len(ids), len(ids))
    attempts = await _attempts(engine, seeded, run.flow_run_id)
    assert sorted(a["transaction_outcome"] for a in attempts) == ["Committed", "RolledBack"]
    assert [a["safe_error_code"] for a in attempts if a["transaction_outcome"] == "RolledBack"] == [
        "late_resource_discovery"
    ]
    # §13.3 steps 1 and 4 (V22.3-04): the rolled-back attempt records the safe resource
    # class mismatch and the expanded plan (within the declared bound) the retry runs
    # under; the committed retry records the lock plan it committed with.
    (rolled,) = [a for a in attempts if a["transaction_outcome"] == "RolledBack"]
    (committed,) = [a for a in attempts if a["transaction_outcome"] == "Committed"]
    evidence = json.loads(rolled["metrics_summary"])
    assert evidence["late_discovery"] == {"resource_class": "BUSINESS_RECORD", "role": "record"}
    assert evidence["expanded_lock_plan_digest"].startswith("lock-plan/")
    final_plan = json.loads(committed["metrics_summary"])
    assert final_plan["lock_plan_digest"].startswith("lock-plan/")
    # The expanded plan is the admitted plan (the one the retry committed with: the same
    # reads) plus the discovered resource.
    assert evidence["expanded_lock_plan_keys"] == final_plan["lock_plan_keys"] + 1
    assert "acc-discovered" not in rolled["metrics_summary"]  # safe codes, no record ids


async def test_late_discovery_beyond_the_bound_fails_terminally_without_retry(
    engine: AsyncEngine,
    store: FlowRunStateStore,
    clock: ShiftedClock,
    inject_late_discovery: list[str],
) -> None:
    seeded = await _seed(engine)
    ids = await _accounts(engine, seeded.org, MAX_ITEMS)
    inject_late_discovery.append("acc-discovered")  # plan 2 + discovered 1 > bound 2
    run = await _start(store, seeded, ids)
    worker = make_worker(engine, store)
    assert await worker.run_batch(seeded.org) == [Outcome.FAILED]
    clock.advance(hours=2)
    assert await worker.run_batch(seeded.org) == []
    final = await store.get_run(seeded.org, run.flow_run_id)
    await _assert_terminal_nothing_written(engine, seeded, final, ids)
