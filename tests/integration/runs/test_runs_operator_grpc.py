"""Operator controls through the gRPC API (issue 14 item 5) on SQLite and MariaDB:
``PauseRun``/``ResumeRun``/``RetryQuarantinedRun`` need ``flow.runs.operate``
(PERMISSION_DENIED otherwise, nothing written), compare a presence-aware expected version
in the store's compare-and-swap, refuse terminal runs, replay a retried ``request_id`` and
refuse its reuse with another body, and write one audit record per decision naming the
caller."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from google.protobuf.wrappers_pb2 import Int64Value

from runtime_svc.kernel import (
    AttemptOutcome,
    FailureClass,
    FlowRunStateStore,
    LeaseFence,
    StepFailure,
)
from runtime_svc.kernel.decisions import Quarantined
from runtime_svc.schema import audit_records, runtime_requests
from services import db
from services.proto import common_v1, runtime_v1
from tests.integration.definitions import flows
from tests.integration.definitions.harness import (
    KEY_ID,
    error_detail,
    new_org,
    new_request_id,
    rows,
)
from tests.integration.runs.harness import (
    ALL_ROLES,
    RunClient,
    RunServers,
    publish_and_activate,
)
from tests.support.procs import ROOT

OPERATE = (*ALL_ROLES, "flow.runs.operate")
RUNNABLE = common_v1.RunState.RUN_STATE_RUNNABLE
QUARANTINED = common_v1.RunState.RUN_STATE_QUARANTINED
TERMINAL_FAILED = common_v1.RunState.RUN_STATE_TERMINAL_FAILED
PAUSED = common_v1.CompatibilityStatus.COMPATIBILITY_STATUS_PAUSED
RUNNING = common_v1.CompatibilityStatus.COMPATIBILITY_STATUS_RUNNING


def _setup(servers: RunServers, client: RunClient) -> Any:
    pub, _ = publish_and_activate(servers, client, new_org(), [flows.task_flow()])
    return pub


def _code(fn: Any) -> tuple[grpc.StatusCode, Any]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), error_detail(err.value)  # type: ignore[attr-defined]


def _request(cls: Any, pub: Any, run_id: str, **kw: Any) -> Any:
    expected = kw.pop("expected", None)
    req = cls(request_id=new_request_id(), org_id=pub.scope[0], flow_run_id=run_id, **kw)
    if expected is not None:
        req.expected_state_version.CopyFrom(Int64Value(value=expected))
    return req


def _pause(client: RunClient, pub: Any, req: Any, roles: Any = OPERATE) -> Any:
    return client.runs.PauseRun(req, metadata=client.creds(pub, roles=roles), timeout=30)


def _resume(client: RunClient, pub: Any, req: Any) -> Any:
    return client.runs.ResumeRun(req, metadata=client.creds(pub, roles=OPERATE), timeout=30)


def _retry(client: RunClient, pub: Any, req: Any, roles: Any = OPERATE) -> Any:
    md = client.creds(pub, roles=roles)
    return client.runs.RetryQuarantinedRun(req, metadata=md, timeout=30)


def _audit(servers: RunServers, org: str, run_id: str) -> list[dict[str, Any]]:
    found = rows(servers.db_url, audit_records, org_id=org, flow_run_id=run_id)
    return sorted(found, key=lambda a: a["occurred_at"])


def _quarantine(db_url: str, org: str, run_id: str) -> None:
    """Claim and run the run's step, then lose its COMMIT (a commit-unknown quarantine)."""

    async def main() -> None:
        engine = db.create_engine(db_url, pool_size=2)
        try:
            store = FlowRunStateStore(engine)
            candidate = await store.candidate_for_run(org, run_id)
            assert candidate is not None
            fence = await store.claim(org, candidate, lease_owner="grpc-test")
            assert isinstance(fence, LeaseFence)
            fence = await store.mark_running(org, fence)
            assert isinstance(await store.quarantine_commit_unknown(org, fence), Quarantined)
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_pause_and_resume_need_the_operate_role_and_are_audited(
    servers: RunServers, client: RunClient
) -> None:
    pub = _setup(servers, client)
    org = pub.scope[0]
    run = client.start(pub, flow="make_task").run
    req = _request(runtime_v1.PauseRunRequest, pub, run.flow_run_id, reason="INC-9")
    code, detail = _code(lambda: _pause(client, pub, req, roles=ALL_ROLES))
    assert (code, detail.code) == (grpc.StatusCode.PERMISSION_DENIED, "role_missing")
    assert not client.get(pub, run.flow_run_id).HasField("operator_paused_at")
    assert not rows(servers.db_url, runtime_requests, org_id=org, rpc_name="PauseRun")

    paused = _pause(client, pub, req).run
    assert paused.HasField("operator_paused_at") and paused.runtime_state == RUNNABLE
    assert paused.compatibility.status == PAUSED
    assert paused.state_version == run.state_version  # an overlay: no version bump
    again = _pause(client, pub, _request(runtime_v1.PauseRunRequest, pub, run.flow_run_id)).run
    assert again.operator_paused_at == paused.operator_paused_at  # idempotent
    resumed = _resume(client, pub, _request(runtime_v1.ResumeRunRequest, pub, run.flow_run_id))
    assert not resumed.run.HasField("operator_paused_at")
    assert resumed.run.compatibility.status == RUNNING
    audits = _audit(servers, org, run.flow_run_id)
    assert [(a["actor_kind"], a["actor_id"], a["action"]) for a in audits] == [
        ("operator", "runs-test", "flow_run.pause"),
        ("operator", "runs-test", "flow_run.resume"),
    ]
    assert json.loads(audits[0]["details"])["reason"] == "INC-9"


