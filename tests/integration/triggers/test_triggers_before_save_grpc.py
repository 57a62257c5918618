"""Embedded Before-Save through gRPC (issue 6 deliverable 1), on SQLite and MariaDB.

A RecordService create/update that the request-bound view subscribes ACTIVE before-save
Flows to runs their compiled transforms inside the record engine's own transaction, in
the documented dispatch order, before the row is written: exactly one runtime database
transaction per mutation, no Flow root. A failing Flow fails the mutation
``FAILED_PRECONDITION`` with nothing written and its evidence in the audit contract.

The catalog is the real catalog service in-process (a view with before-save
subscriptions); Flows are compiled and activated through the definitions API.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from sqlalchemy import event, func, select

from runtime_svc.embedded import BEFORE_SAVE_FAILED_ACTION
from runtime_svc.schema import audit_records, flow_runs, records
from services import db
from services.proto import catalog_v1, common_v1, runtime_v1
from tests.integration.catalog.harness import Client as CatalogClient
from tests.integration.catalog.harness import demo_view
from tests.integration.definitions.fake_catalog import Published
from tests.integration.definitions.harness import error_detail, new_request_id
from tests.integration.runs.harness import RunClient
from tests.integration.triggers.harness import (
    TriggerServers,
    record_stub,
    sealed_tenant,
    struct,
)

F = catalog_v1.FieldType
T = common_v1.TriggerEvent


def _view() -> catalog_v1.MetadataView:
    """The demo view with name/title fields on Contact and three before-save
    subscriptions on it, ordered by ``dispatch_order`` against their names: ``Zeta`` (10)
    runs before ``Alpha`` (20), ``Guard`` (30) last."""
    view = demo_view()
    contact = next(o for o in view.objects if o.api_name == "Contact")
    contact.fields.extend(
        [
            catalog_v1.FieldSchema(api_name="LastName", type=F.FIELD_TYPE_TEXT, max_length=80),
            catalog_v1.FieldSchema(api_name="Title", type=F.FIELD_TYPE_TEXT, max_length=40),
        ]
    )
    del view.trigger_subscriptions[:]
    for name, order, events in (
        ("Guard", 30, [T.TRIGGER_EVENT_CREATE]),
        ("Alpha", 20, [T.TRIGGER_EVENT_CREATE, T.TRIGGER_EVENT_UPDATE]),
        ("Zeta", 10, [T.TRIGGER_EVENT_CREATE, T.TRIGGER_EVENT_UPDATE]),
    ):
        view.trigger_subscriptions.append(
            catalog_v1.TriggerSubscription(
                flow_api_name=name,
                object_api_name="Contact",
                timing=common_v1.TriggerTiming.TRIGGER_TIMING_BEFORE_SAVE,
                events=events,
                dispatch_order=order,
            )
        )
    return view


def _flow(name: str, events: list[str], elements: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "api_name": name,
        "version": 1,
        "process_type": "record_triggered",
        "trigger": {"object": "Contact", "timing": "before_save", "events": events},
        "variables": [],
        "start": elements[0]["api_name"],
        "elements": elements,
    }


def _flows() -> list[dict[str, Any]]:
    """Zeta trims the last name and appends "Z" to the title, Alpha appends "A" (so the
    title records the execution order); Guard faults on last name ``FAIL``."""
    zeta = _flow(
        "Zeta",
        ["create", "update"],
        [
            {
                "api_name": "trim",
                "type": "Assignment",
                "assignments": [
                    {"target": "$Record.LastName", "value": "TRIM($Record.LastName)"},
                    {
                        "target": "$Record.Title",
                        "value": "CONCAT(IF(ISBLANK($Record.Title), '', $Record.Title), 'Z')",
                    },
                ],
            }
        ],
    )
    alpha = _flow(
        "Alpha",
        ["create", "update"],
        [
            {
                "api_name": "mark",
                "type": "UpdateRecord",
                "object": "Contact",
                "record": "$Record",
                "fields": {"Title": "CONCAT(IF(ISBLANK($Record.Title), '', $Record.Title), 'A')"},
            }
        ],
    )
    guard = _flow(
        "Guard",
        ["create"],
        [
            {
                "api_name": "check",
                "type": "Decision",
                "rules": [{"name": "bad", "condition": "$Record.LastName == 'FAIL'", "next": "no"}],
            },
            {"api_name": "no", "type": "Fault", "code": "GUARD_REFUSED", "message": "refused"},
        ],
    )
    return [zeta, alpha, guard]


def _tenant(
    catalog: CatalogClient, client: RunClient, versions: dict[str, str] | None = None
) -> Published:
    pub = sealed_tenant(catalog, _view())
    org = pub.scope[0]
    for source in _flows():
        fv = client.register(org, source)
        compiled = client.compile(pub, fv.flow_version_id)
        assert compiled.compiled, [d.message for d in compiled.diagnostics]
        assert compiled.plan.execution_profile == (
            common_v1.ExecutionProfile.EXECUTION_PROFILE_EMBEDDED_BEFORE_SAVE
        )
        client.activate(pub, fv.flow_version_id, compiled.plan)
        if versions is not None:
            versions[source["api_name"]] = fv.flow_version_id
    return pub


def _create(client: RunClient, pub: Published, request_id: str = "", **fields: Any) -> Any:
    return record_stub(client.channel).CreateRecord(
        runtime_v1.CreateRecordRequest(
            request_id=request_id or new_request_id(),
            scope=pub.scope_proto(),
            object_api_name="Contact",
            fields=struct(**fields),
        ),
        metadata=client.creds(pub),
        timeout=30,
    )


def _fields(record: Any) -> dict[str, Any]:
    return dict(json_format.MessageToDict(record.fields))


async def _count(url: str, stmt: Any) -> int:
    engine = db.create_engine(url, pool_size=1)
    try:
        async with db.transaction(engine, readonly=True) as conn:
            return int((await conn.execute(stmt)).scalar_one())
    finally:
        await engine.dispose()


def _rows(servers: TriggerServers, table: Any, org: str, *where: Any) -> int:
    stmt = select(func.count()).select_from(table).where(table.c.org_id == org, *where)
    return asyncio.run(_count(servers.runtime_db_url, stmt))


@contextmanager
def _transactions(servers: TriggerServers) -> Iterator[list[int]]:
    """Counts transactions the runtime engine begins (its connection ``begin`` events)."""
    assert servers.runtime_engine is not None
    sync_engine = servers.runtime_engine.sync_engine
    count = [0]
    lock = threading.Lock()

    def on_begin(conn: Any) -> None:
        with lock:
            count[0] += 1

    event.listen(sync_engine, "begin", on_begin)
    try:
        yield count
    finally:
        event.remove(sync_engine, "begin", on_begin)


def test_flows_transform_the_record_in_dispatch_order_on_create_and_update(
    client: RunClient, catalog: CatalogClient, servers: TriggerServers
) -> None:
    pub = _tenant(catalog, client)
    created = _create(client, pub, LastName="  Lovelace  ")
    # Zeta (dispatch 10) ran before Alpha (dispatch 20) although "Alpha" sorts first.
    assert _fields(created.record) == {"LastName": "Lovelace", "Title": "ZA"}
    assert created.record.version == 1
    assert list(created.triggered_flow_run_ids) == []

    updated = record_stub(client.channel).UpdateRecord(
        runtime_v1.UpdateRecordRequest(
            request_id=new_request_id(),
            scope=pub.scope_proto(),
            object_api_name="Contact",
            record_id=created.record.record_id,
            expected_version=1,
            fields=struct(LastName=" Byron "),
        ),
        metadata=client.creds(pub),
        timeout=30,
    )
    assert _fields(updated.record) == {"LastName": "Byron", "Title": "ZAZA"}
    assert updated.record.version == 2
    # Before-save never creates a Flow root.
    assert _rows(servers, flow_runs, pub.scope[0]) == 0


def test_one_transaction_per_mutation_and_no_flow_root(
    client: RunClient, catalog: CatalogClient, servers: TriggerServers
) -> None:
    pub = _tenant(catalog, client)
    _create(client, pub, LastName="warm-up")  # view and plan caches
    with _transactions(servers) as began:
        created = _create(client, pub, LastName="Hopper")
    assert _fields(created.record)["Title"] == "ZA"
    assert began[0] == 1
    assert _rows(servers, flow_runs, pub.scope[0]) == 0


def test_a_failing_flow_writes_nothing_and_leaves_audit_evidence(
    client: RunClient, catalog: CatalogClient, servers: TriggerServers
) -> None:
    pub = _tenant(catalog, client)
    org = pub.scope[0]
    request_id = new_request_id()
    for _ in range(2):  # deterministic, and the retry replays the whole mutation
        with pytest.raises(grpc.RpcError) as err:
            _create(client, pub, request_id=request_id, LastName="FAIL")
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        detail = error_detail(err.value)
        assert detail.code == "before_save.flow_failed"
        assert dict(detail.attributes) == {"flow_api_name": "Guard", "code": "GUARD_REFUSED"}
        assert "Guard" in (err.value.details() or "")
    assert _rows(servers, records, org) == 0
    assert _rows(servers, flow_runs, org) == 0
    assert (
        _rows(servers, audit_records, org, audit_records.c.action == BEFORE_SAVE_FAILED_ACTION) == 2
    )
    # The same request with corrected input is a new mutation and succeeds.
    ok = _create(client, pub, request_id=new_request_id(), LastName="Fine")
    assert _fields(ok.record) == {"LastName": "Fine", "Title": "ZA"}
    assert _rows(servers, records, org) == 1


def test_output_breaking_the_write_rules_fails_the_mutation(
    client: RunClient, catalog: CatalogClient, servers: TriggerServers
) -> None:
    """Title has max_length 40: a long title plus the Flows' suffixes is refused as the
    Flow's invalid output, not written truncated."""
    pub = _tenant(catalog, client)
    with pytest.raises(grpc.RpcError) as err:
        _create(client, pub, LastName="Long", Title="x" * 39)
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    detail = error_detail(err.value)
    assert detail.code == "before_save.flow_failed"
    assert detail.attributes["code"] == "invalid_output"
    assert _rows(servers, records, pub.scope[0]) == 0


def test_deactivation_takes_effect_on_the_next_write(
    client: RunClient, catalog: CatalogClient, servers: TriggerServers
) -> None:
    """The activation state is read inside every record transaction (plans and admission
    decisions are cached, activations never): a deactivated Flow stops running at once."""
    versions: dict[str, str] = {}
    pub = _tenant(catalog, client, versions)
    with pytest.raises(grpc.RpcError) as err:
        _create(client, pub, LastName="FAIL")
    assert error_detail(err.value).attributes["flow_api_name"] == "Guard"
    client.deactivate(pub, versions["Guard"])
    with pytest.raises(grpc.RpcError) as err:
        _create(client, pub, LastName="FAIL")
    # The view still subscribes Guard, so admission now refuses the write (fail closed:
    # a declared subscription without an active plan never silently skips its Flow).
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(err.value).code == "admission.no_active_plan"
    client.deactivate(pub, versions["Zeta"])
    with pytest.raises(grpc.RpcError) as err:
        _create(client, pub, LastName="x")
    assert error_detail(err.value).attributes["flow_api_name"] in ("Guard", "Zeta")
    assert _rows(servers, records, pub.scope[0]) == 0
