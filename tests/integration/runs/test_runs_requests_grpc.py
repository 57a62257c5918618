"""Request deduplication and version preconditions of FlowRunService (issue 10, items 2,
3 and 6), through the gRPC API on SQLite and MariaDB: a retried ``request_id`` replays the
original response and never starts a second run; a reused id with another body is
refused; idempotency keys are keyed by the complete work scope; ``DeleteRun``/``CancelRun``
compare a presence-aware expected version (0 included) in the store's compare-and-swap.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from google.protobuf.wrappers_pb2 import Int64Value

from runtime_svc.kernel import FlowRunStateStore
from runtime_svc.schema import flow_runs, runtime_requests
from services import db
from services.proto import common_v1, runtime_v1
from tests.integration.definitions import flows
from tests.integration.definitions.harness import error_detail, new_org, new_request_id, rows
from tests.integration.runs.harness import RunClient, RunServers, publish_and_activate

RUNNABLE = common_v1.RunState.RUN_STATE_RUNNABLE
CANCEL_REQUESTED = common_v1.RunState.RUN_STATE_CANCEL_REQUESTED
CANCELLED = common_v1.RunState.RUN_STATE_CANCELLED


def _setup(servers: RunServers, client: RunClient) -> Any:
    pub, _ = publish_and_activate(servers, client, new_org(), [flows.task_flow()])
    return pub


def _code(fn: Any) -> tuple[grpc.StatusCode, Any]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), error_detail(err.value)  # type: ignore[attr-defined]


def _start_request(pub: Any, record: str = "a", key: str = "") -> runtime_v1.StartRunRequest:
    req = runtime_v1.StartRunRequest(
        request_id=new_request_id(), scope=pub.scope_proto(), idempotency_key=key
    )
    req.flow.flow_api_name = "make_task"
    req.input_variables.update({"recordId": record})
    return req


def _start(client: RunClient, pub: Any, req: runtime_v1.StartRunRequest) -> Any:
    return client.runs.StartRun(req, metadata=client.creds(pub), timeout=30)


def _runs(servers: RunServers, org: str) -> list[dict[str, Any]]:
    return rows(servers.db_url, flow_runs, org_id=org)


def _complete_cancel(db_url: str, org: str, run_id: str) -> None:
    async def main() -> None:
        engine = db.create_engine(db_url, pool_size=2)
        try:
            await FlowRunStateStore(engine).complete_cancel(org, run_id)
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_retried_start_run_without_idempotency_key_starts_one_run_and_replays(
    servers: RunServers, client: RunClient
) -> None:
    pub = _setup(servers, client)
    req = _start_request(pub)
    first = _start(client, pub, req)
    # The run moves on (cancelled); the retry still answers what the first call answered.
    client.cancel(pub, first.run.flow_run_id)
    retry = _start(client, pub, req)
    assert retry == first and retry.run.runtime_state == RUNNABLE
    assert len(_runs(servers, pub.scope[0])) == 1
    (ledger,) = rows(servers.db_url, runtime_requests, org_id=pub.scope[0], rpc_name="StartRun")
    assert ledger["completed"] and ledger["app_installation_id"] == pub.scope[1]


def test_request_id_reused_with_another_body_is_refused_and_starts_nothing(
    servers: RunServers, client: RunClient
) -> None:
    pub = _setup(servers, client)
    req = _start_request(pub, "a")
    _start(client, pub, req)
    other = _start_request(pub, "b")
    other.request_id = req.request_id
    code, detail = _code(lambda: _start(client, pub, other))
    assert (code, detail.code, detail.field_path) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "request_id_reused",
        "request_id",
    )
    assert len(_runs(servers, pub.scope[0])) == 1


def test_concurrent_start_runs_with_one_request_id_start_one_run(
    servers: RunServers, client: RunClient
) -> None:
    pub = _setup(servers, client)
    req = _start_request(pub)
    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(pool.map(lambda _: _start(client, pub, req), range(6)))
    assert len({a.run.flow_run_id for a in answers}) == 1
    assert len(_runs(servers, pub.scope[0])) == 1


def test_delete_and_cancel_retries_replay_the_original_response(
    servers: RunServers, client: RunClient
) -> None:
    pub = _setup(servers, client)
    org = pub.scope[0]
    run_id = client.start(pub, flow="make_task").run.flow_run_id
    cancel = runtime_v1.CancelRunRequest(
        request_id=new_request_id(), org_id=org, flow_run_id=run_id
    )
    cancelled = client.runs.CancelRun(cancel, metadata=client.creds(pub), timeout=30)
    delete = runtime_v1.DeleteRunRequest(
        request_id=new_request_id(), org_id=org, flow_run_id=run_id
    )
    deleted = client.runs.DeleteRun(delete, metadata=client.creds(pub), timeout=30)
    assert deleted.run.runtime_state == CANCEL_REQUESTED and deleted.run.is_deleted
    _complete_cancel(servers.db_url, org, run_id)  # the run is CANCELLED now
    again = client.runs.DeleteRun(delete, metadata=client.creds(pub), timeout=30)
    assert again == deleted  # the original response, not the run's current state
    replay = client.runs.CancelRun(cancel, metadata=client.creds(pub), timeout=30)
    assert replay == cancelled and not replay.run.is_deleted
    # A new request sees the current state.
    fresh = client.delete(pub, run_id)
    assert fresh.runtime_state == CANCELLED


def test_idempotency_key_of_another_installation_of_the_org_starts_its_own_run(
    servers: RunServers, client: RunClient
) -> None:
    pub = _setup(servers, client)
    org = pub.scope[0]
    other = servers.catalog.publish(
        org, flows.view(org, app="inst-2"), flows.entries(), app="inst-2"
    )
    fv = client.register(org, flows.task_flow())
    compiled = client.compile(other, fv.flow_version_id)
    client.activate(other, fv.flow_version_id, compiled.plan)
    a = _start(client, pub, _start_request(pub, "a", key="order-1"))
    # Another body under the same key: in another installation it is another key.
    b = _start(client, other, _start_request(other, "b", key="order-1"))
    assert not a.existing_run and not b.existing_run
    assert a.run.flow_run_id != b.run.flow_run_id
    assert (a.run.app_installation_id, b.run.app_installation_id) == (pub.scope[1], "inst-2")
    assert a.run.idempotency_key == b.run.idempotency_key == "order-1"
    # Within one installation the key still dedupes.
    again = _start(client, other, _start_request(other, "b", key="order-1"))
    assert again.existing_run and again.run.flow_run_id == b.run.flow_run_id


def _delete_expecting(
    client: RunClient, pub: Any, run_id: str, *, value: int | None, legacy: int = 0
) -> Any:
    req = runtime_v1.DeleteRunRequest(
        request_id=new_request_id(),
        org_id=pub.scope[0],
        flow_run_id=run_id,
        expected_state_version=legacy,
    )
    if value is not None:
        req.expected_state_version_value.CopyFrom(Int64Value(value=value))
    return client.runs.DeleteRun(req, metadata=client.creds(pub), timeout=30).run


def test_expected_version_zero_is_expressible_and_checked_in_the_transition(
    servers: RunServers, client: RunClient
) -> None:
    pub = _setup(servers, client)
    fresh = client.start(pub, flow="make_task").run
    assert fresh.state_version == 0
    deleted = _delete_expecting(client, pub, fresh.flow_run_id, value=0)
    assert deleted.is_deleted and deleted.runtime_state == CANCEL_REQUESTED

    moved = client.start(pub, flow="make_task").run
    client.cancel(pub, moved.flow_run_id)  # version 0 -> 1
    code, detail = _code(lambda: _delete_expecting(client, pub, moved.flow_run_id, value=0))
    assert (code, detail.code) == (grpc.StatusCode.FAILED_PRECONDITION, "state_version_mismatch")
    assert not client.get(pub, moved.flow_run_id).is_deleted  # nothing written
    code, detail = _code(
        lambda: _delete_expecting(client, pub, moved.flow_run_id, value=1, legacy=2)
    )
    assert (code, detail.field_path) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "expected_state_version_value",
    )
    assert _delete_expecting(client, pub, moved.flow_run_id, value=1).is_deleted


def test_cancel_with_a_stale_expected_version_writes_nothing(
    servers: RunServers, client: RunClient
) -> None:
    pub = _setup(servers, client)
    run = client.start(pub, flow="make_task").run
    req = runtime_v1.CancelRunRequest(
        request_id=new_request_id(), org_id=pub.scope[0], flow_run_id=run.flow_run_id
    )
    req.expected_state_version_value.CopyFrom(Int64Value(value=5))
    code, detail = _code(lambda: client.runs.CancelRun(req, metadata=client.creds(pub), timeout=30))
    assert (code, detail.code) == (grpc.StatusCode.FAILED_PRECONDITION, "state_version_mismatch")
    assert client.get(pub, run.flow_run_id).runtime_state == RUNNABLE
    assert not rows(servers.db_url, runtime_requests, org_id=pub.scope[0], rpc_name="CancelRun")
