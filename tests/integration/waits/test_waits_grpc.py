"""``WakeSignalService`` and the support read over gRPC, on SQLite and MariaDB, with the
production bootstrap (error mapping, credential verification, request-scope checks):
role and scope from the credential, bad input refused with nothing written, wrong-scope
reads answering exactly like missing ids, the effect-completion receipt contract with a
fake receipt, and the dependency correlation of ``GetRunSupport`` (§10.6, §19, §22.6)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.api.runs import build_run_service
from runtime_svc.api.signals import wake_signal_registration
from runtime_svc.kernel import CheckpointInput, FirstStep, RunState, StartRunRequest
from runtime_svc.kernel.decisions import EnterWait
from runtime_svc.kernel.store_waits import insert_dependency_txn, new_dependency_id
from runtime_svc.kernel.wait_model import (
    DependencyState,
    ExpiryPolicyCode,
    NewDependency,
    SignalState,
)
from runtime_svc.waits.evidence import evidence_digest
from runtime_svc.waits.support import consumed_signal_txn
from services import db
from services.auth import (
    CredentialVerifier,
    TrustedRuntimeWorkScope,
    WorkloadClaims,
    bearer_metadata,
    generate_keypair,
    mint_credential,
)
from services.config import ServiceName, load_config
from services.errors import FailedPreconditionError
from services.grpc_server import RunningServer, start_server
from services.proto import common_v1, runtime_v1
from tests.integration.definitions.harness import error_detail
from tests.integration.waits.support import (
    World,
    new_scope,
    signal_flow,
    signals,
    work_scope,
)
from tests.unit.compiler.compiler_corpus import read_flow

KEY_ID = "waits-test"
ROLE = "flow.signals.submit"


class _Bindings:
    """The persisted-binding check: only registered scopes have a binding."""

    def __init__(self) -> None:
        self.known: set[TrustedRuntimeWorkScope] = set()

    async def view_for(self, scope: TrustedRuntimeWorkScope) -> Any:
        if scope not in self.known:
            raise FailedPreconditionError(
                "the catalog has no binding for this work scope", reason="metadata_view_missing"
            )
        return None


@dataclass
class Api:
    world: World
    server: RunningServer
    channel: grpc.aio.Channel
    key: Any
    bindings: _Bindings

    @property
    def signals(self) -> Any:
        return runtime_v1.WakeSignalServiceStub(self.channel)

    @property
    def runs(self) -> Any:
        return runtime_v1.FlowRunServiceStub(self.channel)

    def md(
        self, scope: TrustedRuntimeWorkScope | None = None, roles: tuple[str, ...] = (ROLE,)
    ) -> Any:
        s = scope or self.world.scope
        claims = WorkloadClaims(
            subject="producer",
            audiences=(ServiceName.RUNTIME,),
            org_id=s.org_id,
            app_installation_id=s.app_installation_id,
            runtime_capability_id=s.runtime_capability_id,
            runtime_work_binding_digest=s.runtime_work_binding_digest,
            roles=roles,
        )
        return bearer_metadata(mint_credential(self.key, KEY_ID, claims, ttl_s=300))

    async def submit(self, md: Any = None, **fields: Any) -> Any:
        evidence = fields.pop("evidence", {"status": "approved"})
        body = {
            "request_id": uuid.uuid4().hex,
            "producer_kind": "external.signal",
            "producer_key": "approval:r1",
            "wake_token": "t1",
            "evidence_json": "" if evidence is None else json.dumps(evidence),
            "evidence_digest": "" if evidence is None else evidence_digest(evidence),
        }
        body.update(fields)
        return await self.signals.SubmitWakeSignal(
            runtime_v1.SubmitWakeSignalRequest(**body), metadata=md or self.md(), timeout=30
        )


@pytest.fixture
async def api(engine: AsyncEngine, world: World, tmp_path: Any) -> AsyncIterator[Api]:
    private, public = generate_keypair()
    cfg = load_config(
        ServiceName.RUNTIME,
        {
            "FLOW_ENV": "test",
            "FLOW_DATA_DIR": str(tmp_path),
            "FLOW_RUNTIME_PORT": "0",
            "FLOW_OTEL_ENABLED": "false",
        },
    )
    bindings = _Bindings()
    bindings.known.add(world.scope)
    registrations = [
        wake_signal_registration(world.rt.signals, bindings),
        await build_run_service(cfg, engine, store=world.store, synchronous_atomic=False),
    ]
    server = await start_server(
        cfg, registrations, verifier=CredentialVerifier({KEY_ID: public}, ServiceName.RUNTIME)
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Api(world, server, channel, private, bindings)
    finally:
        await channel.close()
        await server.stop(0)


async def _refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


async def test_submit_over_grpc_wakes_the_run_and_the_support_read_shows_the_dependency(
    api: Api,
) -> None:
    world = api.world
    await world.seed(signal_flow())
    run = await world.start("wait_signal", key="r1")
    await world.drive(run.flow_run_id)

    resp = await api.submit()
    assert not resp.duplicate and not resp.stale
    sig = resp.signal
    assert sig.org_id == world.org and sig.app_installation_id == world.scope.app_installation_id
    assert sig.resolution_state == common_v1.WakeSignalResolutionState.Value(
        "WAKE_SIGNAL_RESOLUTION_STATE_CONSUMED"
    )
    assert json.loads(sig.evidence_json) == {"status": "approved"}
    again = await api.submit()
    assert again.duplicate and again.signal.wake_signal_id == sig.wake_signal_id

    support = (
        await api.runs.GetRunSupport(
            runtime_v1.GetRunSupportRequest(org_id=world.org, flow_run_id=run.flow_run_id),
            metadata=api.md(),
            timeout=30,
        )
    ).support
    [dep] = support.dependencies
    assert dep.producer_kind == "external.signal" and dep.producer_key == "approval:r1"
    assert dep.plan_step_key == "pause"
    assert dep.state == common_v1.DependencyState.Value("DEPENDENCY_STATE_RESOLVED")
    assert dep.consumed_signal.wake_signal_id == sig.wake_signal_id
    assert dep.reconciliation_attempts == 0
    assert dep.age.ToTimedelta().total_seconds() >= 0
    assert dep.expiry_policy == common_v1.ExpiryPolicy.Value("EXPIRY_POLICY_TERMINAL_FAILURE")

    by_id = await api.signals.GetWakeSignal(
        runtime_v1.GetWakeSignalRequest(wake_signal_id=sig.wake_signal_id),
        metadata=api.md(),
        timeout=30,
    )
    by_key = await api.signals.GetWakeSignal(
        runtime_v1.GetWakeSignalRequest(
            key=runtime_v1.WakeSignalKey(
                producer_kind="external.signal", producer_key="approval:r1", wake_token="t1"
            )
        ),
        metadata=api.md(),
        timeout=30,
    )
    assert by_id.signal == by_key.signal
    assert by_id.signal.dependency_id == dep.dependency_id


async def test_a_retried_request_id_replays_the_original_answer(api: Api) -> None:
    """Issue 10 item 2: SubmitWakeSignal is deduplicated on request_id like every other
    mutating RPC (the wake token stays the durable delivery identity)."""
    world = api.world
    await world.seed(signal_flow())
    run = await world.start("wait_signal", key="r1")
    await world.drive(run.flow_run_id)

    first = await api.submit(request_id="req-1")
    assert not first.duplicate
    # The retry replays the original answer, not "duplicate token" (what a new request
    # with the same body gets).
    assert await api.submit(request_id="req-1") == first
    assert (await api.submit(request_id="req-2")).duplicate

    reused = await _refused(api.submit(request_id="req-1", wake_token="t2"))
    assert reused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(reused).code == "request_id_reused"
    assert len(await signals(world.engine, world.org)) == 1

    # Another installation of the org has its own request ids.
    other = new_scope(world.org, installation="inst-crm-2")
    api.bindings.known.add(other)
    theirs = await api.submit(md=api.md(other), request_id="req-1", wake_token="t9")
    assert not theirs.duplicate
    assert theirs.signal.app_installation_id == other.app_installation_id


async def test_wrong_scope_get_answers_exactly_like_a_missing_id(api: Api) -> None:
    world = api.world
    sig = (await api.submit()).signal
    other = new_scope(world.org, installation="inst-crm-2")
    api.bindings.known.add(other)

    foreign = await _refused(
        api.signals.GetWakeSignal(
            runtime_v1.GetWakeSignalRequest(wake_signal_id=sig.wake_signal_id),
            metadata=api.md(other),
            timeout=30,
        )
    )
    missing = await _refused(
        api.signals.GetWakeSignal(
            runtime_v1.GetWakeSignalRequest(wake_signal_id=sig.wake_signal_id + "x"),
            metadata=api.md(),
            timeout=30,
        )
    )
    assert foreign.code() == missing.code() == grpc.StatusCode.NOT_FOUND
    assert foreign.details().replace(sig.wake_signal_id, "ID") == missing.details().replace(
        sig.wake_signal_id + "x", "ID"
    )
    assert error_detail(foreign).code == error_detail(missing).code


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"producer_kind": "carrier.pigeon"}, "producer_kind"),
        ({"producer_kind": "record.change"}, "producer_kind"),
        ({"producer_kind": "runtime.timer"}, "producer_kind"),
        ({"wake_token": "t" * 129}, "wake_token"),
        ({"wake_token": ""}, "wake_token"),
        ({"producer_key": "k" * 201}, "producer_key"),
        ({"wake_version": -1}, "wake_version"),
        ({"evidence_digest": "sha256:nope"}, "evidence_digest"),
        ({"evidence_json": '{"status": "other"}'}, "evidence_digest"),
        ({"evidence_json": "[1, 2]"}, "evidence_json"),
        ({"evidence_json": json.dumps({"blob": "x" * 17_000})}, "evidence_json"),
        ({"evidence": {"password": "hunter2"}}, "evidence_json"),
        ({"request_id": ""}, "request_id"),
    ],
)
async def test_bad_input_is_refused_invalid_argument_and_writes_nothing(
    api: Api, fields: dict[str, Any], path: str
) -> None:
    err = await _refused(api.submit(**fields))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(err).field_path == path
    assert await signals(api.world.engine, api.world.org) == []


async def test_role_scope_and_binding_come_from_the_credential_never_the_body(api: Api) -> None:
    world = api.world
    no_role = await _refused(api.submit(md=api.md(roles=())))
    assert no_role.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_detail(no_role).code == "role_missing"

    other = new_scope(world.org, installation="inst-crm-2")
    body_scope = common_v1.TrustedRuntimeWorkScope(
        org_id=other.org_id,
        app_installation_id=other.app_installation_id,
        runtime_capability_id=other.runtime_capability_id,
        runtime_work_binding_digest=other.runtime_work_binding_digest,
    )
    mismatch = await _refused(api.submit(scope=body_scope))
    assert mismatch.code() == grpc.StatusCode.PERMISSION_DENIED

    org_only = WorkloadClaims(
        subject="producer", audiences=(ServiceName.RUNTIME,), org_id=world.org, roles=(ROLE,)
    )
    partial = await _refused(
        api.submit(md=bearer_metadata(mint_credential(api.key, KEY_ID, org_only, ttl_s=60)))
    )
    assert partial.code() == grpc.StatusCode.PERMISSION_DENIED

    unbound = await _refused(api.submit(md=api.md(new_scope(world.org, "inst-unbound"))))
    assert unbound.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert await signals(world.engine, world.org) == []


async def _waiting_completion(world: World, handoff: str) -> tuple[str, str]:
    """A run whose EffectCompletion step waits on ``handoff``, committed the way an
    EffectSubmit commit does: the ``EnterWait`` transition and the ``effect.completion``
    dependency in one transaction."""
    source = read_flow("durable_send_email")
    await world.seed(source)
    plan_id, plan = world.plans[source["api_name"]]
    result = await world.store.create_run(
        world.scope,
        StartRunRequest(
            plan_id=plan_id,
            first_step=FirstStep("welcome#completion", "EffectCompletion", "effect_completion"),
            input=CheckpointInput(context={"variables": {}}),
        ),
    )
    run_id = result.run.flow_run_id
    candidate = await world.store.candidate_for_run(world.org, run_id)
    assert candidate is not None
    fence = await world.store.claim(world.org, candidate, lease_owner="effects-test")
    fence = await world.store.mark_running(world.org, fence)  # type: ignore[arg-type]
    dep_id = new_dependency_id()
    async with db.transaction(world.engine) as conn:
        now = await world.clock(conn)
        await world.store.commit_step_txn(
            conn, world.org, fence, output=CheckpointInput({"variables": {}}), advance=EnterWait()
        )
        await insert_dependency_txn(
            conn,
            work_scope(world.scope),
            NewDependency(
                dependency_id=dep_id,
                flow_run_id=run_id,
                step_execution_id=fence.step_execution_id,
                producer_kind="effect.completion",
                producer_key=handoff,
                condition_digest=plan.step("welcome#completion").dependency.condition_digest,  # type: ignore[union-attr]
                deadline=now.replace(year=now.year + 1),
                next_probe_at=None,
                expiry_policy=ExpiryPolicyCode.FAULT_PATH,
            ),
            now,
        )
    return run_id, fence.step_execution_id


def _receipt(handoff: str, **over: Any) -> dict[str, Any]:
    evidence = {
        "command_id": "cmd-1",
        "outcome_version": 1,
        "outcome": "SUCCEEDED",
        "safe_error_code": "",
        "result_digest": "result/v1:sha256:" + "0" * 64,
        "effect_owner_kind": "runtime_delivery",
        "effect_handoff_key": handoff,
    }
    evidence.update(over)
    return evidence


async def test_effect_completion_receipt_through_the_public_rpc_resolves_the_completion(
    api: Api,
) -> None:
    world = api.world
    handoff = f"{world.org}/run/welcome#submit/0"
    run_id, step_id = await _waiting_completion(world, handoff)

    # Contract violations are refused, nothing written.
    for fields in (
        {"wake_token": "cmd-1/2"},  # token is <command_id>/<outcome_version>
        {"evidence": _receipt(handoff, outcome_version=2)},  # evidence != envelope
        {"evidence": _receipt("other-key")},  # handoff key != producer key
        {"evidence": _receipt(handoff, outcome="MAYBE")},
        {"evidence": {"command_id": "cmd-1"}},  # fields missing
        {"evidence": None},  # a receipt needs evidence
        {"wake_version": 0},
    ):
        body = {"wake_token": "cmd-1/1", "wake_version": 1, "evidence": _receipt(handoff)}
        body.update(fields)
        err = await _refused(
            api.submit(producer_kind="effect.completion", producer_key=handoff, **body)
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
    assert await signals(world.engine, world.org) == []

    resp = await api.submit(
        producer_kind="effect.completion",
        producer_key=handoff,
        wake_token="cmd-1/1",
        wake_version=1,
        evidence=_receipt(handoff),
    )
    assert resp.signal.wake_version == 1
    run = await world.run(run_id)
    assert run.state is RunState.RUNNABLE
    # The completion step reads the consumed receipt when it resumes (§15.2).
    async with db.transaction(world.engine, readonly=True) as conn:
        found = await consumed_signal_txn(conn, world.org, step_id)
    assert found is not None
    dep, signal = found
    assert dep.state is DependencyState.RESOLVED and signal is not None
    assert signal.state is SignalState.CONSUMED
    assert json.loads(signal.evidence_json or "{}")["outcome"] == "SUCCEEDED"
    # A later outcome version arrives after consumption: accepted, unmatched, harmless.
    late = await api.submit(
        producer_kind="effect.completion",
        producer_key=handoff,
        wake_token="cmd-1/2",
        wake_version=2,
        evidence=_receipt(handoff, outcome_version=2, outcome="FAILED"),
    )
    assert late.signal.resolution_state == common_v1.WakeSignalResolutionState.Value(
        "WAKE_SIGNAL_RESOLUTION_STATE_UNMATCHED"
    )
    # A stale version (1 again, another token) is a no-op answered with the newer one.
    stale = await api.submit(
        producer_kind="effect.completion",
        producer_key=handoff,
        wake_token="cmd-0/1",
        wake_version=1,
        evidence=_receipt(handoff, command_id="cmd-0"),
    )
    assert stale.stale and stale.signal.wake_token == "cmd-1/2"