def test_request_id_replays_and_refuses_reuse_with_another_body(
    servers: RunServers, client: RunClient
) -> None:
    pub = _setup(servers, client)
    run_id = client.start(pub, flow="make_task").run.flow_run_id
    req = _request(runtime_v1.PauseRunRequest, pub, run_id)
    first = _pause(client, pub, req)
    _resume(client, pub, _request(runtime_v1.ResumeRunRequest, pub, run_id))
    assert _pause(client, pub, req) == first  # the original response, not a new pause
    assert not client.get(pub, run_id).HasField("operator_paused_at")
    other = runtime_v1.PauseRunRequest()
    other.CopyFrom(req)
    other.reason = "another body"
    code, detail = _code(lambda: _pause(client, pub, other))
    assert (code, detail.code) == (grpc.StatusCode.INVALID_ARGUMENT, "request_id_reused")


def test_stale_expected_version_and_terminal_runs_write_nothing(
    servers: RunServers, client: RunClient
) -> None:
    pub = _setup(servers, client)
    org = pub.scope[0]
    run = client.start(pub, flow="make_task").run
    stale = _request(
        runtime_v1.PauseRunRequest, pub, run.flow_run_id, expected=run.state_version + 1
    )
    code, detail = _code(lambda: _pause(client, pub, stale))
    assert (code, detail.code) == (grpc.StatusCode.FAILED_PRECONDITION, "state_version_mismatch")
    exact = _request(runtime_v1.PauseRunRequest, pub, run.flow_run_id, expected=0)
    assert _pause(client, pub, exact).run.HasField("operator_paused_at")  # 0 is expressible

    client.cancel(pub, run.flow_run_id)
    code, detail = _code(
        lambda: _pause(client, pub, _request(runtime_v1.PauseRunRequest, pub, run.flow_run_id))
    )
    assert (code, detail.code) == (grpc.StatusCode.FAILED_PRECONDITION, "run_cancelling")
    code, detail = _code(
        lambda: _retry(
            client,
            pub,
            _request(runtime_v1.RetryQuarantinedRunRequest, pub, run.flow_run_id, reason="x"),
        )
    )
    assert (code, detail.code) == (grpc.StatusCode.FAILED_PRECONDITION, "not_quarantined")
    code, _ = _code(
        lambda: _pause(client, pub, _request(runtime_v1.PauseRunRequest, pub, "run-missing"))
    )
    assert code == grpc.StatusCode.NOT_FOUND
    assert [a["action"] for a in _audit(servers, org, run.flow_run_id)] == ["flow_run.pause"]


