"""Bounded Atomic steps under real MariaDB lock contention (§13.1, §13.4):

* a genuine deadlock cycle between the step's business transaction and another session
  makes the step the victim: the whole step rolls back and is retried — durably, from
  the same input checkpoint — by the synchronous runner, and the run succeeds with
  exactly one set of business writes;
* a business lock held by another session past the step connection's lock-wait timeout
  does the same;
* concurrent Bounded Atomic runs and ordinary record writes that touch the same parent /
  child rows in opposite element orders all finish without a single deadlock: every
  lock is taken in the one canonical order.

MariaDB only: SQLite has one writer at a time and no row locks.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, LeaseFence, RunRecord, RunState
from runtime_svc.records import RecordEngine, prepare_update
from runtime_svc.schema import records
from runtime_svc.worker import Outcome
from services import db
from tests.integration.atomic.support import (
    ATOMIC_POLICY,
    ATOMIC_STEP,
    SEED_ACTOR,
    AtomicSeeded,
    Business,
    business_rows,
    evidence,
    make_runner,
    make_service,
    seed_atomic,
    seed_business,
    touch_flow,
)
from tests.integration.worker.support import record_view

pytestmark = pytest.mark.parametrize("kernel_db_url", ["mariadb"], indirect=True)

#: Bounded polls (each ``_POLL_S``) for a state another session must reach.
_POLLS = 400
_POLL_S = 0.025
#: Rows the blocking session writes first, so that InnoDB (which rolls back the
#: transaction of least weight) picks the Flow step as the deadlock victim.
_BLOCKER_WEIGHT = 60


def _inputs(biz: Business, label: str) -> dict[str, Any]:
    return {"oppId": biz.opp_id, "lineId": biz.line_id, "label": label}


def _lock_sql(org: str, object_name: str, record_id: str) -> Any:
    return text(
        "SELECT record_version FROM records WHERE org_id = :org AND object_name = :obj "
        "AND record_id = :rid FOR UPDATE"
    ).bindparams(org=org, obj=object_name, rid=record_id)


async def _sessions_locking(engine: AsyncEngine, record_id: str) -> set[int]:
    """Server thread ids of the other sessions now running a ``FOR UPDATE`` of
    ``record_id`` (a session blocked on that row lock stays in its statement; the lock of a
    primary-key lookup is requested while the statement is optimised, so the
    PROCESSLIST — not ``INNODB_TRX``, which showed it unreliably — is what is read)."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT id FROM information_schema.PROCESSLIST "
                "WHERE db = DATABASE() AND command = 'Query' AND id <> CONNECTION_ID() "
                "AND info LIKE '%FOR UPDATE%' AND info LIKE :rid"
            ).bindparams(rid=f"%{record_id}%")
        )
        return {int(r[0]) for r in rows}


async def _wait_for(predicate: Any, what: str) -> None:
    for _ in range(_POLLS):
        if await predicate():
            return
        await asyncio.sleep(_POLL_S)
    raise AssertionError(f"timed out waiting for {what}")


@asynccontextmanager
async def _session(url: str) -> AsyncIterator[tuple[AsyncConnection, int]]:
    """Another client session (its own engine), inside a transaction; rolled back."""
    eng = db.create_engine(url, pool_size=1)
    try:
        async with eng.connect() as conn:
            await conn.begin()
            thread_id = int((await conn.execute(text("SELECT CONNECTION_ID()"))).scalar_one())
            try:
                yield conn, thread_id
            finally:
                await conn.rollback()
    finally:
        await eng.dispose()


async def _make_heavy(conn: AsyncConnection) -> None:
    junk = f"org-junk-{uuid.uuid4().hex[:8]}"
    now = datetime.now(UTC)
    await conn.execute(
        records.insert(),
        [
            {
                "org_id": junk,
                "object_name": "Account",
                "record_id": f"junk-{i:04d}",
                "record_version": 1,
                "fields": "{}",
                "is_deleted": False,
                "created_at": now,
                "updated_at": now,
            }
            for i in range(_BLOCKER_WEIGHT)
        ],
    )


