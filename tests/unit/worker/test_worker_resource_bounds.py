"""The pure resource-bound check of a mutation step (§13.3) and the collection mutations
that can exceed it (no database)."""

from __future__ import annotations

from typing import Any

import pytest

from runtime_svc.compiler import CompilerInputs, ExecutionPlan, compile_plan
from runtime_svc.compiler.plan import ResourceDecl
from runtime_svc.resources import LockPlan, LockRole, business_key, history_key
from runtime_svc.worker import (
    RESOURCE_BOUND_EXCEEDED,
    MutationIntent,
    ResourceBoundExceeded,
    StepFault,
    check_resource_bounds,
    interpret,
)
from tests.unit.compiler.compiler_corpus import inputs_doc, merge_patch


def _records(obj: str, n: int, role: LockRole = LockRole.RECORD) -> LockPlan:
    entries = []
    for i in range(n):
        entries.append((business_key(obj, f"{obj}-{i}"), role))
        entries.append((history_key(obj, f"{obj}-{i}"), LockRole.HISTORY))
    return LockPlan.of(entries)


ACCOUNT_2 = ResourceDecl("record", "Account", None, "variable:accts", 2)


def test_within_the_declared_bound_passes() -> None:
    check_resource_bounds([ACCOUNT_2], _records("Account", 2))
    check_resource_bounds([ACCOUNT_2], _records("Account", 1))


def test_count_above_the_bound_is_refused() -> None:
    with pytest.raises(ResourceBoundExceeded) as caught:
        check_resource_bounds([ACCOUNT_2], _records("Account", 3))
    assert caught.value.code == RESOURCE_BOUND_EXCEEDED
    assert isinstance(caught.value, StepFault)  # the worker's terminal rollback path


def test_undeclared_object_or_class_is_refused() -> None:
    with pytest.raises(ResourceBoundExceeded, match="Contact"):
        check_resource_bounds([ACCOUNT_2], _records("Contact", 1))
    with pytest.raises(ResourceBoundExceeded, match="parent_record of Account"):
        check_resource_bounds([ACCOUNT_2], _records("Account", 1, LockRole.PARENT))
    with pytest.raises(ResourceBoundExceeded):
        check_resource_bounds([], _records("Account", 1))


def test_bounds_of_one_class_and_object_add_up_and_none_is_unbounded() -> None:
    created = ResourceDecl("record", "Account", None, "created", 1)
    check_resource_bounds([ACCOUNT_2, created], _records("Account", 3))
    with pytest.raises(ResourceBoundExceeded):
        check_resource_bounds([ACCOUNT_2, created], _records("Account", 4))
    unbounded = ResourceDecl("record", "Account", None, "query", None)
    check_resource_bounds([ACCOUNT_2, unbounded], _records("Account", 50))


def test_parent_rows_count_against_parent_record_declarations() -> None:
    decls = [
        ResourceDecl("record", "OpportunityLineItem", None, "variable:li", 1),
        ResourceDecl(
            "parent_record", "Opportunity", "Opportunity_LineItems", "field:OpportunityId", 1
        ),
    ]
    child = business_key("OpportunityLineItem", "li-1")
    plan = LockPlan.of(
        [(child, LockRole.RECORD), (business_key("Opportunity", "o-1"), LockRole.PARENT)]
    )
    check_resource_bounds(decls, plan)
    # A re-parenting locks both parents: two parent rows against a bound of one.
    wider = plan.union(LockPlan.of([(business_key("Opportunity", "o-2"), LockRole.PARENT)]))
    with pytest.raises(ResourceBoundExceeded, match="parent_record"):
        check_resource_bounds(decls, wider)


def _plan(max_items: int) -> ExecutionPlan:
    doc = merge_patch(inputs_doc(), {"policy": {"version": 9, "bounded_atomic": {"max_writes": 0}}})
    flow: dict[str, Any] = {
        "api_name": "unit_bulk",
        "version": 1,
        "description": "worker unit test",
        "process_type": "autolaunched",
        "variables": [
            {
                "name": "accts",
                "type": "record",
                "object": "Account",
                "collection": True,
                "input": True,
                "max_items": max_items,
            }
        ],
        "start": "upd",
        "elements": [
            {
                "api_name": "upd",
                "type": "UpdateRecord",
                "object": "Account",
                "record": "accts",
                "fields": {"Status": "'bulk'"},
                "next": "del",
            },
            {"api_name": "del", "type": "DeleteRecord", "object": "Account", "record": "accts"},
        ],
    }
    return compile_plan(flow, CompilerInputs.from_dict(doc))


async def test_collection_update_and_delete_produce_one_intent_per_distinct_record() -> None:
    plan = _plan(2)
    context = {"variables": {"accts": [{"Id": "a1"}, {"Id": "a2"}, {"Id": "a1"}]}}
    upd = await interpret(plan, plan.step("upd"), context)
    assert upd.intents == (
        MutationIntent("update", "Account", "a1", {"Status": "bulk"}),
        MutationIntent("update", "Account", "a2", {"Status": "bulk"}),
    )
    dele = await interpret(plan, plan.step("del"), context)
    assert dele.intents == (
        MutationIntent("delete", "Account", "a1"),
        MutationIntent("delete", "Account", "a2"),
    )
    with pytest.raises(StepFault) as caught:
        await interpret(
            plan, plan.step("upd"), {"variables": {"accts": [{"Id": "a1"}, {"Name": "x"}]}}
        )
    assert caught.value.code == "missing_record_id"
