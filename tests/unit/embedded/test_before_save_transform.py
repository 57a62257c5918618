"""Embedded Before-Save transforms without a database (§9.1, issue 6): output parity with
the golden Flows that compile to Embedded Before-Save, entry conditions, budgets and
fail-closed outputs. Record reads are served by an in-memory map (the transform's only
I/O is the awaited reader it is given)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest

from runtime_svc.compiler import CompilerInputs, ExecutionPlan, compile_plan
from runtime_svc.compiler.kinds import ExecutionProfile
from runtime_svc.embedded import BeforeSaveFault, run_before_save
from runtime_svc.records.model import RecordState
from tests.unit.compiler.compiler_corpus import inputs_doc, read_flow

_NOW = datetime(2026, 11, 29, tzinfo=UTC)


def _compile(source: dict[str, Any]) -> ExecutionPlan:
    """Compile ``source``, subscribing it before-save in the golden view when needed."""
    doc = inputs_doc()
    subs = doc["metadata_view"]["trigger_subscriptions"]
    if not any(s["flow_api_name"] == source["api_name"] for s in subs):
        trig = source["trigger"]
        subs.append(
            {
                "flow_api_name": source["api_name"],
                "flow_version": source["version"],
                "object": trig["object"],
                "timing": trig["timing"],
                "events": trig["events"],
                "dispatch_order": 10,
            }
        )
    plan = compile_plan(source, CompilerInputs.from_dict(doc))
    assert plan.profile is ExecutionProfile.EMBEDDED_BEFORE_SAVE
    return plan


class _Records:
    """``(object, id) -> fields`` served as current reads; counts them."""

    def __init__(self, rows: dict[tuple[str, str], dict[str, Any]] | None = None) -> None:
        self.rows = rows or {}
        self.reads = 0

    async def read(self, object_name: str, record_id: str) -> RecordState | None:
        self.reads += 1
        fields = self.rows.get((object_name, record_id))
        if fields is None:
            return None
        return RecordState(
            org_id="org-acme",
            object_name=object_name,
            record_id=record_id,
            version=1,
            fields=copy.deepcopy(fields),
            parent_refs=(),
            is_deleted=False,
            created_at=_NOW,
            updated_at=_NOW,
        )


DISCOUNT = "embedded_discount_transform"


@pytest.mark.parametrize(
    ("amount", "stage", "expected"),
    [
        # Decision "large": Discount = MIN(15, Amount / 10000), Priority High.
        (150_000, "Prospecting", {"Discount": 15, "Priority": "High"}),
        (120_000, "Prospecting", {"Discount": 12, "Priority": "High"}),
        (125_000, "Prospecting", {"Discount": 12.5, "Priority": "High"}),
        # "large" needs StageName != 'Closed Lost'; it falls to "medium".
        (150_000, "Closed Lost", {"Discount": 5, "Priority": "Medium"}),
        (20_000, "Prospecting", {"Discount": 5, "Priority": "Medium"}),
        # Default branch: Priority Low, Discount untouched.
        (500, "Prospecting", {"Priority": "Low"}),
    ],
)
async def test_discount_transform_matches_the_golden_flow(
    amount: int, stage: str, expected: dict[str, Any]
) -> None:
    plan = _compile(read_flow(DISCOUNT))
    fields = {"Name": "Acme deal", "Amount": amount, "StageName": stage}
    out = await run_before_save(plan, "opp-1", fields, None, reader=_Records().read)
    assert out.ran
    label = f"ACME DEAL / {expected['Priority'].upper()}"  # format_text(..., 'upper')
    assert dict(out.fields) == {**fields, **expected, "Description": label}
    assert out.steps <= plan.bounds.max_steps  # type: ignore[operator]


async def test_entry_condition_false_leaves_the_record_untouched() -> None:
    plan = _compile(read_flow(DISCOUNT))
    fields = {"Name": "Zero", "Amount": 0, "StageName": "Prospecting"}
    out = await run_before_save(plan, "opp-1", fields, None, reader=_Records().read)
    assert not out.ran
    assert dict(out.fields) == fields


async def test_update_trigger_record_reads_the_parent_and_stamps_the_record() -> None:
    plan = _compile(read_flow("embedded_update_trigger_record"))
    records = _Records({("Account", "acc-1"): {"Name": "Globex", "CreditHold": True}})
    fields = {"LastName": "Lovelace", "AccountId": "acc-1"}
    out = await run_before_save(plan, "con-1", fields, None, reader=records.read)
    assert dict(out.fields) == {**fields, "Title": "Contact at Globex", "OptOut": True}
    assert out.reads == records.reads == 1

    # A title already set is kept (IF(ISBLANK(...))).
    titled = {**fields, "Title": "CTO"}
    out = await run_before_save(plan, "con-1", titled, None, reader=records.read)
    assert out.fields["Title"] == "CTO"


async def test_missing_parent_is_a_null_record_not_an_error() -> None:
    plan = _compile(read_flow("embedded_update_trigger_record"))
    fields = {"LastName": "Lovelace", "AccountId": "acc-404"}
    out = await run_before_save(plan, "con-1", fields, None, reader=_Records().read)
    assert out.fields["Title"] == "Contact at "  # CONCAT treats null as empty
    assert out.fields["OptOut"] is None


def _probe_flow() -> dict[str, Any]:
    """Before-save: one parent read, one assignment to the trigger record."""
    return {
        "api_name": "BudgetProbe",
        "version": 1,
        "process_type": "record_triggered",
        "trigger": {"object": "Contact", "timing": "before_save", "events": ["create"]},
        "variables": [{"name": "acct", "type": "record", "object": "Account"}],
        "start": "get_account",
        "elements": [
            {
                "api_name": "get_account",
                "type": "GetRecords",
                "object": "Account",
                "first_only": True,
                "filters": [{"field": "Id", "op": "=", "value": "$Record.AccountId"}],
                "output_variable": "acct",
                "next": "stamp",
            },
            {
                "api_name": "stamp",
                "type": "Assignment",
                "assignments": [{"target": "$Record.Title", "value": "acct.Name"}],
            },
        ],
    }


async def test_budget_exhaustion_fails_deterministically_naming_the_bound() -> None:
    """A plan whose compiled step budget is smaller than what the run needs (a policy of
    fewer element executions than the Flow's path) fails with the bound named."""
    plan = _compile(_probe_flow())
    step = plan.step(plan.start_step)
    tight = copy.deepcopy(plan)
    object.__setattr__(
        tight.step(tight.start_step),
        "bounds",
        type(step.bounds)(1, step.bounds.max_reads, 0, 1, ()),
    )
    records = _Records({("Account", "acc-1"): {"Name": "Globex"}})
    fields = {"LastName": "L", "AccountId": "acc-1"}
    for _ in range(2):  # deterministic: the same input fails the same way
        with pytest.raises(BeforeSaveFault) as err:
            await run_before_save(tight, "con-1", fields, None, reader=records.read)
        assert err.value.code == "budget_exceeded.max_steps"
        assert err.value.bound == "max_steps"
        assert "max_steps" in str(err.value)


async def test_read_budget_exhaustion_names_max_reads() -> None:
    plan = _compile(_probe_flow())
    tight = copy.deepcopy(plan)
    step = tight.step(tight.start_step)
    object.__setattr__(step, "bounds", type(step.bounds)(10, 0, 0, 1, ()))
    records = _Records({("Account", "acc-1"): {"Name": "Globex"}})
    with pytest.raises(BeforeSaveFault) as err:
        await run_before_save(tight, "con-1", {"AccountId": "acc-1"}, None, reader=records.read)
    assert (err.value.code, err.value.bound) == ("budget_exceeded.max_reads", "max_reads")


async def test_a_fault_element_fails_the_mutation_with_its_code() -> None:
    source = {
        "api_name": "RejectBlank",
        "version": 1,
        "process_type": "record_triggered",
        "trigger": {"object": "Contact", "timing": "before_save", "events": ["create"]},
        "variables": [],
        "start": "check",
        "elements": [
            {
                "api_name": "check",
                "type": "Decision",
                "rules": [
                    {"name": "blank", "condition": "ISBLANK($Record.LastName)", "next": "no"}
                ],
            },
            {"api_name": "no", "type": "Fault", "code": "LAST_NAME_REQUIRED", "message": "x"},
        ],
    }
    plan = _compile(source)
    with pytest.raises(BeforeSaveFault) as err:
        await run_before_save(plan, "con-1", {"FirstName": "Ada"}, None, reader=_Records().read)
    assert err.value.code == "LAST_NAME_REQUIRED"
    ok = await run_before_save(plan, "con-1", {"LastName": "L"}, None, reader=_Records().read)
    assert ok.ran and ok.fields == {"LastName": "L"}


async def test_prior_values_drive_the_entry_condition_on_update() -> None:
    source = read_flow(DISCOUNT)
    source["trigger"]["entry_condition"] = "$Record.Amount != $Record__Prior.Amount"
    plan = _compile(source)
    same = {"Name": "A", "Amount": 500, "StageName": "Prospecting"}
    unchanged = await run_before_save(plan, "opp-1", same, dict(same), reader=_Records().read)
    assert not unchanged.ran
    changed = await run_before_save(
        plan, "opp-1", same, {**same, "Amount": 400}, reader=_Records().read
    )
    assert changed.ran and changed.fields["Priority"] == "Low"


async def test_a_durable_plan_is_refused() -> None:
    source = read_flow(DISCOUNT)
    plan = _compile(source)
    durable = copy.deepcopy(plan)
    object.__setattr__(durable, "profile", ExecutionProfile.DURABLE_ORCHESTRATION)
    with pytest.raises(BeforeSaveFault) as err:
        await run_before_save(durable, "opp-1", {"Amount": 1}, None, reader=_Records().read)
    assert err.value.code == "not_embedded_before_save"


def _count_contacts() -> dict[str, Any]:
    """Before-save on Account update: counts the account's contacts into ContactCount
    (reads and fan-out bounded by the relationship's ``max_children``)."""
    return {
        "api_name": "CountContacts",
        "version": 1,
        "process_type": "record_triggered",
        "trigger": {"object": "Account", "timing": "before_save", "events": ["update"]},
        "variables": [
            {"name": "contacts", "type": "record", "object": "Contact", "collection": True},
            {"name": "c", "type": "record", "object": "Contact"},
        ],
        "start": "get_contacts",
        "elements": [
            {
                "api_name": "get_contacts",
                "type": "GetRecords",
                "object": "Contact",
                "filters": [{"field": "AccountId", "op": "=", "value": "$Record.Id"}],
                "output_variable": "contacts",
                "next": "reset",
            },
            {
                "api_name": "reset",
                "type": "Assignment",
                "assignments": [{"target": "$Record.ContactCount", "value": "0"}],
                "next": "each",
            },
            {
                "api_name": "each",
                "type": "Loop",
                "collection": "contacts",
                "item_variable": "c",
                "each": "inc",
            },
            {
                "api_name": "inc",
                "type": "Assignment",
                "assignments": [{"target": "$Record.ContactCount", "op": "add", "value": "1"}],
                "next": "each",
            },
        ],
    }


def _contacts(n: int) -> Any:
    async def query(object_name: str, field: str, value: str, limit: int) -> list[RecordState]:
        assert (object_name, field, value) == ("Contact", "AccountId", "acc-1")
        rows = [
            RecordState(
                org_id="org-acme",
                object_name="Contact",
                record_id=f"con-{i}",
                version=1,
                fields={"AccountId": "acc-1"},
                parent_refs=(),
                is_deleted=False,
                created_at=_NOW,
                updated_at=_NOW,
            )
            for i in range(n)
        ]
        return rows[:limit]

    return query


async def test_runtime_reads_beyond_the_compiled_bound_fail_with_max_reads() -> None:
    """The plan was compiled when Account_Contacts allowed 2 children; at runtime the
    account has 3: the query reads one row past the budget and fails closed."""
    source = _count_contacts()
    doc = inputs_doc()
    for rel in doc["metadata_view"]["relationships"]:
        if rel["name"] == "Account_Contacts":
            rel["max_children"] = 2
    doc["metadata_view"]["trigger_subscriptions"].append(
        {
            "flow_api_name": "CountContacts",
            "flow_version": 1,
            "object": "Account",
            "timing": "before_save",
            "events": ["update"],
            "dispatch_order": 10,
        }
    )
    plan = compile_plan(source, CompilerInputs.from_dict(doc))
    assert plan.profile is ExecutionProfile.EMBEDDED_BEFORE_SAVE
    assert plan.step(plan.start_step).bounds.max_reads == 2
    fields = {"Name": "Globex"}
    within = await run_before_save(
        plan, "acc-1", fields, dict(fields), reader=_Records().read, query=_contacts(2)
    )
    assert within.fields["ContactCount"] == 2
    with pytest.raises(BeforeSaveFault) as err:
        await run_before_save(
            plan, "acc-1", fields, dict(fields), reader=_Records().read, query=_contacts(3)
        )
    assert (err.value.code, err.value.bound) == ("budget_exceeded.max_reads", "max_reads")
    assert "max_reads" in str(err.value) and "3 > 2" in str(err.value)
