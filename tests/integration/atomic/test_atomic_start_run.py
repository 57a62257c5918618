"""StartRun of a Bounded Atomic Flow (§9.2, §18.3) executes the run's one logical
mutation step synchronously and answers with the terminal state: the business writes,
their history/event/audit rows, the final checkpoint and the terminal root state were
committed by ONE transaction (one attempt, one step row), on SQLite and MariaDB."""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, LeaseFence, RunState
from runtime_svc.worker import Outcome
from tests.integration.atomic.support import (
    ATOMIC_STEP,
    business_rows,
    checkpoint_context,
    evidence,
    make_runner,
    make_service,
    seed_atomic,
    seed_business,
)


async def test_start_run_returns_the_terminal_state_committed_in_one_transaction(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed_atomic(engine)
    biz = await seed_business(engine, seeded.org)
    before = await business_rows(engine, seeded.org)
    seen_in_txn: list[dict[str, Any]] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        # Inside the business transaction, after every record write and before the
        # lifecycle commit: another connection sees neither the writes nor a terminal run.
        if at == "in_txn":
            run = await store.get_run(seeded.org, fence.flow_run_id)
            seen_in_txn.append(
                {"state": run.state, "rows": await business_rows(engine, seeded.org)}
            )

    runner = make_runner(engine, store, hook=hook)
    service = make_service(engine, store, runner)
    outcome = await service.start_run(
        seeded.scope,
        seeded.plan_id,
        {"oppId": biz.opp_id, "lineId": biz.line_id, "label": "won"},
    )

    # The terminal state, synchronously, with the declared output variable only.
    assert outcome.completed and not outcome.existing_run
    run = outcome.view.run
    assert run.state is RunState.SUCCEEDED
    assert runner.outcomes == [Outcome.COMMITTED]
    # The answer is the root the commit wrote (not read back): exactly the stored row.
    assert run == await store.get_run(seeded.org, run.flow_run_id, include_deleted=True)
    assert outcome.view.output_variables is not None
    assert set(outcome.view.output_variables) == {"task"}
    task = outcome.view.output_variables["task"]
    assert task["Subject"] == "won" and task["WhatId"] == biz.opp_id

    # Business writes: exactly one set.
    after = await business_rows(engine, seeded.org)
    [line] = after["OpportunityLineItem"]
    [opp] = after["Opportunity"]
    [created] = after["Task"]
    assert (line["version"], line["fields"]["Quantity"]) == (2, 2)
    assert (opp["version"], opp["fields"]["Description"], opp["fields"]["LineTotal"]) == (
        2,
        "won",
        2,
    )
    assert created["record_id"] == task["Id"] and created["version"] == 1

    # Nothing was visible before the commit: not the writes, not a terminal root.
    assert len(seen_in_txn) == 1
    assert seen_in_txn[0]["state"] is RunState.RUNNING
    assert seen_in_txn[0]["rows"] == before

    # Root, ONE step, ONE committed attempt; every business event and the final
    # checkpoint were written by that attempt (the same transaction).
    ev = await evidence(engine, seeded.org, run.flow_run_id)
    [step] = ev.step_rows
    assert step["plan_step_key"] == ATOMIC_STEP and step["state"] == "Succeeded"
    assert step["queue_class"] == "bounded_atomic_foreground"
    [attempt] = ev.attempts
    assert attempt["transaction_outcome"] == "Committed"
    assert sorted(ev.event_attempts) == [attempt["attempt_id"]] * 3
    assert ev.audit_count == 3
    input_cp, final_cp = ev.checkpoints
    assert input_cp["checkpoint_id"] == step["input_checkpoint_id"]
    assert final_cp["checkpoint_id"] == run.current_checkpoint_id == step["output_checkpoint_id"]
    assert final_cp["created_by_attempt_id"] == attempt["attempt_id"]
    ctx = await checkpoint_context(engine, seeded.org, final_cp["checkpoint_id"])
    assert ctx["variables"]["task"]["Id"] == task["Id"]

    # A later read answers the same terminal run and outputs.
    again = await service.get_run(seeded.org, run.flow_run_id)
    assert again.run.state is RunState.SUCCEEDED
    assert again.output_variables == outcome.view.output_variables