def test_retry_quarantined_is_an_explicit_audited_decision(
    servers: RunServers, client: RunClient
) -> None:
    pub = _setup(servers, client)
    org = pub.scope[0]
    run_id = client.start(pub, flow="make_task").run.flow_run_id
    _quarantine(servers.db_url, org, run_id)
    quarantined = client.get(pub, run_id)
    assert quarantined.runtime_state == QUARANTINED

    no_reason = _request(runtime_v1.RetryQuarantinedRunRequest, pub, run_id)
    code, detail = _code(lambda: _retry(client, pub, no_reason))
    assert (code, detail.field_path) == (grpc.StatusCode.INVALID_ARGUMENT, "reason")
    req = _request(
        runtime_v1.RetryQuarantinedRunRequest,
        pub,
        run_id,
        reason="INC-3: marker shows no commit",
        expected=quarantined.state_version,
    )
    code, detail = _code(lambda: _retry(client, pub, req, roles=ALL_ROLES))
    assert (code, detail.code) == (grpc.StatusCode.PERMISSION_DENIED, "role_missing")
    stale = _request(
        runtime_v1.RetryQuarantinedRunRequest,
        pub,
        run_id,
        reason="x",
        expected=quarantined.state_version + 1,
    )
    code, detail = _code(lambda: _retry(client, pub, stale))
    assert (code, detail.code) == (grpc.StatusCode.FAILED_PRECONDITION, "state_version_mismatch")
    assert client.get(pub, run_id).runtime_state == QUARANTINED

    retried = _retry(client, pub, req)
    assert retried.run.runtime_state == RUNNABLE
    assert _retry(client, pub, req) == retried  # a retried request replays
    [audit] = _audit(servers, org, run_id)
    details = json.loads(audit["details"])
    assert (audit["actor_id"], audit["action"]) == ("runs-test", "reconcile_quarantine")
    assert (details["reason"], details["resolution"], details["request_rpc"]) == (
        "INC-3: marker shows no commit",
        "retry",
        "RetryQuarantinedRun",
    )


