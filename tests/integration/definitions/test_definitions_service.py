"""The definitions service layer on SQLite and MariaDB: policy generations (§16.3), compiler
version changes (§7.3), and V2 trigger admission against the request-bound view (§7.4).

Drives :class:`DefinitionService` directly with an in-process catalog port; the gRPC path
is covered by ``test_definitions_activation_grpc``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.compiler import COMPILER_VERSION, MetadataViewInput, RuntimeWorkBindingRef
from runtime_svc.definitions import (
    DEFAULT_POLICY_DOCUMENT,
    AdmissionError,
    AdmissionErrorCode,
    DefinitionService,
    RequestBoundView,
    TriggerSelection,
    select_plan_for_trigger,
)
from runtime_svc.definitions.inputs import CatalogSnapshot, pin_subscription_versions
from runtime_svc.schema import execution_plans, plan_activations, runtime_policies
from services import db
from services.auth import TrustedRuntimeWorkScope
from services.errors import InvalidArgumentError
from tests.integration.definitions import flows
from tests.integration.definitions.harness import new_org
from tests.integration.definitions.memory_catalog import MemoryCatalog


@pytest.fixture
async def engine(module_db_url: str) -> AsyncIterator[AsyncEngine]:
    e = db.create_engine(module_db_url, pool_size=2)
    try:
        yield e
    finally:
        await e.dispose()


async def _table(engine: AsyncEngine, table: Any, org: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        q = select(table).where(table.c.org_id == org)
        return [dict(r) for r in (await conn.execute(q)).mappings()]


async def _activate(
    svc: DefinitionService, scope: TrustedRuntimeWorkScope, snap: CatalogSnapshot, fv: Any
) -> Any:
    outcome = await svc.compile_flow_version(
        scope, fv.flow_version_id, snap.generation_id, snap.catalog_digest
    )
    assert outcome.compiled and outcome.plan is not None, outcome.diagnostics
    plan = outcome.plan
    await svc.activate_flow_version(
        scope, "req-" + plan.plan_id, fv.flow_version_id, plan.plan_id, plan.plan_digest
    )
    return plan


async def test_policy_generations_are_immutable_and_versioned(engine: AsyncEngine) -> None:
    org = new_org()
    svc = DefinitionService(engine, MemoryCatalog())
    first = await svc.current_policy(org)
    assert first.version == 1 and first.runtime_policy().bounded_atomic.max_writes == 200
    assert (await svc.put_policy(org, DEFAULT_POLICY_DOCUMENT)).version == 1  # unchanged
    changed = json.loads(json.dumps(DEFAULT_POLICY_DOCUMENT))
    changed["durable_orchestration"]["max_fanout"] = 10
    second = await svc.put_policy(org, changed)
    assert second.version == 2 and second.document_digest != first.document_digest
    assert (await svc.put_policy(org, {**changed, "version": 99})).version == 2
    assert (await svc.current_policy(org)).version == 2
    stored = {r["policy_version"]: r for r in await _table(engine, runtime_policies, org)}
    assert sorted(stored) == [1, 2]
    assert json.loads(stored[1]["policy_payload"]) == dict(first.document)  # never rewritten
    with pytest.raises(InvalidArgumentError) as err:
        await svc.put_policy(org, {**changed, "bounded_atomic": {"max_steps": "many"}})
    assert err.value.field_path == "policy"
    with pytest.raises(InvalidArgumentError) as err:
        await svc.put_policy(org, {**changed, "surprise": 1})
    assert err.value.field_path == "policy.surprise"
    assert len(await _table(engine, runtime_policies, org)) == 2


async def test_compiler_version_change_creates_a_new_plan(engine: AsyncEngine) -> None:
    org = new_org()
    catalog = MemoryCatalog()
    scope, snap = catalog.publish(org)
    svc = DefinitionService(engine, catalog)
    fv = await svc.register_flow_version(org, "", json.dumps(flows.task_flow()))
    old = await _activate(svc, scope, snap, fv)
    newer = DefinitionService(engine, catalog, compiler_version=COMPILER_VERSION + "+next")
    # The plan compiled by the older compiler is stale for the newer binary.
    with pytest.raises(Exception, match="is stale"):
        await newer.activate_flow_version(
            scope, "req-stale", fv.flow_version_id, old.plan_id, old.plan_digest
        )
    new = await _activate(newer, scope, snap, fv)
    assert new.plan_id != old.plan_id and new.plan_digest != old.plan_digest
    assert new.compiler_version == COMPILER_VERSION + "+next"
    by_id = {r["plan_id"]: r for r in await _table(engine, execution_plans, org)}
    assert by_id[old.plan_id]["plan_payload"] == old.plan_payload
    assert by_id[old.plan_id]["compiler_version"] == COMPILER_VERSION


def _request_view(snap: CatalogSnapshot) -> RequestBoundView:
    # As the catalog publishes it: subscriptions name Flows by API name only.
    return RequestBoundView(
        RuntimeWorkBindingRef.from_dict(snap.binding),
        MetadataViewInput.from_dict(pin_subscription_versions(snap.metadata_view, {})),
    )


async def test_trigger_admission_uses_only_the_exactly_bound_plan(engine: AsyncEngine) -> None:
    org = new_org()
    catalog = MemoryCatalog()
    scope, snap = catalog.publish(org, subscriptions=[flows.WELCOME_SUBSCRIPTION])
    svc = DefinitionService(engine, catalog)
    fv = await svc.register_flow_version(org, "", json.dumps(flows.welcome_flow()))
    plan = await _activate(svc, scope, snap, fv)
    bound = _request_view(snap)

    got = await select_plan_for_trigger(engine, org, "Contact", "after_save", "create", bound)
    assert isinstance(got, TriggerSelection)
    assert [(p.flow_api_name, p.plan_id) for p in got.plans] == [("welcome_contact", plan.plan_id)]
    unsubscribed = await select_plan_for_trigger(
        engine, org, "Contact", "after_save", "update", bound
    )
    assert unsubscribed == TriggerSelection(())
    missing = await select_plan_for_trigger(engine, org, "Contact", "after_save", "create", None)
    assert isinstance(missing, AdmissionError)
    assert missing.code is AdmissionErrorCode.VIEW_MISSING

    # A metadata publication subscribes the Flow to more events (and a new version of the
    # Flow declares them): requests bound to the new view are refused until that version
    # is compiled and activated against it.
    sub = {**flows.WELCOME_SUBSCRIPTION, "events": ["create", "update"]}
    scope2, snap2 = catalog.publish(org, subscriptions=[sub], schema_generation=2)
    bound2 = _request_view(snap2)
    refused = await select_plan_for_trigger(engine, org, "Contact", "after_save", "create", bound2)
    assert isinstance(refused, AdmissionError)
    assert refused.code is AdmissionErrorCode.BINDING_MISMATCH
    assert refused.flow_api_name == "welcome_contact"

    v2_source = flows.welcome_flow(version=2)
    v2_source["trigger"]["events"] = ["create", "update"]
    fv2 = await svc.register_flow_version(org, "", json.dumps(v2_source))
    newer = await _activate(svc, scope2, snap2, fv2)
    assert newer.trigger_binding_digest != plan.trigger_binding_digest
    got2 = await select_plan_for_trigger(engine, org, "Contact", "after_save", "update", bound2)
    assert isinstance(got2, TriggerSelection)
    assert [p.plan_id for p in got2.plans] == [newer.plan_id]
    # The old view no longer serves admission: its activation was superseded.
    stale = await select_plan_for_trigger(engine, org, "Contact", "after_save", "create", bound)
    assert isinstance(stale, AdmissionError)
    assert stale.code is AdmissionErrorCode.BINDING_MISMATCH

    await svc.deactivate_flow_version(org, fv2.flow_version_id)
    gone = await select_plan_for_trigger(engine, org, "Contact", "after_save", "create", bound2)
    assert isinstance(gone, AdmissionError)
    assert gone.code is AdmissionErrorCode.NO_ACTIVE_PLAN
    assert catalog.references == set()


async def test_concurrent_activations_of_one_flow_leave_exactly_one_active(
    engine: AsyncEngine,
) -> None:
    org = new_org()
    catalog = MemoryCatalog()
    scope, snap = catalog.publish(org)
    svc = DefinitionService(engine, catalog)
    versions = [
        await svc.register_flow_version(
            org, "", json.dumps(flows.task_flow(version=v, subject=f"v{v}"))
        )
        for v in (1, 2, 3)
    ]
    plans = []
    for fv in versions:
        outcome = await svc.compile_flow_version(
            scope, fv.flow_version_id, snap.generation_id, snap.catalog_digest
        )
        assert outcome.plan is not None
        plans.append(outcome.plan)
    results = await asyncio.gather(
        *(
            svc.activate_flow_version(
                scope, f"req-{i}", fv.flow_version_id, p.plan_id, p.plan_digest
            )
            for i, (fv, p) in enumerate(zip(versions, plans, strict=True))
        )
    )
    assert all(r.activation.state == "ACTIVE" for r in results)
    stored = await _table(engine, plan_activations, org)
    active = [r for r in stored if r["state"] == "ACTIVE"]
    assert len(active) == 1 and active[0]["active_slot"] == 1
    assert sorted(r["state"] for r in stored) == ["ACTIVE", "SUPERSEDED", "SUPERSEDED"]
    # Only the winner's references remain.
    holders = {h.split("/")[0] for _, _, h in catalog.references}
    assert holders == {active[0]["plan_id"]}


async def test_activation_diagnostics_show_the_applicable_admission_bound(
    engine: AsyncEngine,
) -> None:
    """§16.3: the admission budgets live in the versioned runtime policy and activation
    names the bound that applies to the plan (issue 14 item 3)."""
    org = new_org()
    catalog = MemoryCatalog()
    scope, snap = catalog.publish(org, subscriptions=[flows.WELCOME_SUBSCRIPTION])
    svc = DefinitionService(engine, catalog)
    fv = await svc.register_flow_version(org, "", json.dumps(flows.welcome_flow()))
    await svc.put_policy(
        org,
        {
            **DEFAULT_POLICY_DOCUMENT,
            "admission": {
                "org": {"max_inflight": 5},
                "flows": {"welcome_contact": {"max_inflight": 2, "max_concurrent_runs": 3}},
            },
        },
    )
    compiled = await svc.compile_flow_version(
        scope, fv.flow_version_id, snap.generation_id, snap.catalog_digest
    )
    assert compiled.plan is not None
    plan = compiled.plan
    outcome = await svc.activate_flow_version(
        scope, "req-adm", fv.flow_version_id, plan.plan_id, plan.plan_digest
    )
    notes = {d.path: d.message for d in outcome.diagnostics if d.code == "admission_bound"}
    assert (
        notes["admission.flows[welcome_contact]"] == "concurrent runs: at most 3 (admission.flows)"
    )
    lanes = [m for p, m in notes.items() if p.startswith("admission.lanes[")]
    assert lanes and all("at most 2 in flight (flow:welcome_contact)" in m for m in lanes)
    assert {d.severity for d in outcome.diagnostics if d.code == "admission_bound"} == {"info"}
