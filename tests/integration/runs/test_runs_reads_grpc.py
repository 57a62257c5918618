"""FlowRunService reads and lifecycle commands through the gRPC API (§10.1 steps 1-6,
§11.1, §18.2, §19), on SQLite and MariaDB: ListRuns pages and filters, the support read,
authorized idempotent soft delete, cancellation, and terminal-run behaviour. Terminal
runs are produced through the kernel's typed store, as a worker would.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from runtime_svc.kernel import CheckpointInput, FinishRun, FlowRunStateStore, LeaseFence
from runtime_svc.schema import flow_runs
from services import db
from services.proto import common_v1
from tests.integration.definitions import flows
from tests.integration.definitions.harness import error_detail, new_org, rows
from tests.integration.runs.harness import RunClient, RunServers, publish_and_activate

RUNNABLE = common_v1.RunState.RUN_STATE_RUNNABLE
SUCCEEDED = common_v1.RunState.RUN_STATE_SUCCEEDED
CANCEL_REQUESTED = common_v1.RunState.RUN_STATE_CANCEL_REQUESTED
CANCELLED = common_v1.RunState.RUN_STATE_CANCELLED
FINISHED = common_v1.CompatibilityStatus.COMPATIBILITY_STATUS_FINISHED
ERROR = common_v1.CompatibilityStatus.COMPATIBILITY_STATUS_ERROR
RUNNING = common_v1.CompatibilityStatus.COMPATIBILITY_STATUS_RUNNING


def _output_flow(name: str = "make_result") -> dict[str, Any]:
    source = flows.task_flow(name)
    source["variables"] = [
        {"name": "recordId", "type": "string", "input": True},
        {"name": "result", "type": "string", "output": True},
    ]
    return source


def _setup(servers: RunServers, client: RunClient, *sources: Any) -> tuple[Any, dict[str, Any]]:
    return publish_and_activate(servers, client, new_org(), sources or [flows.task_flow()])


def _code(fn: Any) -> tuple[grpc.StatusCode, Any]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), error_detail(err.value)  # type: ignore[attr-defined]


def _finish(db_url: str, org: str, run_id: str, outputs: dict[str, Any]) -> None:
    """Drive the run to SUCCEEDED through the typed store (claim, run, final commit)."""

    async def main() -> None:
        engine = db.create_engine(db_url, pool_size=2)
        try:
            store = FlowRunStateStore(engine)
            run = await store.get_run(org, run_id)
            for _ in range(50):
                found = [
                    c
                    for c in await store.eligible_work(org, run.queue_class)
                    if c.flow_run_id == run_id
                ]
                if found:
                    break
                await asyncio.sleep(0.05)
            fence = await store.claim(org, found[0], lease_owner="test-worker")
            assert isinstance(fence, LeaseFence), fence
            fence = await store.mark_running(org, fence)
            await store.commit_step(
                org,
                fence,
                output=CheckpointInput({"variables": {"recordId": "r", **outputs}}),
                advance=FinishRun(),
            )
        finally:
            await engine.dispose()

    asyncio.run(main())


# --- GetRun / ListRuns ---------------------------------------------------------------------


def test_get_run_projects_succeeded_as_finished_with_outputs(
    servers: RunServers, client: RunClient
) -> None:
    pub, _ = _setup(servers, client, _output_flow())
    run_id = client.start(pub, flow="make_result", inputs={"recordId": "r"}).run.flow_run_id
    _finish(servers.db_url, pub.scope[0], run_id, {"result": "done"})
    run = client.get(pub, run_id)
    assert run.runtime_state == SUCCEEDED
    assert run.compatibility.status == FINISHED
    assert dict(run.output_variables) == {"result": "done"}  # declared outputs only


def test_wait_budget_returns_terminal_result(servers: RunServers, client: RunClient) -> None:
    pub, _ = _setup(servers, client, _output_flow())
    org = pub.scope[0]

    def worker() -> None:
        for _ in range(200):
            runs = rows(servers.db_url, flow_runs, org_id=org)
            if runs:
                _finish(servers.db_url, org, runs[0]["flow_run_id"], {"result": "sync"})
                return
            threading.Event().wait(0.02)

    t = threading.Thread(target=worker)
    t.start()
    resp = client.start(pub, flow="make_result", inputs={"recordId": "r"}, wait_s=2.0)
    t.join(timeout=30)
    if not resp.completed:  # the worker lost the race with the budget; never assert time
        pytest.skip("worker did not finish within the wait budget")
    assert resp.run.runtime_state == SUCCEEDED
    assert dict(resp.run.output_variables) == {"result": "sync"}


def test_list_runs_pages_with_tamper_evident_tokens(servers: RunServers, client: RunClient) -> None:
    pub, _ = _setup(servers, client)
    started = [client.start(pub, flow="make_task").run.flow_run_id for _ in range(5)]
    seen: list[str] = []
    token = ""
    for _ in range(5):
        page = client.list(pub, page_size=2, page_token=token)
        seen += [r.flow_run_id for r in page.runs]
        token = page.next_page_token
        if not token:
            break
    assert sorted(seen) == sorted(started) and len(seen) == 5
    first = client.list(pub, page_size=2)
    tampered = first.next_page_token[:-2] + ("AA" if first.next_page_token[-2:] != "AA" else "BB")
    for bad in (tampered, "not-a-token"):
        code, detail = _code(lambda b=bad: client.list(pub, page_size=2, page_token=b))
        assert (code, detail.field_path) == (grpc.StatusCode.INVALID_ARGUMENT, "page_token")
    # A token is bound to its filters and to its org.
    code, _ = _code(
        lambda: client.list(
            pub, page_size=2, page_token=first.next_page_token, flow_api_name="make_task"
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    other, _ = _setup(servers, client)
    code, _ = _code(lambda: client.list(other, page_size=2, page_token=first.next_page_token))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_list_runs_filters(servers: RunServers, client: RunClient) -> None:
    pub, _ = _setup(servers, client, flows.task_flow("make_task"), flows.task_flow("make_other"))
    a = client.start(pub, flow="make_task").run
    b = client.start(pub, flow="make_other").run
    client.cancel(pub, b.flow_run_id)

    def ids(**kw: Any) -> set[str]:
        return {r.flow_run_id for r in client.list(pub, **kw).runs}

    assert ids() == {a.flow_run_id, b.flow_run_id}
    assert ids(flow_api_name="make_task") == {a.flow_run_id}
    assert ids(flow_version_id=b.flow_version_id) == {b.flow_run_id}
    assert ids(plan_id=a.plan_id) == {a.flow_run_id}
    assert ids(runtime_states=[CANCEL_REQUESTED]) == {b.flow_run_id}
    assert ids(runtime_states=[RUNNABLE, CANCEL_REQUESTED]) == {a.flow_run_id, b.flow_run_id}
    future = Timestamp()
    future.FromDatetime(datetime.now(UTC) + timedelta(days=1))
    past = Timestamp()
    past.FromDatetime(datetime.now(UTC) - timedelta(days=1))
    assert ids(created_after=future) == set()
    assert ids(created_after=past, created_before=future) == {a.flow_run_id, b.flow_run_id}
    assert ids(created_before=past) == set()


# --- GetRunSupport ---------------------------------------------------------------------------


def test_support_read_shows_plan_state_step_and_checkpoint_metadata(
    servers: RunServers, client: RunClient
) -> None:
    pub, plans = _setup(servers, client)
    secret_free = "visible-only-as-digest"
    run = client.start(pub, flow="make_task", inputs={"recordId": secret_free}).run
    support = client.support(pub, run.flow_run_id)
    assert support.run == run
    assert support.plan.plan_id == plans["make_task"].plan_id
    assert support.plan.plan_digest == plans["make_task"].plan_digest
    assert support.plan.execution_profile == run.execution_profile
    assert support.current_step.step_execution_id == run.current_step_execution_id
    assert support.current_step.plan_step_key == run.compatibility.current_element
    assert [s.step_execution_id for s in support.steps] == [run.current_step_execution_id]
    assert list(support.attempts) == []
    cp = support.current_checkpoint
    assert cp.checkpoint_id == run.current_checkpoint_id and cp.context_digest
    assert secret_free not in str(support)  # metadata only, never the payload
    assert support.terminal_cause_code == ""


# --- DeleteRun / CancelRun -----------------------------------------------------------------


def test_delete_requires_the_delete_role(servers: RunServers, client: RunClient) -> None:
    pub, _ = _setup(servers, client)
    run = client.start(pub, flow="make_task").run
    md = client.creds(pub, roles=("flow.runs.cancel",))
    code, _ = _code(lambda: client.delete(pub, run.flow_run_id, md=md))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert client.get(pub, run.flow_run_id) == run  # nothing changed


def test_delete_is_idempotent_soft_delete_hidden_from_every_read(
    servers: RunServers, client: RunClient
) -> None:
    pub, _ = _setup(servers, client)
    kept = client.start(pub, flow="make_task").run
    run = client.start(pub, flow="make_task").run
    deleted = client.delete(pub, run.flow_run_id, expected=run.state_version)
    assert deleted.is_deleted and deleted.runtime_state == CANCEL_REQUESTED
    assert deleted.HasField("delete_requested_at")
    assert deleted.state_version > run.state_version
    again = client.delete(pub, run.flow_run_id, expected=run.state_version)
    assert again == deleted  # the same outcome, no second transition
    for read in (client.get, client.support):
        code, _ = _code(lambda r=read: r(pub, run.flow_run_id))
        assert code == grpc.StatusCode.NOT_FOUND
    assert [r.flow_run_id for r in client.list(pub).runs] == [kept.flow_run_id]
    code, _ = _code(lambda: client.cancel(pub, run.flow_run_id))
    assert code == grpc.StatusCode.NOT_FOUND
    (row,) = rows(servers.db_url, flow_runs, org_id=pub.scope[0], flow_run_id=run.flow_run_id)
    assert row["is_deleted"]  # lineage retained: soft delete, never a physical one


def test_delete_with_stale_expected_version_is_refused(
    servers: RunServers, client: RunClient
) -> None:
    pub, _ = _setup(servers, client)
    run = client.start(pub, flow="make_task").run
    code, detail = _code(lambda: client.delete(pub, run.flow_run_id, expected=99))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert detail.code == "state_version_mismatch"
    assert not client.get(pub, run.flow_run_id).is_deleted


def test_delete_of_terminal_run_only_hides_it(servers: RunServers, client: RunClient) -> None:
    pub, _ = _setup(servers, client, _output_flow())
    run_id = client.start(pub, flow="make_result", inputs={"recordId": "r"}).run.flow_run_id
    _finish(servers.db_url, pub.scope[0], run_id, {"result": "x"})
    deleted = client.delete(pub, run_id)
    assert deleted.is_deleted and deleted.runtime_state == SUCCEEDED
    assert client.delete(pub, run_id) == deleted


def test_cancel_is_idempotent(servers: RunServers, client: RunClient) -> None:
    pub, _ = _setup(servers, client)
    run = client.start(pub, flow="make_task").run
    cancelled = client.cancel(pub, run.flow_run_id)
    assert cancelled.runtime_state == CANCEL_REQUESTED and not cancelled.is_deleted
    assert client.cancel(pub, run.flow_run_id) == cancelled
    md = client.creds(pub, roles=())
    code, _ = _code(lambda: client.cancel(pub, run.flow_run_id, md=md))
    assert code == grpc.StatusCode.PERMISSION_DENIED


def test_cancel_of_succeeded_run_is_failed_precondition(
    servers: RunServers, client: RunClient
) -> None:
    pub, _ = _setup(servers, client, _output_flow())
    run_id = client.start(pub, flow="make_result", inputs={"recordId": "r"}).run.flow_run_id
    _finish(servers.db_url, pub.scope[0], run_id, {"result": "x"})
    code, detail = _code(lambda: client.cancel(pub, run_id))
    assert (code, detail.code) == (grpc.StatusCode.FAILED_PRECONDITION, "run_terminal")
    assert client.get(pub, run_id).runtime_state == SUCCEEDED
