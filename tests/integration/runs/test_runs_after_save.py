"""After-save trigger admission at the function level (issue 5 "Starting runs"), on
SQLite and MariaDB: admission before the record transaction, run creation inside it,
keyed by the record mutation (and the complete work scope) so one mutation can never
start two runs.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.compiler import MetadataViewInput, RuntimeWorkBindingRef
from runtime_svc.definitions import DefinitionService, RequestBoundView
from runtime_svc.definitions.inputs import CatalogSnapshot, pin_subscription_versions
from runtime_svc.kernel import FlowRunStateStore, RunState
from runtime_svc.records.model import MutationResult, RecordState
from runtime_svc.runs import admit_after_save_runs_txn, select_after_save_plans
from runtime_svc.schema import flow_runs
from services import db
from services.auth import TrustedRuntimeWorkScope
from services.errors import FailedPreconditionError
from tests.integration.definitions import flows
from tests.integration.definitions.harness import new_org
from tests.integration.definitions.memory_catalog import MemoryCatalog


@pytest.fixture
async def engine(module_db_url: str) -> AsyncIterator[AsyncEngine]:
    e = db.create_engine(module_db_url, pool_size=4)
    try:
        yield e
    finally:
        await e.dispose()


async def _welcome(
    engine: AsyncEngine,
) -> tuple[TrustedRuntimeWorkScope, RequestBoundView, str]:
    org = new_org()
    catalog = MemoryCatalog()
    scope, snap = catalog.publish(org, subscriptions=[flows.WELCOME_SUBSCRIPTION])
    svc = DefinitionService(engine, catalog)
    fv = await svc.register_flow_version(org, "", json.dumps(flows.welcome_flow()))
    outcome = await svc.compile_flow_version(
        scope, fv.flow_version_id, snap.generation_id, snap.catalog_digest
    )
    assert outcome.compiled and outcome.plan is not None, outcome.diagnostics
    plan = outcome.plan
    await svc.activate_flow_version(
        scope, "req-" + plan.plan_id, fv.flow_version_id, plan.plan_id, plan.plan_digest
    )
    return scope, _bound(snap), plan.plan_id


def _bound(snap: CatalogSnapshot) -> RequestBoundView:
    return RequestBoundView(
        RuntimeWorkBindingRef.from_dict(snap.binding),
        MetadataViewInput.from_dict(pin_subscription_versions(snap.metadata_view, {})),
    )


_NOW = datetime.now(UTC)


def _mutation(org: str, sequence: int) -> MutationResult:
    record = RecordState(
        org, "Contact", "003-1", sequence, {"LastName": "Doe"}, (), False, _NOW, _NOW
    )
    return MutationResult(record, sequence, f"evt-{sequence}", "aud", ())


async def _runs(engine: AsyncEngine, org: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        q = select(flow_runs).where(flow_runs.c.org_id == org)
        return [dict(r) for r in (await conn.execute(q)).mappings()]


async def _admit(
    engine: AsyncEngine,
    store: FlowRunStateStore,
    scope: TrustedRuntimeWorkScope,
    bound: RequestBoundView,
    mutation: MutationResult,
) -> list[str]:
    selection = await select_after_save_plans(engine, scope, "Contact", "create", bound)
    async with db.transaction(engine) as conn:
        return await admit_after_save_runs_txn(
            conn, store, scope, selection, mutation, event="create"
        )


async def test_after_save_starts_one_run_and_a_replay_returns_it(engine: AsyncEngine) -> None:
    scope, bound, plan_id = await _welcome(engine)
    store = FlowRunStateStore(engine)
    first = await _admit(engine, store, scope, bound, _mutation(scope.org_id, 1))
    assert len(first) == 1
    # The same mutation admitted again (same history sequence): its key finds the run.
    replay = await _admit(engine, store, scope, bound, _mutation(scope.org_id, 1))
    assert replay == first
    (row,) = await _runs(engine, scope.org_id)
    assert row["flow_run_id"] == first[0] and row["plan_id"] == plan_id
    assert row["runtime_state"] == RunState.RUNNABLE.code
    # The next mutation of the same record (next history sequence) starts its own run.
    second = await _admit(engine, store, scope, bound, _mutation(scope.org_id, 2))
    assert second != first and len(await _runs(engine, scope.org_id)) == 2


async def test_after_save_run_rolls_back_with_the_record_transaction(
    engine: AsyncEngine,
) -> None:
    scope, bound, _ = await _welcome(engine)
    store = FlowRunStateStore(engine)
    selection = await select_after_save_plans(engine, scope, "Contact", "create", bound)

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with db.transaction(engine) as conn:
            ids = await admit_after_save_runs_txn(
                conn, store, scope, selection, _mutation(scope.org_id, 1), event="create"
            )
            assert len(ids) == 1
            raise Boom
    assert await _runs(engine, scope.org_id) == []


async def test_after_save_unsubscribed_event_starts_nothing(engine: AsyncEngine) -> None:
    scope, bound, _ = await _welcome(engine)
    selection = await select_after_save_plans(engine, scope, "Contact", "update", bound)
    assert selection.plans == ()


async def test_after_save_admission_refused_without_the_request_view(
    engine: AsyncEngine,
) -> None:
    scope, _, _ = await _welcome(engine)
    with pytest.raises(FailedPreconditionError) as err:
        await select_after_save_plans(engine, scope, "Contact", "create", None)
    assert err.value.reason == "admission.view_missing"


async def test_after_save_run_stores_the_saving_principal(engine: AsyncEngine) -> None:
    """§17.1: the run an after-save trigger starts is initiated by the SaveRecord caller
    (the verified credential current for the RPC); in-process admission records none."""
    from services.auth import TrustedIdentity, TrustedOrgContext, identity_context

    scope, bound, _ = await _welcome(engine)
    store = FlowRunStateStore(engine)
    saver = TrustedIdentity(
        subject="user-saver",
        audiences=("runtime",),
        org=TrustedOrgContext(scope.org_id, scope.app_installation_id),
        runtime_capability_id=scope.runtime_capability_id,
        work_scope=scope,
        roles=frozenset(),
        key_id="k1",
        issued_at=0,
        expires_at=0,
    )
    with identity_context(saver):
        (run_id,) = await _admit(engine, store, scope, bound, _mutation(scope.org_id, 1))
    (unattributed,) = await _admit(engine, store, scope, bound, _mutation(scope.org_id, 2))
    rows = {r["flow_run_id"]: r for r in await _runs(engine, scope.org_id)}
    assert rows[run_id]["initiating_principal_id"] == "user-saver"
    assert rows[run_id]["execution_principal_mode"] == "initiating_principal"
    assert str(rows[run_id]["authorization_context_digest"]).startswith("authorization-context/")
    assert rows[unattributed]["initiating_principal_id"] is None
