"""Embedded Before-Save at the record engine, on SQLite and MariaDB (issue 6): the
golden Flows that compile to Embedded Before-Save run inside ``RecordEngine.mutate``'s one
transaction, and the record *written* equals the golden transform; a failing transform
leaves no record, no history/event/audit row and no Flow root; exactly one transaction
per mutation."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler import CompilerInputs, MetadataViewInput, compile_plan
from runtime_svc.compiler.kinds import ExecutionProfile
from runtime_svc.definitions.admission import RequestBoundView
from runtime_svc.embedded import BeforeSaveDispatcher, BeforeSaveFailedError
from runtime_svc.records import (
    Actor,
    MutationResult,
    RecordEngine,
    RecordMutation,
    RecordState,
    RecordView,
    prepare_create,
    prepare_update,
)
from runtime_svc.schema import audit_records, business_events, flow_runs, records
from services import db
from tests.support.plans import store_plan
from tests.unit.compiler.compiler_corpus import inputs_doc, merge_patch, read_flow

ACTOR = Actor("workload", "before-save-test")
GOLDEN = ("embedded_discount_transform", "embedded_update_trigger_record")


class _World:
    def __init__(self, engine: AsyncEngine, org: str, view: RecordView, request: Any) -> None:
        self.engine = engine
        self.org = org
        self.view = view
        self.request = request
        self.records = RecordEngine(engine)
        self.dispatcher = BeforeSaveDispatcher()

    async def write(self, mutation: RecordMutation) -> MutationResult:
        dispatcher, org, request, view = self.dispatcher, self.org, self.request, self.view

        async def transform(
            conn: AsyncConnection, m: RecordMutation, current: RecordState | None
        ) -> RecordMutation:
            return await dispatcher.transform_txn(conn, org, request, view, m, current)

        return await self.records.mutate(org, view, mutation, actor=ACTOR, transform=transform)

    async def count(self, table: Any) -> int:
        async with db.transaction(self.engine, readonly=True) as conn:
            stmt = select(func.count()).select_from(table).where(table.c.org_id == self.org)
            return int((await conn.execute(stmt)).scalar_one())


async def _world(engine: AsyncEngine, org: str, sources: list[dict[str, Any]]) -> _World:
    """The golden inputs for ``org``, subscribing exactly ``sources`` before-save, each
    compiled and ACTIVE."""
    subs = [
        {
            "flow_api_name": s["api_name"],
            "flow_version": 1,
            "object": s["trigger"]["object"],
            "timing": "before_save",
            "events": s["trigger"]["events"],
            "dispatch_order": 10,
        }
        for s in sources
    ]
    doc = merge_patch(
        inputs_doc(),
        {
            "binding": {"org_id": org},
            "catalog": {"generation": {"org_id": org}},
            "metadata_view": {"trigger_subscriptions": subs},
        },
    )
    inputs = CompilerInputs.from_dict(doc)
    binding = None
    for source in sources:
        plan = compile_plan(source, inputs)
        assert plan.profile is ExecutionProfile.EMBEDDED_BEFORE_SAVE
        await store_plan(engine, source, plan, activate=True)
        binding = plan.binding
    assert binding is not None
    metadata = MetadataViewInput.from_dict(doc["metadata_view"])
    view = RecordView.from_metadata_view(metadata)
    return _World(engine, org, view, RequestBoundView(binding, metadata))


@contextmanager
def _transactions(engine: AsyncEngine) -> Iterator[list[int]]:
    count = [0]
    lock = threading.Lock()

    def on_begin(conn: Any) -> None:
        with lock:
            count[0] += 1

    event.listen(engine.sync_engine, "begin", on_begin)
    try:
        yield count
    finally:
        event.remove(engine.sync_engine, "begin", on_begin)


async def test_golden_discount_transform_is_the_record_written(
    engine: AsyncEngine, org: str
) -> None:
    w = await _world(engine, org, [read_flow(g) for g in GOLDEN])
    fields = {"Name": "Big deal", "Amount": 150_000, "StageName": "Prospecting"}
    with _transactions(engine) as began:
        created = await w.write(prepare_create(w.view, "Opportunity", "", fields))
    assert began[0] == 1  # the transform ran inside the record transaction
    stored = await w.records.get(org, "Opportunity", created.record.record_id)
    expected = {**fields, "Discount": 15, "Priority": "High", "Description": "BIG DEAL / HIGH"}
    assert dict(stored.fields) == expected == dict(created.record.fields)

    # Update: the Flow runs over the stored record overlaid with the change.
    updated = await w.write(
        prepare_update(w.view, "Opportunity", stored.record_id, stored.version, {"Amount": 20_000})
    )
    stored = await w.records.get(org, "Opportunity", stored.record_id)
    assert stored.version == 2 and dict(stored.fields) == dict(updated.record.fields)
    assert stored.fields["Priority"] == "Medium" and stored.fields["Discount"] == 5
    assert stored.fields["Description"] == "BIG DEAL / MEDIUM"
    assert await w.count(flow_runs) == 0


async def test_golden_update_trigger_record_reads_its_parent_in_the_transaction(
    engine: AsyncEngine, org: str
) -> None:
    w = await _world(engine, org, [read_flow(g) for g in GOLDEN])
    account = await w.records.mutate(
        org,
        w.view,
        prepare_create(w.view, "Account", "", {"Name": "Globex", "CreditHold": True}),
        actor=ACTOR,
    )
    rid = account.record.record_id
    created = await w.write(
        prepare_create(w.view, "Contact", "", {"LastName": "Lovelace", "AccountId": rid})
    )
    stored = await w.records.get(org, "Contact", created.record.record_id)
    assert dict(stored.fields) == {
        "LastName": "Lovelace",
        "AccountId": rid,
        "Title": "Contact at Globex",
        "OptOut": True,
    }


async def test_a_failing_transform_leaves_no_record_and_no_flow_root(
    engine: AsyncEngine, org: str
) -> None:
    source = read_flow("embedded_discount_transform")
    # The golden Flow with a Fault on its medium branch.
    for element in source["elements"]:
        if element["api_name"] == "mid_deal":
            element.clear()
            element.update({"api_name": "mid_deal", "type": "Fault", "code": "MEDIUM_REFUSED"})
    w = await _world(engine, org, [source])
    before = [await w.count(t) for t in (records, business_events, audit_records, flow_runs)]
    fields = {"Name": "Mid", "Amount": 20_000, "StageName": "Prospecting"}
    with pytest.raises(BeforeSaveFailedError) as err:
        await w.write(prepare_create(w.view, "Opportunity", "", fields))
    assert err.value.evidence.code == "MEDIUM_REFUSED"
    assert err.value.reason == "before_save.flow_failed"
    after = [await w.count(t) for t in (records, business_events, audit_records, flow_runs)]
    assert after == before == [0, 0, 0, 0]
    # Another branch of the same Flow writes normally.
    ok = await w.write(prepare_create(w.view, "Opportunity", "", {**fields, "Amount": 500}))
    assert ok.record.fields["Priority"] == "Low"
