"""A Bounded Atomic step whose COMMIT outcome is unknown is never retried (§13.4):

* the connection drops during ``COMMIT`` (MariaDB: the server really kills the session as
  the driver sends the round trip that carries the ``COMMIT`` — the step's last writes,
  ADR 0014 — so the transaction rolls back server-side; SQLite: the driver's
  lost-connection error is raised where ``COMMIT`` would run) → the attempt is
  ``CommitUnknown``, the run ``Quarantined``, no business write, no second attempt;
* the COMMIT was durable but its response was lost (the ``after_step_commit`` fault hook)
  → the kernel finds the attempt's commit marker: the run stays ``Succeeded`` with one
  set of writes, again without a second attempt.
"""

from __future__ import annotations

from typing import Any

import pymysql
from sqlalchemy import event, text
from sqlalchemy.engine import Connection
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
from tests.support.databases import kill_session


def _drop_connection_at_commit(sync_conn: Connection) -> None:
    """SQLite: a one-shot ``commit`` listener — the driver's lost-connection error is raised
    where ``COMMIT`` would run (its open transaction discarded with the connection, as a
    killed server session's is rolled back)."""

    def on_commit(conn: Connection) -> None:
        conn.invalidate()
        raise pymysql.err.OperationalError(2013, "Lost connection to server during query")

    event.listen(sync_conn, "commit", on_commit, once=True)


def _kill_session_as_commit_is_sent(
    sync_conn: Connection, engine: AsyncEngine, thread: int
) -> None:
    """MariaDB: the step's last writes carry its ``COMMIT`` (ADR 0014) — the server
    session is killed as that round trip is about to be sent, so the connection is lost
    during it and the transaction rolls back server-side."""
    fired: list[bool] = []

    def before(_c: Connection, _cur: Any, statement: str, *_: Any) -> None:
        if fired or not statement.endswith(";\nCOMMIT"):
            return
        fired.append(True)
        kill_session(engine.url.render_as_string(hide_password=False), thread)

    event.listen(sync_conn, "before_cursor_execute", before)


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
        sync = conn.sync_connection
        assert sync is not None
        if engine.dialect.name == "sqlite":
            _drop_connection_at_commit(sync)
        else:
            thread_id = int((await conn.execute(text("SELECT CONNECTION_ID()"))).scalar_one())
            _kill_session_as_commit_is_sent(sync, engine, thread_id)

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