async def _assert_retried_once_and_written_once(
    engine: AsyncEngine, seeded: AtomicSeeded, run: RunRecord, code: str
) -> None:
    assert run.state is RunState.SUCCEEDED
    ev = await evidence(engine, seeded.org, run.flow_run_id)
    [step] = ev.step_rows  # the retry is the same step, not a new one
    assert step["plan_step_key"] == ATOMIC_STEP and step["state"] == "Succeeded"
    first, second = ev.attempts
    assert (first["transaction_outcome"], first["safe_error_code"]) == ("RolledBack", code)
    assert first["failure_class"] == "Retryable"
    assert second["transaction_outcome"] == "Committed"
    # Whole-step retry from the same, immutable input checkpoint.
    assert first["input_checkpoint_id"] == second["input_checkpoint_id"]
    assert step["input_checkpoint_id"] == ev.checkpoints[0]["checkpoint_id"]
    assert [c["created_by_attempt_id"] for c in ev.checkpoints[1:]] == [second["attempt_id"]]
    # Nothing of the rolled-back attempt survived: every event is the retry's.
    assert sorted(ev.event_attempts) == [second["attempt_id"]] * 3
    assert ev.audit_count == 3
    rows = await business_rows(engine, seeded.org)
    [line] = rows["OpportunityLineItem"]
    [opp] = rows["Opportunity"]
    assert (line["version"], line["fields"]["Quantity"]) == (2, 2)
    assert opp["version"] == 2
    assert len(rows["Task"]) == 1


def _before_each_attempt(
    engine: AsyncEngine, org: str, seen: list[dict[str, list[dict[str, Any]]]]
) -> Any:
    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at == "executed":  # before each attempt's business transaction
            seen.append(await business_rows(engine, org))

    return hook


async def test_deadlock_victim_is_retried_whole_from_the_same_input_checkpoint(
    engine: AsyncEngine, store: FlowRunStateStore, kernel_db_url: str
) -> None:
    seeded = await seed_atomic(engine)
    biz = await seed_business(engine, seeded.org)
    before = await business_rows(engine, seeded.org)
    seen: list[dict[str, list[dict[str, Any]]]] = []
    runner = make_runner(engine, store, hook=_before_each_attempt(engine, seeded.org, seen))
    service = make_service(engine, store, runner)

    async with _session(kernel_db_url) as (blocker, blocker_thread):
        await _make_heavy(blocker)
        # The blocker holds the CHILD; the step locks parent-first (canonical order), so
        # it holds the Opportunity and waits for the line item.
        await blocker.execute(_lock_sql(seeded.org, "OpportunityLineItem", biz.line_id))
        start = asyncio.create_task(
            service.start_run(seeded.scope, seeded.plan_id, _inputs(biz, "dl"))
        )

        async def step_waits() -> bool:
            assert not start.done(), start
            return bool((await _sessions_locking(engine, biz.line_id)) - {blocker_thread})

        await _wait_for(step_waits, "the step to wait for the line item lock")
        # Close the cycle: the blocker now wants the parent the step holds. InnoDB
        # detects the deadlock and rolls back the lighter transaction: the step's.
        await asyncio.wait_for(
            blocker.execute(_lock_sql(seeded.org, "Opportunity", biz.opp_id)), 30
        )
    outcome = await asyncio.wait_for(start, 60)

    assert outcome.completed
    assert runner.outcomes == [Outcome.RETRY_SCHEDULED, Outcome.COMMITTED]
    # When the retry started, the victim had left no business row behind.
    assert seen == [before, before]
    await _assert_retried_once_and_written_once(engine, seeded, outcome.view.run, "deadlock")


