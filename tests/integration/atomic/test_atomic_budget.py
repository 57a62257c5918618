"""Compiled budgets of a Bounded Atomic step are enforced at runtime (§9.2): a Flow
compiled against a relationship declared to have at most 2 children, which at runtime
finds more, fails closed — terminally, the exceeded bound named in the run's cause code,
nothing written, never retried — while the same Flow within its bound succeeds."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, RunState
from runtime_svc.records import RecordEngine, prepare_create
from runtime_svc.worker import Outcome
from tests.integration.atomic.support import (
    SEED_ACTOR,
    business_rows,
    evidence,
    make_runner,
    make_service,
    seed_atomic,
)
from tests.integration.worker.support import record_view
from tests.unit.compiler.compiler_corpus import inputs_doc

#: The metadata bound the Flow is compiled against (the shared view says 200).
MAX_CONTACTS = 2


def retitle_flow() -> dict[str, Any]:
    """GetRecords Contact by the Account lookup → Loop → UpdateRecord per contact."""
    return {
        "api_name": "atomic_retitle_contacts",
        "version": 1,
        "description": "atomic test Flow: metadata-bounded child loop",
        "process_type": "autolaunched",
        "variables": [
            {"name": "acctId", "type": "string", "input": True},
            {"name": "contacts", "type": "record", "object": "Contact", "collection": True},
            {"name": "c", "type": "record", "object": "Contact"},
            {"name": "touched", "type": "number", "output": True},
        ],
        "start": "get_contacts",
        "elements": [
            {
                "api_name": "get_contacts",
                "type": "GetRecords",
                "object": "Contact",
                "read_mode": "current",
                "filters": [{"field": "AccountId", "op": "=", "value": "acctId"}],
                "output_variable": "contacts",
                "next": "each",
            },
            {
                "api_name": "each",
                "type": "Loop",
                "collection": "contacts",
                "item_variable": "c",
                "each": "retitle",
            },
            {
                "api_name": "retitle",
                "type": "UpdateRecord",
                "object": "Contact",
                "record": "c",
                "fields": {"Title": "'VIP'"},
                "next": "count",
            },
            {
                "api_name": "count",
                "type": "Assignment",
                "assignments": [{"target": "touched", "op": "add", "value": "1"}],
                "next": "each",
            },
        ],
    }


def small_view_patch() -> dict[str, Any]:
    relationships = [
        dict(r, max_children=MAX_CONTACTS) if r["name"] == "Account_Contacts" else r
        for r in inputs_doc()["metadata_view"]["relationships"]
    ]
    return {"metadata_view": {"relationships": relationships}}


async def _account_with_contacts(engine: AsyncEngine, org: str, contacts: int) -> str:
    records = RecordEngine(engine)
    view = record_view()
    account = await records.mutate(
        org, view, prepare_create(view, "Account", "", {"Name": "Acme"}), actor=SEED_ACTOR
    )
    acct_id = account.record.record_id
    for i in range(contacts):
        await records.mutate(
            org,
            view,
            prepare_create(
                view, "Contact", "", {"LastName": f"c{i}", "AccountId": acct_id, "Title": "t"}
            ),
            actor=SEED_ACTOR,
        )
    return acct_id


@pytest.mark.parametrize("contacts", [MAX_CONTACTS, MAX_CONTACTS + 3], ids=["within", "over"])
async def test_runtime_children_beyond_the_compiled_bound_fail_the_run_closed(
    engine: AsyncEngine, store: FlowRunStateStore, contacts: int
) -> None:
    seeded = await seed_atomic(engine, retitle_flow(), patch=small_view_patch())
    bounds = seeded.plan.step(seeded.plan.start_step).bounds
    assert (bounds.max_reads, bounds.max_writes) == (MAX_CONTACTS, MAX_CONTACTS)
    acct_id = await _account_with_contacts(engine, seeded.org, contacts)
    before = await business_rows(engine, seeded.org)
    runner = make_runner(engine, store)
    service = make_service(engine, store, runner, budget_s=5.0)

    outcome = await service.start_run(seeded.scope, seeded.plan_id, {"acctId": acct_id})

    assert outcome.completed
    run = outcome.view.run
    ev = await evidence(engine, seeded.org, run.flow_run_id)
    after = await business_rows(engine, seeded.org)
    if contacts <= MAX_CONTACTS:
        assert run.state is RunState.SUCCEEDED
        assert outcome.view.output_variables == {"touched": contacts}
        assert [c["fields"]["Title"] for c in after["Contact"]] == ["VIP"] * contacts
        return
    # Over the bound: terminal, the bound named in the run's cause (what StartRun
    # returns) and on the attempt, one attempt, nothing written.
    assert run.state is RunState.TERMINAL_FAILED
    assert run.terminal_cause_code == "budget_exceeded.max_reads"
    assert outcome.view.output_variables is None
    assert runner.outcomes == [Outcome.FAILED]
    [attempt] = ev.attempts
    assert attempt["transaction_outcome"] == "RolledBack"
    assert attempt["failure_class"] == "Terminal"
    assert attempt["safe_error_code"] == "budget_exceeded.max_reads"
    assert after == before
    assert ev.event_attempts == [] and ev.audit_count == 0
    # Never retried.
    assert await store.candidate_for_run(seeded.org, run.flow_run_id) is None
    assert (await runner.run(seeded.org, run.flow_run_id, 0.2)).state is RunState.TERMINAL_FAILED
    assert runner.outcomes == [Outcome.FAILED]
