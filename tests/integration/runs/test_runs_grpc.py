"""FlowRunService through the runtime's gRPC API (§10.1, §17.3, §18, §19, §22.2, §22.6),
on SQLite and MariaDB. Plans are compiled and activated through the definitions API; no
worker runs, so started runs stay ``RUNNABLE``. One server pair per module; every test
uses its own org.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from runtime_svc.identity import authorization_context_digest
from runtime_svc.schema import flow_checkpoints, flow_runs, flow_step_executions
from services.config import ServiceName
from services.proto import common_v1
from tests.integration.definitions import flows
from tests.integration.definitions.harness import KEY_ID, error_detail, new_org, rows
from tests.integration.runs.harness import (
    ALL_ROLES,
    RunClient,
    RunServers,
    publish_and_activate,
)
from tests.support.servers import workload_metadata

RUNNABLE = common_v1.RunState.RUN_STATE_RUNNABLE
CANCEL_REQUESTED = common_v1.RunState.RUN_STATE_CANCEL_REQUESTED
COMPAT_RUNNING = common_v1.CompatibilityStatus.COMPATIBILITY_STATUS_RUNNING


def _setup(servers: RunServers, client: RunClient, *sources: Any) -> tuple[Any, dict[str, Any]]:
    return publish_and_activate(servers, client, new_org(), sources or [flows.task_flow()])


def _code(fn: Any) -> tuple[grpc.StatusCode, Any]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), error_detail(err.value)  # type: ignore[attr-defined]


def test_start_run_returns_identity_and_state(servers: RunServers, client: RunClient) -> None:
    pub, plans = _setup(servers, client)
    resp = client.start(pub, flow="make_task", inputs={"recordId": "003A"})
    run = resp.run
    assert (resp.completed, resp.existing_run) == (False, False)
    assert run.flow_run_id and run.org_id == pub.scope[0]
    assert run.runtime_state == RUNNABLE
    assert run.compatibility.status == COMPAT_RUNNING
    assert run.plan_id == plans["make_task"].plan_id
    assert run.plan_digest == plans["make_task"].plan_digest
    assert run.flow_api_name == "make_task"
    got = client.get(pub, run.flow_run_id)
    assert got == run


def _runs_of(db_url: str, org: str) -> list[dict[str, Any]]:
    return rows(db_url, flow_runs, org_id=org)


# --- StartRun: idempotency -------------------------------------------------------------


def test_start_run_same_key_same_body_returns_same_run(
    servers: RunServers, client: RunClient
) -> None:
    pub, _ = _setup(servers, client)
    first = client.start(pub, flow="make_task", inputs={"recordId": "a"}, key="order-1")
    again = client.start(pub, flow="make_task", inputs={"recordId": "a"}, key="order-1")
    assert again.existing_run and not first.existing_run
    assert again.run.flow_run_id == first.run.flow_run_id
    assert again.run.idempotency_key == "order-1"
    assert len(_runs_of(servers.db_url, pub.scope[0])) == 1


def test_start_run_same_key_different_body_is_rejected(
    servers: RunServers, client: RunClient
) -> None:
    pub, _ = _setup(servers, client)
    client.start(pub, flow="make_task", inputs={"recordId": "a"}, key="order-1")
    code, detail = _code(
        lambda: client.start(pub, flow="make_task", inputs={"recordId": "b"}, key="order-1")
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert detail.code == "idempotency_key_reused"
    assert len(_runs_of(servers.db_url, pub.scope[0])) == 1


def test_start_run_key_is_scoped_by_flow_api_name(servers: RunServers, client: RunClient) -> None:
    pub, _ = _setup(servers, client, flows.task_flow("make_task"), flows.task_flow("make_other"))
    a = client.start(pub, flow="make_task", inputs={"recordId": "a"}, key="k")
    b = client.start(pub, flow="make_other", inputs={"recordId": "a"}, key="k")
    assert a.run.flow_run_id != b.run.flow_run_id
    assert not b.existing_run


def test_concurrent_start_with_same_key_creates_exactly_one_run(
    servers: RunServers, client: RunClient
) -> None:
    pub, _ = _setup(servers, client)

    def start(_: int) -> str:
        resp = client.start(pub, flow="make_task", inputs={"recordId": "a"}, key="race")
        return str(resp.run.flow_run_id)

    with ThreadPoolExecutor(max_workers=8) as pool:
        ids = set(pool.map(start, range(8)))
    assert len(ids) == 1
    assert [r["flow_run_id"] for r in _runs_of(servers.db_url, pub.scope[0])] == list(ids)


def test_start_run_by_plan_id(servers: RunServers, client: RunClient) -> None:
    pub, plans = _setup(servers, client)
    resp = client.start(pub, plan_id=plans["make_task"].plan_id, inputs={"recordId": "x"})
    assert resp.run.plan_id == plans["make_task"].plan_id
    assert resp.run.flow_api_name == "make_task"


def test_start_run_specific_version(servers: RunServers, client: RunClient) -> None:
    pub, _ = _setup(servers, client)
    assert client.start(pub, flow="make_task", version=1).run.runtime_state == RUNNABLE
    code, _ = _code(lambda: client.start(pub, flow="make_task", version=7))
    assert code == grpc.StatusCode.NOT_FOUND


# --- StartRun: input validation and the checkpoint guard ---------------------------------


@pytest.mark.parametrize(
    ("inputs", "path"),
    [
        ({"bogus": "x"}, "input_variables.bogus"),
        ({"recordId": 12}, "input_variables.recordId"),
    ],
)
def test_start_run_rejects_invalid_inputs(
    servers: RunServers, client: RunClient, inputs: dict[str, Any], path: str
) -> None:
    pub, _ = _setup(servers, client)
    code, detail = _code(lambda: client.start(pub, flow="make_task", inputs=inputs))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert detail.field_path == path
    assert _runs_of(servers.db_url, pub.scope[0]) == []


def test_start_run_rejects_credential_material_and_persists_nothing(
    servers: RunServers, client: RunClient
) -> None:
    pub, _ = _setup(servers, client)
    secret = "Bearer abcdefghijklmnopqrstuvwxyz0123456789"
    code, detail = _code(lambda: client.start(pub, flow="make_task", inputs={"recordId": secret}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert detail.code == "checkpoint_credential_rejected"
    assert detail.field_path == "input_variables.recordId"
    assert secret not in detail.message
    org = pub.scope[0]
    assert _runs_of(servers.db_url, org) == []
    assert rows(servers.db_url, flow_checkpoints, org_id=org) == []
    assert rows(servers.db_url, flow_step_executions, org_id=org) == []


def test_start_run_input_json_must_be_an_object(servers: RunServers, client: RunClient) -> None:
    pub, _ = _setup(servers, client)
    code, detail = _code(lambda: client.start(pub, flow="make_task", input_json="[1]"))
    assert (code, detail.field_path) == (grpc.StatusCode.INVALID_ARGUMENT, "input_json")
    ok = client.start(pub, flow="make_task", input_json=json.dumps({"recordId": "z"}))
    assert ok.run.runtime_state == RUNNABLE


# --- StartRun: §18.3 wait budget ----------------------------------------------------------


def test_wait_budget_returns_identity_and_state_when_no_worker_runs(
    servers: RunServers, client: RunClient
) -> None:
    pub, _ = _setup(servers, client)
    resp = client.start(pub, flow="make_task", inputs={"recordId": "a"}, wait_s=0.3)
    assert not resp.completed
    assert resp.run.flow_run_id and resp.run.runtime_state == RUNNABLE
    assert not resp.run.HasField("output_variables")


# --- scope ---------------------------------------------------------------------------------


def test_cross_org_reads_and_writes_answer_like_missing(
    servers: RunServers, client: RunClient
) -> None:
    pub, plans = _setup(servers, client)
    run_id = client.start(pub, flow="make_task").run.flow_run_id
    other, _ = _setup(servers, client)
    calls = {
        "get": lambda rid: client.get(other, rid),
        "support": lambda rid: client.support(other, rid),
        "delete": lambda rid: client.delete(other, rid),
        "cancel": lambda rid: client.cancel(other, rid),
    }
    for name, call in calls.items():
        foreign = _code(lambda c=call: c(run_id))
        missing = _code(lambda c=call: c("run-does-not-exist"))
        # Not ASCII, so no run's id (an ascii column on MariaDB, ADR 0015): missing too.
        odd = _code(lambda c=call: c("run-ünicode"))
        assert foreign[0] == missing[0] == odd[0] == grpc.StatusCode.NOT_FOUND, name
        assert foreign[1].code == missing[1].code == odd[1].code, name
    assert client.list(other).runs == []
    # The other org's plan and Flow are not visible either.
    code, _ = _code(lambda: client.start(other, plan_id=plans["make_task"].plan_id))
    assert code == grpc.StatusCode.NOT_FOUND
    assert client.get(pub, run_id).runtime_state == RUNNABLE


def test_body_org_that_disagrees_with_credential_is_refused(
    servers: RunServers, client: RunClient
) -> None:
    pub, _ = _setup(servers, client)
    run_id = client.start(pub, flow="make_task").run.flow_run_id
    other, _ = _setup(servers, client)
    code, _ = _code(lambda: client.get((pub.scope[0],), run_id, md=client.creds(other)))
    assert code == grpc.StatusCode.PERMISSION_DENIED


def test_start_in_other_installation_of_same_org_is_not_found(
    servers: RunServers, client: RunClient
) -> None:
    pub, _ = _setup(servers, client)
    other = servers.catalog.publish(
        pub.scope[0], flows.view(pub.scope[0], app="inst-2"), flows.entries(), app="inst-2"
    )
    code, _ = _code(lambda: client.start(other, flow="make_task"))
    assert code == grpc.StatusCode.NOT_FOUND


# --- §17.1: the run stores its initiating identity ---------------------------------------


def test_start_run_stores_the_initiating_principal_mode_and_context_digest(
    servers: RunServers, client: RunClient
) -> None:
    pub, _ = _setup(servers, client)
    md = client.creds(pub)
    first = client.start(pub, flow="make_task", inputs={"recordId": "a"}, key="k-1", md=md)
    principal = first.run.principal
    # The verified credential's subject, never a body field; the test principal is not
    # in the org's principal directory, so its context digest says "unmanaged".
    assert principal.principal_id == "runs-test"
    assert principal.execution_principal_mode == "initiating_principal"
    assert principal.principal_mode == common_v1.PrincipalMode.PRINCIPAL_MODE_INITIATING_PRINCIPAL
    assert principal.authorization_context_digest == authorization_context_digest("runs-test", None)
    assert client.get(pub, first.run.flow_run_id).principal == principal
    # A replay under another subject keeps the first initiator.
    other = client.start(
        pub,
        flow="make_task",
        inputs={"recordId": "a"},
        key="k-1",
        md=workload_metadata(
            client.private_key,
            KEY_ID,
            ServiceName.RUNTIME,
            *pub.scope,
            subject="someone-else",
            roles=ALL_ROLES,
        ),
    )
    assert other.existing_run and other.run.principal.principal_id == "runs-test"
    (row,) = _runs_of(servers.db_url, pub.scope[0])
    assert row["initiating_principal_id"] == "runs-test"
    assert row["execution_principal_mode"] == "initiating_principal"
    # No credential anywhere in the run row (§17.1): only ids and digests.
    bearer = dict(md)["authorization"].split()[-1]
    assert all(bearer not in str(v) for v in row.values())