async def test_lock_wait_timeout_is_retried_whole_from_the_same_input_checkpoint(
    engine: AsyncEngine, store: FlowRunStateStore, kernel_db_url: str
) -> None:
    seeded = await seed_atomic(engine)
    biz = await seed_business(engine, seeded.org)
    before = await business_rows(engine, seeded.org)
    # The step's business transactions run on connections that wait at most 1 s for a
    # row lock (production: services.db.LOCK_WAIT_TIMEOUT_S).
    step_engine = db.create_engine(kernel_db_url, pool_size=4)

    @event.listens_for(step_engine.sync_engine, "connect")
    def _short_lock_wait(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
        finally:
            cursor.close()

    try:
        seen: list[dict[str, list[dict[str, Any]]]] = []
        runner = make_runner(
            step_engine, store, hook=_before_each_attempt(engine, seeded.org, seen)
        )
        service = make_service(engine, store, runner)
        async with _session(kernel_db_url) as (holder, _):
            await holder.execute(_lock_sql(seeded.org, "Opportunity", biz.opp_id))
            start = asyncio.create_task(
                service.start_run(seeded.scope, seeded.plan_id, _inputs(biz, "lw"))
            )

            async def timed_out() -> bool:
                assert not start.done(), start
                return Outcome.RETRY_SCHEDULED in runner.outcomes

            # Held past the step's lock-wait timeout: its first attempt rolls back.
            await _wait_for(timed_out, "the step's lock-wait timeout")
        outcome = await asyncio.wait_for(start, 60)
    finally:
        await step_engine.dispose()

    assert outcome.completed
    assert runner.outcomes == [Outcome.RETRY_SCHEDULED, Outcome.COMMITTED]
    assert seen == [before, before]
    await _assert_retried_once_and_written_once(
        engine, seeded, outcome.view.run, "lock_wait_timeout"
    )


#: Concurrent Bounded Atomic runs of each Flow, and ordinary writes of each row.
_RUNS_EACH = 10
_ORDINARY_EACH = 10


async def _innodb_deadlocks(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        row = (await conn.execute(text("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'"))).one()
        return int(row[1])


async def test_concurrent_atomic_runs_and_ordinary_writes_never_deadlock(
    engine: AsyncEngine,
) -> None:
    # A step that waited for a row lock behind another writer of the same record fails
    # its version check (``write_conflict``) and is retried whole, by design; under this
    # much contention a run may need more than the default handful of attempts. Every
    # other rollback cause is a failure of this test.
    store = FlowRunStateStore(engine, policy=replace(ATOMIC_POLICY, max_attempts=40))
    child_first = await seed_atomic(engine, touch_flow("atomic_child_first"))
    org = child_first.org
    parent_first = await seed_atomic(
        engine, touch_flow("atomic_parent_first", parent_first=True), org_id=org
    )
    biz = await seed_business(engine, org)
    runner = make_runner(engine, store)
    service = make_service(engine, store, runner, budget_s=60.0)
    ordinary = RecordEngine(engine)
    view = record_view()
    deadlocks_before = await _innodb_deadlocks(engine)

    async def atomic(seeded: AtomicSeeded, i: int) -> RunRecord:
        outcome = await service.start_run(
            seeded.scope, seeded.plan_id, _inputs(biz, f"{seeded.plan.flow.api_name}-{i}")
        )
        return outcome.view.run

    async def write(object_name: str, record_id: str, fields: dict[str, Any]) -> None:
        # Ordinary writes: a parent update, and a lock-parent child update (which locks
        # the parent as well, in the same canonical order).
        mutation = prepare_update(view, object_name, record_id, None, fields)
        await ordinary.mutate(org, view, mutation, actor=SEED_ACTOR)

    jobs: list[Any] = []
    for i in range(max(_RUNS_EACH, _ORDINARY_EACH)):
        if i < _RUNS_EACH:
            jobs += [atomic(child_first, i), atomic(parent_first, i)]
        if i < _ORDINARY_EACH:
            jobs += [
                write("Opportunity", biz.opp_id, {"Priority": f"p{i}"}),
                write("OpportunityLineItem", biz.line_id, {"Discount": i}),
            ]
    results = await asyncio.wait_for(asyncio.gather(*jobs), 120)
    runs = [r for r in results if isinstance(r, RunRecord)]

    assert len(runs) == 2 * _RUNS_EACH
    assert {r.state for r in runs} == {RunState.SUCCEEDED}, [
        (r.flow_run_id, r.state, r.terminal_cause_code) for r in runs
    ]
    rollbacks: list[tuple[str, str | None]] = []
    for r in runs:
        for a in (await evidence(engine, org, r.flow_run_id)).attempts:
            if a["transaction_outcome"] != "Committed":
                rollbacks.append((a["transaction_outcome"], a["safe_error_code"]))
    # No deadlock victim, no lock-wait timeout: only version-check retries.
    assert set(rollbacks) <= {("RolledBack", "write_conflict")}, rollbacks
    assert ordinary.stats.conflict_retries == 0
    assert ordinary.stats.lock_wait_timeouts == 0
    assert await _innodb_deadlocks(engine) == deadlocks_before
    # Every write landed exactly once (versions are per committed write).
    rows = await business_rows(engine, org)
    [line] = rows["OpportunityLineItem"]
    [opp] = rows["Opportunity"]
    assert line["version"] == 1 + 2 * _RUNS_EACH + _ORDINARY_EACH
    assert opp["version"] == 1 + 2 * _RUNS_EACH + _ORDINARY_EACH
    assert len(rows["Task"]) == 2 * _RUNS_EACH
