"""RecordService through gRPC with the real catalog in-process (SQLite and MariaDB): the
view comes from the catalog through the trusted scope; status codes and error details are
what a client sees."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from google.protobuf.struct_pb2 import Struct

from runtime_svc.api.records import CatalogRecordViews
from services.auth import TrustedRuntimeWorkScope
from services.config import ServiceName
from services.proto import runtime_v1
from tests.integration.records.harness import (
    Clients,
    RecordServers,
    Scope,
    error_detail,
    new_id,
)


def _struct(**values: Any) -> Struct:
    s = Struct()
    s.update(values)
    return s


def _fields(record: Any) -> dict[str, Any]:
    value: dict[str, Any] = json_format.MessageToDict(record.fields)
    return value


def _create(clients: Clients, scope: Scope, obj: str, rid: str = "", **fields: Any) -> Any:
    return clients.call(
        "CreateRecord",
        runtime_v1.CreateRecordRequest(
            request_id=new_id("req"),
            scope=scope.proto(),
            object_api_name=obj,
            record_id=rid,
            fields=_struct(**fields),
        ),
        scope,
    )


def _update(clients: Clients, scope: Scope, obj: str, rid: str, version: int, **fields: Any) -> Any:
    return clients.call(
        "UpdateRecord",
        runtime_v1.UpdateRecordRequest(
            request_id=new_id("req"),
            scope=scope.proto(),
            object_api_name=obj,
            record_id=rid,
            expected_version=version,
            fields=_struct(**fields),
        ),
        scope,
    )


def _get(clients: Clients, scope: Scope, obj: str, rid: str) -> Any:
    return clients.call(
        "GetRecord",
        runtime_v1.GetRecordRequest(org_id=scope.org_id, object_api_name=obj, record_id=rid),
        scope,
    )


def test_create_get_update_delete_over_grpc(clients: Clients) -> None:
    scope = clients.tenant()
    created = _create(clients, scope, "Account", Name="Acme", Employees=10)
    record = created.record
    assert list(created.triggered_flow_run_ids) == []  # after-save triggers come later
    assert record.version == 1 and record.org_id == scope.org_id
    assert record.record_id.startswith("rec_")
    assert _fields(record) == {"Name": "Acme", "Employees": 10.0}
    assert record.created_at.ToDatetime() == record.updated_at.ToDatetime()

    child = _create(clients, scope, "Contact", "con-1", AccountId=record.record_id).record
    assert [(p.relationship_name, p.parent_record_id) for p in child.parent_refs] == [
        ("AccountId", record.record_id)
    ]
    via_ref = clients.call(
        "CreateRecord",
        runtime_v1.CreateRecordRequest(
            request_id=new_id("req"),
            scope=scope.proto(),
            object_api_name="Contact",
            record_id="con-2",
            parent_refs=[
                runtime_v1.ParentRef(
                    relationship_name="AccountId",
                    parent_object_api_name="Account",
                    parent_record_id=record.record_id,
                )
            ],
        ),
        scope,
    ).record
    assert _fields(via_ref) == {"AccountId": record.record_id}

    fetched = _get(clients, scope, "Account", record.record_id).record
    assert fetched == record

    updated = _update(clients, scope, "Account", record.record_id, 1, Employees=11, Name="Acme 2")
    assert updated.record.version == 2
    assert list(updated.triggered_flow_run_ids) == []
    assert _fields(updated.record) == {"Name": "Acme 2", "Employees": 11.0}

    deleted = clients.call(
        "DeleteRecord",
        runtime_v1.DeleteRecordRequest(
            request_id=new_id("req"),
            scope=scope.proto(),
            object_api_name="Account",
            record_id=record.record_id,
            expected_version=2,
        ),
        scope,
    )
    assert deleted.record.is_deleted and deleted.record.version == 3
    with pytest.raises(grpc.RpcError) as info:
        _get(clients, scope, "Account", record.record_id)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_validation_error_names_the_field(clients: Clients) -> None:
    scope = clients.tenant()
    with pytest.raises(grpc.RpcError) as info:
        _create(clients, scope, "Account", Name="Acme", Employees="many", Tier="Bronze")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = error_detail(info.value)
    assert detail.field_path == "fields.Employees"
    assert dict(detail.attributes) == {
        "fields.Employees": "type_mismatch",
        "fields.Tier": "not_in_picklist",
    }
    with pytest.raises(grpc.RpcError) as info:
        _create(clients, scope, "Account", Nickname="x", Name="y")
    assert error_detail(info.value).field_path == "fields.Nickname"
    with pytest.raises(grpc.RpcError) as info:
        _create(clients, scope, "Contact", AccountId="no-such-account")
    assert error_detail(info.value).field_path == "fields.AccountId"
    with pytest.raises(grpc.RpcError) as info:
        _create(clients, scope, "Opportunity", Name="x")
    assert error_detail(info.value).field_path == "object_api_name"


def test_stale_version_fails_aborted(clients: Clients) -> None:
    scope = clients.tenant()
    rid = _create(clients, scope, "Account", Name="Acme").record.record_id
    _update(clients, scope, "Account", rid, 1, Employees=1)
    with pytest.raises(grpc.RpcError) as info:
        _update(clients, scope, "Account", rid, 1, Employees=2)
    assert info.value.code() == grpc.StatusCode.ABORTED
    detail = error_detail(info.value)
    assert detail.code == "stale_version"
    assert dict(detail.attributes)["found_version"] == "2"
    assert not detail.retryable


def test_other_org_sees_not_found_and_body_scope_must_match(clients: Clients) -> None:
    mine, theirs = clients.tenant(), clients.tenant()
    rid = _create(clients, mine, "Account", Name="Mine").record.record_id
    with pytest.raises(grpc.RpcError) as info:
        clients.call(
            "GetRecord",
            runtime_v1.GetRecordRequest(
                org_id=theirs.org_id, object_api_name="Account", record_id=rid
            ),
            theirs,
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        _update(clients, theirs, "Account", rid, 1, Name="Stolen")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # A body naming another org than the credential is refused, never used.
    with pytest.raises(grpc.RpcError) as info:
        clients.call(
            "GetRecord",
            runtime_v1.GetRecordRequest(
                org_id=mine.org_id, object_api_name="Account", record_id=rid
            ),
            theirs,
        )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as info:
        clients.call(
            "CreateRecord",
            runtime_v1.CreateRecordRequest(
                request_id=new_id("req"),
                scope=mine.proto(),
                object_api_name="Account",
                fields=_struct(Name="x"),
            ),
            theirs,
        )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_write_needs_a_bound_work_scope(clients: Clients) -> None:
    scope = clients.tenant()
    org_only = clients.md(ServiceName.RUNTIME, scope.org_id)
    request = runtime_v1.CreateRecordRequest(
        request_id=new_id("req"), object_api_name="Account", fields=_struct(Name="x")
    )
    with pytest.raises(grpc.RpcError) as info:
        clients.records.CreateRecord(request, metadata=org_only, timeout=30)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    unbound = Scope(
        scope.org_id, "inst-1", "cap-records", "runtime_work_binding/v1:sha256:" + "0" * 64
    )
    with pytest.raises(grpc.RpcError) as info:
        clients.call("CreateRecord", request, unbound)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Reads need only the org.
    rid = _create(clients, scope, "Account", Name="Acme").record.record_id
    got = clients.records.GetRecord(
        runtime_v1.GetRecordRequest(object_api_name="Account", record_id=rid),
        metadata=org_only,
        timeout=30,
    )
    assert got.record.record_id == rid


def test_retried_request_is_applied_once(clients: Clients) -> None:
    scope = clients.tenant()
    request = runtime_v1.CreateRecordRequest(
        request_id=new_id("req"),
        scope=scope.proto(),
        object_api_name="Account",
        fields=_struct(Name="Once"),
    )
    first = clients.call("CreateRecord", request, scope)
    _update(clients, scope, "Account", first.record.record_id, 1, Name="Later")
    again = clients.call("CreateRecord", request, scope)  # lost response, retry
    # The original response, byte for byte: version 1 and its fields, not the current record.
    assert again == first and again.record.version == 1
    assert _fields(again.record) == {"Name": "Once"}
    changed = runtime_v1.CreateRecordRequest()
    changed.CopyFrom(request)
    changed.fields.update({"Name": "Twice"})
    with pytest.raises(grpc.RpcError) as info:
        clients.call("CreateRecord", changed, scope)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(info.value).field_path == "request_id"
    with pytest.raises(grpc.RpcError) as info:
        clients.call(
            "CreateRecord",
            runtime_v1.CreateRecordRequest(
                scope=scope.proto(), object_api_name="Account", fields=_struct(Name="x")
            ),
            scope,
        )
    assert error_detail(info.value).field_path == "request_id"


async def test_views_come_from_the_catalog_by_scope_and_are_cached(
    clients: Clients, record_servers: RecordServers
) -> None:
    scope = clients.tenant()
    trusted = TrustedRuntimeWorkScope(
        scope.org_id,
        scope.app_installation_id,
        scope.runtime_capability_id,
        scope.runtime_work_binding_digest,
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{record_servers.catalog_port}") as channel:
        views = CatalogRecordViews(channel, record_servers.catalog_credential)
        view = await views.view_for(trusted)
        assert await views.view_for(trusted) is view  # cached: immutable by digest
        assert views.cached_views == 1
        account = view.objects["Account"]
        assert account.fields["Name"].required and account.fields["Name"].max_length == 80
        assert account.fields["Tier"].picklist_values == ("Gold", "Silver")
        assert account.fields["Id"].read_only
        relationship = view.relationship("Contact", "AccountId")
        assert relationship is not None and relationship.lock_parent
        assert view.relationship("Note", "AboutId") is None  # the catalog keeps lock-relevant ones
        other = clients.tenant()
        other_scope = TrustedRuntimeWorkScope(
            other.org_id,
            other.app_installation_id,
            other.runtime_capability_id,
            other.runtime_work_binding_digest,
        )
        await views.view_for(other_scope)
        assert views.cached_views == 2  # never shared across orgs, even for equal content