def _fail(db_url: str, org: str, run_id: str) -> None:
    """Claim and run the run's step, then fail it terminally (a proven rollback)."""

    async def main() -> None:
        engine = db.create_engine(db_url, pool_size=2)
        try:
            store = FlowRunStateStore(engine)
            candidate = await store.candidate_for_run(org, run_id)
            assert candidate is not None
            fence = await store.claim(org, candidate, lease_owner="grpc-test")
            assert isinstance(fence, LeaseFence)
            fence = await store.mark_running(org, fence)
            failure = StepFailure(FailureClass.TERMINAL, "boom", AttemptOutcome.ROLLED_BACK)
            await store.record_rollback(org, fence, failure)
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_restart_from_checkpoint_runs_a_failed_run_again(
    servers: RunServers, client: RunClient
) -> None:
    pub = _setup(servers, client)
    org = pub.scope[0]
    run_id = client.start(pub, flow="make_task").run.flow_run_id
    _fail(servers.db_url, org, run_id)
    failed = client.get(pub, run_id)
    assert failed.runtime_state == TERMINAL_FAILED
    [step] = client.support(pub, run_id).steps
    checkpoint = step.input_checkpoint_id

    def restart(roles: Any = OPERATE, **kw: Any) -> Any:
        req = _request(runtime_v1.RestartFromCheckpointRequest, pub, run_id, **kw)
        md = client.creds(pub, roles=roles)
        return client.runs.RestartFromCheckpoint(req, metadata=md, timeout=30)

    code, detail = _code(lambda: restart(roles=ALL_ROLES, checkpoint_id=checkpoint, reason="r"))
    assert (code, detail.code) == (grpc.StatusCode.PERMISSION_DENIED, "role_missing")
    code, detail = _code(lambda: restart(checkpoint_id=checkpoint))
    assert (code, detail.field_path) == (grpc.StatusCode.INVALID_ARGUMENT, "reason")
    code, _ = _code(lambda: restart(checkpoint_id="ckpt_missing", reason="r"))
    assert code == grpc.StatusCode.NOT_FOUND
    stale = failed.state_version + 1
    code, detail = _code(lambda: restart(checkpoint_id=checkpoint, reason="r", expected=stale))
    assert (code, detail.code) == (grpc.StatusCode.FAILED_PRECONDITION, "state_version_mismatch")
    assert client.get(pub, run_id).runtime_state == TERMINAL_FAILED

    again = restart(checkpoint_id=checkpoint, reason="INC-4", expected=failed.state_version).run
    assert again.runtime_state == RUNNABLE and not again.terminal_cause_code
    assert again.current_step_execution_id != step.step_execution_id
    steps = {s.step_execution_id: s for s in client.support(pub, run_id).steps}
    assert steps[step.step_execution_id].state == step.state  # history kept
    code, detail = _code(lambda: restart(checkpoint_id=checkpoint, reason="again"))
    assert (code, detail.code) == (grpc.StatusCode.FAILED_PRECONDITION, "run_not_failed")
    assert [a["action"] for a in _audit(servers, org, run_id)] == ["flow_run.restart"]


def test_flowctl_run_operator_commands(
    servers: RunServers, client: RunClient, tmp_path: Path
) -> None:
    """``flowctl run pause|resume|retry-quarantined|restart`` as a real subprocess: it mints its
    credential with ``flow.runs.operate``; a refusal is one line and exit 1."""
    pub = _setup(servers, client)
    run_id = client.start(pub, flow="make_task").run.flow_run_id
    key_file = tmp_path / "signing.pem"
    key_file.write_bytes(
        servers.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_")}
    env |= {
        "FLOW_DATA_DIR": str(tmp_path),
        "FLOW_AUTH_SIGNING_KEY": str(key_file),
        "FLOW_AUTH_SIGNING_KEY_ID": KEY_ID,
    }
    org, inst, cap, binding = (*pub.scope, None, None, None)[:4]
    scope = ["--target", f"127.0.0.1:{servers.runtime_port}", "--org", org]
    for flag, value in (
        ("--app-installation", inst),
        ("--capability", cap),
        ("--binding-digest", binding),
    ):
        if value:
            scope += [flag, value]

    def flowctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "flowctl", "run", *args[:1], run_id, *scope, *args[1:]],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    paused = flowctl("pause", "--reason", "INC-5", "--json")
    assert paused.returncode == 0, paused.stderr
    assert json.loads(paused.stdout)["operator_paused_at"]
    assert client.get(pub, run_id).compatibility.status == PAUSED
    resumed = flowctl("resume", "--expected-version", "0")
    assert resumed.returncode == 0, resumed.stderr
    assert "paused since" in resumed.stdout and run_id in resumed.stdout
    assert not client.get(pub, run_id).HasField("operator_paused_at")
    refused = flowctl("retry-quarantined", "--reason", "INC-6")
    assert refused.returncode == 1
    assert "not_quarantined" in refused.stderr and "Traceback" not in refused.stderr
    missing = flowctl("retry-quarantined")
    assert missing.returncode == 2 and "--reason" in missing.stderr
    checkpoint = client.get(pub, run_id).current_checkpoint_id
    active = flowctl("restart", "--checkpoint", checkpoint, "--reason", "INC-7")
    assert active.returncode == 1 and "run_not_failed" in active.stderr
