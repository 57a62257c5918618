"""Bad input through the runtime's gRPC API with the real catalog (issue 10, item 9), on
SQLite and MariaDB: deeply nested JSON in a Flow source or a run's ``input_json``,
over-long identifiers (which MariaDB would refuse with "data too long") and unknown
enum numbers are ``INVALID_ARGUMENT`` naming the field, and nothing is written."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from runtime_svc.schema import flow_runs, flow_versions
from services.proto import runtime_v1
from tests.integration.catalog.harness import Client as CatalogClient
from tests.integration.definitions.harness import error_detail, new_request_id, rows
from tests.integration.runs.harness import RunClient
from tests.integration.triggers.harness import sealed_tenant
from tests.integration.triggers.test_start_run_atomic_grpc import _open_account


def _refused(call: Any) -> Any:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return error_detail(err.value)


def test_a_deeply_nested_flow_source_is_refused(
    client: RunClient, catalog: CatalogClient, module_db_url: str
) -> None:
    pub = sealed_tenant(catalog)
    org = pub.scope[0]
    source = _open_account()
    source["description"] = json.loads("[" * 60 + "]" * 60)  # within the bound: fine
    for depth in (100, 5_000, 150_000):
        deep = json.dumps(source)[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}"
        detail = _refused(lambda deep=deep: client.register(org, deep))
        assert detail.code == "flow_source_invalid", detail
        assert "source.too_deep" in detail.attributes["codes"], detail
    assert rows(module_db_url, flow_versions, org_id=org) == []


def test_a_deeply_nested_run_input_is_refused(
    client: RunClient, catalog: CatalogClient, module_db_url: str
) -> None:
    pub = sealed_tenant(catalog)
    fv = client.register(pub.scope[0], _open_account())
    compiled = client.compile(pub, fv.flow_version_id)
    client.activate(pub, fv.flow_version_id, compiled.plan)
    for depth in (65, 100_000):
        deep = '{"name": ' + "[" * depth + "]" * depth + "}"
        detail = _refused(lambda deep=deep: client.start(pub, flow="OpenAccount", input_json=deep))
        assert (detail.field_path, detail.code) == ("input_json", "too_deep")
    assert rows(module_db_url, flow_runs, org_id=pub.scope[0]) == []


def test_over_long_identifiers_and_unknown_enums_are_refused_before_storage(
    client: RunClient, catalog: CatalogClient, module_db_url: str
) -> None:
    pub = sealed_tenant(catalog)
    org = pub.scope[0]
    long_name = "F" * 65
    source = _open_account()
    source["api_name"] = long_name
    detail = _refused(lambda: client.register(org, source))
    assert (detail.field_path, detail.code) == ("flow_api_name", "too_long")
    assert detail.attributes["max_length"] == "64"
    assert long_name not in detail.message
    assert rows(module_db_url, flow_versions, org_id=org) == []

    detail = _refused(
        lambda: client.runs.GetRun(
            runtime_v1.GetRunRequest(org_id=org, flow_run_id="r" * 65),
            metadata=client.creds(pub),
            timeout=30,
        )
    )
    assert detail.code == "too_long"

    listing = runtime_v1.ListRunsRequest(org_id=org)
    listing.runtime_states.append(42)  # type: ignore[arg-type]
    detail = _refused(lambda: client.runs.ListRuns(listing, metadata=client.creds(pub), timeout=30))
    assert (detail.field_path, detail.code) == ("runtime_states[0]", "unknown_enum_value")

    request = runtime_v1.StartRunRequest(
        request_id=new_request_id(), scope=pub.scope_proto(), idempotency_key="k" * 201
    )
    request.flow.flow_api_name = "OpenAccount"
    detail = _refused(lambda: client.runs.StartRun(request, metadata=client.creds(pub), timeout=30))
    assert (detail.field_path, detail.code) == ("idempotency_key", "too_long")
