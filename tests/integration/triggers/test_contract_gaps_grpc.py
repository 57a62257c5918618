"""The catalog contract carries what the runtime needs (issue 10, item 8), proven through
gRPC with the real catalog on SQLite and MariaDB:

* a relationship's ``max_children`` reaches the compiler, so a loop over the children
  of a parent is a proven bound and the Flow qualifies for Bounded Atomic — ``StartRun``
  runs it in one transaction; without the bound the same Flow is refused;
* ``read_only`` fields and the EMAIL / CURRENCY / MULTI_PICKLIST field types are
  published, and the record engine refuses a write that sets a read-only field and
  validates the three types.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from services.proto import catalog_v1, common_v1, runtime_v1
from tests.integration.catalog.harness import Client as CatalogClient
from tests.integration.catalog.harness import demo_view
from tests.integration.definitions.harness import error_detail, new_request_id
from tests.integration.runs.harness import RunClient
from tests.integration.triggers.harness import record_stub, sealed_tenant, struct

F = catalog_v1.FieldType
SUCCEEDED = common_v1.RunState.RUN_STATE_SUCCEEDED
BOUNDED_ATOMIC = common_v1.ExecutionProfile.EXECUTION_PROFILE_BOUNDED_ATOMIC


def _view(max_children: int) -> catalog_v1.MetadataView:
    """The demo view with every contract-gap fact: a bounded Account→Contact relationship
    (``max_children``, 0 = undeclared), a history-tracked Account with a CURRENCY field,
    and Contact fields of the new types plus a read-only one."""
    view = demo_view()
    account, contact = view.objects
    account.history_tracked = True
    account.fields.add(api_name="Revenue", type=F.FIELD_TYPE_CURRENCY, precision=12, scale=2)
    del contact.fields[1:]  # Email becomes an EMAIL field
    contact.fields.extend(
        [
            catalog_v1.FieldSchema(api_name="Email", type=F.FIELD_TYPE_EMAIL),
            catalog_v1.FieldSchema(api_name="Title", type=F.FIELD_TYPE_STRING, max_length=80),
            catalog_v1.FieldSchema(
                api_name="Tags",
                type=F.FIELD_TYPE_MULTI_PICKLIST,
                picklist_values=["vip", "press", "partner"],
            ),
            catalog_v1.FieldSchema(
                api_name="ExternalKey", type=F.FIELD_TYPE_STRING, read_only=True
            ),
        ]
    )
    view.relationships[0].max_children = max_children
    del view.trigger_subscriptions[:]  # no Flow of these tests is record-triggered
    return view


def _retitle_contacts() -> dict[str, Any]:
    """``run_atomically``: every Contact of an Account gets a new title (a loop over the
    Account→Contact relationship)."""
    return {
        "api_name": "RetitleContacts",
        "version": 1,
        "process_type": "autolaunched",
        "run_atomically": True,
        "variables": [
            {"name": "accountId", "type": "string", "input": True},
            {"name": "contacts", "type": "record", "object": "Contact", "collection": True},
            {"name": "c", "type": "record", "object": "Contact"},
        ],
        "start": "get_contacts",
        "elements": [
            {
                "api_name": "get_contacts",
                "type": "GetRecords",
                "object": "Contact",
                "read_mode": "current",
                "filters": [{"field": "AccountId", "op": "=", "value": "accountId"}],
                "output_variable": "contacts",
                "next": "each_contact",
            },
            {
                "api_name": "each_contact",
                "type": "Loop",
                "collection": "contacts",
                "item_variable": "c",
                "each": "retitle",
                "next": "done",
            },
            {
                "api_name": "retitle",
                "type": "UpdateRecord",
                "object": "Contact",
                "record": "c",
                "fields": {"Title": "'Partner'"},
                "next": "each_contact",
            },
            {"api_name": "done", "type": "End"},
        ],
    }


def _create(client: RunClient, pub: Any, obj: str, **fields: Any) -> Any:
    return (
        record_stub(client.channel)
        .CreateRecord(
            runtime_v1.CreateRecordRequest(
                request_id=new_request_id(), object_api_name=obj, fields=struct(**fields)
            ),
            metadata=client.creds(pub),
            timeout=30,
        )
        .record
    )


def test_a_loop_over_a_bounded_relationship_runs_bounded_atomic(
    client: RunClient, catalog: CatalogClient
) -> None:
    pub = sealed_tenant(catalog, _view(max_children=20))
    account = _create(client, pub, "Account", Name="Initech", Revenue=1250.5)
    contact_ids = [
        _create(
            client, pub, "Contact", AccountId=account.record_id, Email=f"c{i}@example.com"
        ).record_id
        for i in range(3)
    ]

    fv = client.register(pub.scope[0], _retitle_contacts())
    compiled = client.compile(pub, fv.flow_version_id)
    assert compiled.compiled, [(d.code, d.message) for d in compiled.diagnostics]
    assert compiled.plan.execution_profile == BOUNDED_ATOMIC
    client.activate(pub, fv.flow_version_id, compiled.plan)

    resp = client.start(pub, flow="RetitleContacts", inputs={"accountId": account.record_id})
    assert resp.completed
    assert resp.run.runtime_state == SUCCEEDED
    stub = record_stub(client.channel)
    for record_id in contact_ids:
        got = stub.GetRecord(
            runtime_v1.GetRecordRequest(object_api_name="Contact", record_id=record_id),
            metadata=client.creds(pub),
            timeout=30,
        ).record
        assert json_format.MessageToDict(got.fields)["Title"] == "Partner"
        assert got.version == 2


def test_without_max_children_the_same_loop_is_refused(
    client: RunClient, catalog: CatalogClient
) -> None:
    pub = sealed_tenant(catalog, _view(max_children=0))
    fv = client.register(pub.scope[0], _retitle_contacts())
    compiled = client.compile(pub, fv.flow_version_id)
    assert not compiled.compiled
    codes = {d.code for d in compiled.diagnostics}
    assert any(c.startswith("atomic_unsafe.") for c in codes), codes


@pytest.mark.parametrize(
    ("fields", "path", "code"),
    [
        ({"ExternalKey": "ext-1"}, "fields.ExternalKey", "read_only"),
        ({"Email": "not-an-address"}, "fields.Email", "invalid_email"),
        ({"Tags": ["vip", "gold"]}, "fields.Tags", "not_in_picklist"),
        ({"Tags": "vip"}, "fields.Tags", "type_mismatch"),
    ],
)
def test_the_record_engine_enforces_the_new_field_rules(
    client: RunClient, catalog: CatalogClient, fields: dict[str, Any], path: str, code: str
) -> None:
    pub = sealed_tenant(catalog, _view(max_children=20))
    with pytest.raises(grpc.RpcError) as err:
        _create(client, pub, "Contact", **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = error_detail(err.value)
    assert detail.attributes[path] == code


def test_currency_precision_and_valid_values_of_the_new_types(
    client: RunClient, catalog: CatalogClient
) -> None:
    pub = sealed_tenant(catalog, _view(max_children=20))
    with pytest.raises(grpc.RpcError) as err:
        _create(client, pub, "Account", Name="A", Revenue=1.234)
    assert error_detail(err.value).attributes["fields.Revenue"] == "out_of_precision"
    contact = _create(
        client, pub, "Contact", Email="ada@example.com", Tags=["vip", "press"], Title="CTO"
    )
    assert json_format.MessageToDict(contact.fields)["Tags"] == ["vip", "press"]
