"""A Bounded Atomic step whose COMMIT outcome is unknown is never retried (§13.4):

* the connection drops during ``COMMIT`` (MariaDB: the server really kills the session as
  the driver sends ``COMMIT``, so the transaction rolls back server-side; SQLite: the
  driver's lost-connection error is raised where ``COMMIT`` would run) → the attempt is
  ``CommitUnknown``, the run ``Quarantined``, no business write, no second attempt;
* the COMMIT was durable but its response was lost (the ``after_step_commit`` fault hook)
  → the kernel finds the attempt's commit marker: the run stays ``Succeeded`` with one
  set of writes, again without a second attempt.
"""

from __future__ import annotations

from typing import Any

import pymysql
from sqlalchemy import event, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, LeaseFence, RunState
from runtime_svc.worker import Outcome, StepWorker
from runtime_svc.worker.views import FixedViews
from services.faults import CrashPoint, connection_lost_after_commit
from tests.integration.atomic.support import (
    ATOMIC_STEP,
    business_rows,
    evidence,
    make_runner,
    make_service,
    seed_atomic,
    seed_business,
)
from tests.integration.worker.support import record_view


def _drop_connection_at_commit(engine: AsyncEngine, server_thread_id: int | None) -> Any:
    """A one-shot ``commit`` listener: the connection is lost as COMMIT is sent."""

    def on_commit(sync_conn: Connection) -> None:
        if server_thread_id is None:
            # SQLite has no server to lose: discard the connection (its open transaction
            # rolls back with it, as a killed server session's does) and raise what the
            # driver raises for a COMMIT whose connection was lost.
            sync_conn.invalidate()
            raise pymysql.err.OperationalError(2013, "Lost connection to server during query")
        url = make_url(engine.url)
        admin = pymysql.connect(
            host=url.host or "127.0.0.1",
            port=url.port or 3306,
            user=url.username or "root",
            password=url.password or "",
            autocommit=True,
        )
        try:
            with admin.cursor() as cursor:
                cursor.execute(f"KILL CONNECTION {int(server_thread_id)}")
        finally:
            admin.close()

    return on_commit


async def test_connection_dropped_during_commit_quarantines_the_run_without_retry(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed_atomic(engine)
    biz = await seed_business(engine, seeded.org)
    before = await business_rows(engine, seeded.org)
    armed: list[bool] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at != "in_txn" or armed or conn is None:
            return
        armed.append(True)
        thread_id = None
        if engine.dialect.name != "sqlite":
            thread_id = int((await conn.execute(text("SELECT CONNECTION_ID()"))).scalar_one())
        event.listen(
            conn.sync_connection, "commit", _drop_connection_at_commit(engine, thread_id), once=True
        )

    runner = make_runner(engine, store, hook=hook)
    service = make_service(engine, store, runner, budget_s=5.0)
    outcome = await service.start_run(
        seeded.scope, seeded.plan_id, {"oppId": biz.opp_id, "lineId": biz.line_id, "label": "x"}
    )
    assert armed == [True]
    assert outcome.completed
    run = outcome.view.run
    assert run.state is RunState.QUARANTINED
    assert outcome.view.output_variables is None
    assert runner.outcomes == [Outcome.QUARANTINED]

    # Never retried: neither the synchronous runner nor a background worker of the
    # Bounded Atomic lane finds anything to claim, now or later.
    again = await runner.run(seeded.org, run.flow_run_id, 0.2)
    assert again.state is RunState.QUARANTINED
    assert runner.outcomes == [Outcome.QUARANTINED]
    assert await store.candidate_for_run(seeded.org, run.flow_run_id) is None
    background = StepWorker(
        engine,
        store,
        FixedViews(record_view()),
        owner="bg",
        queue_classes=("bounded_atomic_foreground",),
    )
    assert await background.run_batch(seeded.org) == []

    ev = await evidence(engine, seeded.org, run.flow_run_id)
    [step] = ev.step_rows
    assert (step["plan_step_key"], step["state"]) == (ATOMIC_STEP, "Quarantined")
    [attempt] = ev.attempts
    assert attempt["transaction_outcome"] == "CommitUnknown"
    # The transaction did not commit: no business row, event, audit or final checkpoint.
    assert await business_rows(engine, seeded.org) == before
    assert ev.event_attempts == [] and ev.audit_count == 0
    assert [c["checkpoint_id"] for c in ev.checkpoints] == [step["input_checkpoint_id"]]


async def test_lost_commit_response_after_a_durable_commit_is_not_repeated(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed_atomic(engine)
    biz = await seed_business(engine, seeded.org)
    runner = make_runner(engine, store)
    service = make_service(engine, store, runner, budget_s=5.0)
    with connection_lost_after_commit(CrashPoint.AFTER_STEP_COMMIT, ATOMIC_STEP):
        outcome = await service.start_run(
            seeded.scope,
            seeded.plan_id,
            {"oppId": biz.opp_id, "lineId": biz.line_id, "label": "y"},
        )
    assert outcome.completed
    run = outcome.view.run
    assert run.state is RunState.SUCCEEDED
    assert runner.outcomes == [Outcome.ALREADY_COMMITTED]
    ev = await evidence(engine, seeded.org, run.flow_run_id)
    [attempt] = ev.attempts
    assert attempt["transaction_outcome"] == "Committed"
    assert sorted(ev.event_attempts) == [attempt["attempt_id"]] * 3
    rows = await business_rows(engine, seeded.org)
    assert [r["version"] for r in rows["OpportunityLineItem"]] == [2]
    assert len(rows["Task"]) == 1
