"""FlowDefinitionService request deduplication and foreign plans (issue 10, items 2 and
11), through the gRPC API on SQLite and MariaDB: retries replay the original response, a
reused id with another body is refused before anything happens, and a plan of another
installation answers exactly like a missing plan on every RPC."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from runtime_svc.schema import plan_activations
from services.proto import runtime_v1
from tests.integration.definitions import flows
from tests.integration.definitions.harness import (
    Client,
    Servers,
    error_detail,
    new_org,
    new_request_id,
    rows,
)


def _publish(servers: Servers, org: str, **kwargs: Any) -> Any:
    app = kwargs.get("app", "inst-1")
    return servers.catalog.publish(org, flows.view(org, app=app), flows.entries(), **kwargs)


def _fails(fn: Any) -> Any:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value


def _activate_request(pub: Any, fv: Any, plan: Any) -> runtime_v1.ActivateFlowVersionRequest:
    return runtime_v1.ActivateFlowVersionRequest(
        request_id=new_request_id(),
        scope=pub.scope_proto(),
        flow_version_id=fv.flow_version_id,
        plan_id=plan.plan_id,
        plan_digest=plan.plan_digest,
    )


def test_retried_definition_requests_replay_the_original_response(
    servers: Servers, client: Client, module_db_url: str
) -> None:
    org = new_org()
    pub = _publish(servers, org)
    register = runtime_v1.RegisterFlowVersionRequest(
        request_id=new_request_id(),
        org_id=org,
        flow_api_name="make_task",
        source_json=json.dumps(flows.task_flow()),
    )
    first = client.stub.RegisterFlowVersion(register, metadata=client.md(org), timeout=30)
    assert client.stub.RegisterFlowVersion(register, metadata=client.md(org), timeout=30) == first
    fv = first.flow_version
    plan = client.compile(pub, fv.flow_version_id).plan
    activate = _activate_request(pub, fv, plan)
    activated = client.stub.ActivateFlowVersion(activate, metadata=client.scoped(pub), timeout=30)
    deactivated = client.stub.DeactivateFlowVersion(
        runtime_v1.DeactivateFlowVersionRequest(
            request_id=new_request_id(), org_id=org, flow_version_id=fv.flow_version_id
        ),
        metadata=client.scoped(pub),
        timeout=30,
    )
    assert deactivated.activation.state == runtime_v1.ActivationState.ACTIVATION_STATE_DEACTIVATED
    # The retry answers what the first call answered (ACTIVE), and activates nothing.
    again = client.stub.ActivateFlowVersion(activate, metadata=client.scoped(pub), timeout=30)
    assert again == activated
    assert rows(module_db_url, plan_activations, org_id=org, state="ACTIVE") == []

    changed = runtime_v1.ActivateFlowVersionRequest()
    changed.CopyFrom(activate)
    changed.plan_digest = "plan/v1:sha256:" + "2" * 64
    err = _fails(
        lambda: client.stub.ActivateFlowVersion(changed, metadata=client.scoped(pub), timeout=30)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error_detail(err).code, error_detail(err).field_path) == (
        "request_id_reused",
        "request_id",
    )


def test_a_plan_of_another_installation_answers_exactly_like_a_missing_plan(
    servers: Servers, client: Client
) -> None:
    org = new_org()
    mine = _publish(servers, org)
    theirs = _publish(servers, org, app="inst-2")
    fv = client.register(org, flows.task_flow())
    their_plan = client.compile(theirs, fv.flow_version_id).plan
    missing = runtime_v1.PlanSummary(plan_id="plan_missing", plan_digest=their_plan.plan_digest)

    def activate(plan: Any) -> Any:
        return _fails(lambda: client.activate(mine, fv.flow_version_id, plan))

    def get(ref: str) -> Any:
        return _fails(
            lambda: client.stub.GetPlan(
                runtime_v1.GetPlanRequest(org_id=org, plan_id=ref),
                metadata=client.scoped(mine),
                timeout=30,
            )
        )

    for foreign, absent in (
        (activate(their_plan), activate(missing)),
        (get(their_plan.plan_id), get(missing.plan_id)),
        (get(their_plan.plan_digest), get("plan/v1:sha256:" + "9" * 64)),
    ):
        assert foreign.code() == absent.code() == grpc.StatusCode.NOT_FOUND
        f, a = error_detail(foreign), error_detail(absent)
        assert (f.code, f.field_path) == (a.code, a.field_path)
        assert set(f.attributes) == set(a.attributes)
        assert "scope" not in foreign.details()
    # The owning installation (and an org-wide credential) still sees it.
    got = client.stub.GetPlan(
        runtime_v1.GetPlanRequest(org_id=org, plan_id=their_plan.plan_id),
        metadata=client.scoped(theirs),
        timeout=30,
    )
    assert got.plan.plan_id == their_plan.plan_id
    assert client.get_plan(org, their_plan.plan_id).plan_id == their_plan.plan_id
    # ListFlowVersions shows this installation's activations only.
    client.activate(theirs, fv.flow_version_id, their_plan)
    listed = client.stub.ListFlowVersions(
        runtime_v1.ListFlowVersionsRequest(org_id=org), metadata=client.scoped(mine), timeout=30
    )
    assert [v.flow_version_id for v in listed.flow_versions] == [fv.flow_version_id]
    assert list(listed.activations) == []
    theirs_listed = client.stub.ListFlowVersions(
        runtime_v1.ListFlowVersionsRequest(org_id=org), metadata=client.scoped(theirs), timeout=30
    )
    assert [a.plan_id for a in theirs_listed.activations] == [their_plan.plan_id]
