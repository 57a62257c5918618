"""One trace per run across the three services, and ``/metrics`` of every process
(issue 14, items 1-2): catalog, runtime and effect owner run as child processes, export
their spans over OTLP/gRPC to a collector this test runs, and serve Prometheus metrics on
ports they pick themselves (``FLOW_METRICS_PORT=0``, read from their logs).

The test process is the client: its own spans (the SDK's in-memory exporter) and the
client interceptors put the W3C ``traceparent`` on every call, so the demo run below —
AwaitApproval (a record write, a durable wait, a record write), started with ``StartRun``
and resumed by an effect owner's completion receipt — is one trace from the test's root
span through:

    StartRun → flow.run.accept → flow.step.attempt (→ catalog call) → … wait entered
    → outbox.deliver (runtime) → AcceptHandoff (owner) → effect.handoff.accept
    → effect.command.dispatch → effect.provider.call (SMTP) → outbox.deliver (owner)
    → SubmitWakeSignal (runtime) → flow.wait.resolve → flow.step.attempt (resumed) → done

and the after-save hop (a Contact write whose WelcomeContact run continues the write's
trace). Until the runtime's EffectSubmit step exists on this branch, a clearly marked
stand-in does exactly what that step's transaction does — enqueue the
``flow.effect.submit`` message inside a span of the run's trace, and point the waiting
dependency at the handoff key — everything after it is the real code.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf.struct_pb2 import Struct
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select, update

from flowctl.demo import DEMO_FLOWS, seed
from runtime_svc.outbox import effect_submit_intent, enqueue_effect_submit_txn
from runtime_svc.schema import flow_dependencies, flow_runs, flow_step_attempts
from services import db
from services.auth import (
    TrustedRuntimeWorkScope,
    WorkloadClaims,
    ensure_dev_keys,
    load_signing_key,
    mint_credential,
)
from services.config import ServiceName, load_config
from services.proto import common_v1, runtime_v1
from services.telemetry import extract_context
from tests.support.effect_servers import ScriptedMailSink, mail_sink
from tests.support.metrics import SECTION_19, Scrape, metrics_port_from_log, scrape
from tests.support.otlp import Collected, collected_from_sdk, otlp_collector
from tests.support.procs import ServiceProcess, free_port, service_env

pytestmark = pytest.mark.e2e

_DEADLINE_S = 90.0
WAITING = common_v1.RunState.RUN_STATE_WAITING
SUCCEEDED = common_v1.RunState.RUN_STATE_SUCCEEDED
TERMINAL = {
    common_v1.RunState.RUN_STATE_SUCCEEDED,
    common_v1.RunState.RUN_STATE_TERMINAL_FAILED,
    common_v1.RunState.RUN_STATE_QUARANTINED,
    common_v1.RunState.RUN_STATE_CANCELLED,
}


async def eventually(check: Callable[[], Any], *, what: str, timeout_s: float = _DEADLINE_S) -> Any:
    """Poll ``check`` (sync or async) until it returns a truthy value (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: Any = None
    while loop.time() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@dataclass
class Stack:
    """The three children, the collector and what the client needs."""

    data_dir: Path
    children: dict[str, ServiceProcess]
    collector: Any
    sink: ScriptedMailSink
    demo: Any

    @property
    def runtime_target(self) -> str:
        return f"127.0.0.1:{self.children['runtime'].port}"

    def scope(self) -> TrustedRuntimeWorkScope:
        return TrustedRuntimeWorkScope(
            self.demo.org_id,
            self.demo.app_installation_id,
            self.demo.runtime_capability_id,
            self.demo.binding_digest,
        )

    def md(self) -> list[tuple[str, str]]:
        key = load_signing_key(self.data_dir / "auth" / "dev_signing_key.pem")
        s = self.scope()
        claims = WorkloadClaims(
            subject="telemetry-e2e",
            audiences=(ServiceName.RUNTIME,),
            org_id=s.org_id,
            app_installation_id=s.app_installation_id,
            runtime_capability_id=s.runtime_capability_id,
            runtime_work_binding_digest=s.runtime_work_binding_digest,
        )
        return [("authorization", f"Bearer {mint_credential(key, 'dev', claims, ttl_s=600)}")]

    def runtime_db(self) -> str:
        return f"sqlite+aiosqlite:///{self.data_dir / 'runtime.db'}"


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    ensure_dev_keys(data_dir, env="test", key_id="dev")
    ports = {name: free_port() for name in ("catalog", "runtime", "effect-owner")}
    sink = ScriptedMailSink()
    async with otlp_collector() as (collector, collector_port), mail_sink(sink) as smtp_port:
        common = {
            "FLOW_CATALOG_PORT": str(ports["catalog"]),
            "FLOW_RUNTIME_PORT": str(ports["runtime"]),
            "FLOW_EFFECT_PORT": str(ports["effect-owner"]),
            "FLOW_CATALOG_TARGET": f"127.0.0.1:{ports['catalog']}",
            "FLOW_EFFECT_SMTP_PORT": str(smtp_port),
            "FLOW_OTEL_ENABLED": "true",
            "FLOW_OTEL_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "FLOW_METRICS_PORT": "0",
            "FLOW_METRICS_STATE_MS": "300",
            "FLOW_RUNTIME_IDLE_MS": "100",
            "FLOW_RUNTIME_WAIT_SWEEP_MS": "200",
            "FLOW_OUTBOX_IDLE_MS": "100",
            "FLOW_OUTBOX_RETRY_BASE_MS": "50",
            "FLOW_OUTBOX_RETRY_MAX_MS": "400",
            "FLOW_EFFECT_IDLE_MS": "100",
            "FLOW_EFFECT_RETRY_BASE_MS": "50",
            "FLOW_EFFECT_RETRY_MAX_MS": "400",
        }
        children = {
            name: ServiceProcess(
                name,
                port,
                service_env(data_dir, name, port, extra=common),
                tmp_path / f"{name}.log",
            )
            for name, port in ports.items()
        }
        try:
            for child in children.values():
                child.start()
            for child in children.values():
                await asyncio.to_thread(child.wait_serving, 90.0)
            env = children["runtime"].env
            configs = {svc: load_config(svc, env) for svc in ServiceName}
            # AwaitApproval and WelcomeContact (the Contact write's after-save Flow).
            demo = await asyncio.to_thread(seed, configs, data_dir, flow_files=DEMO_FLOWS)
            # Seeding started a waiting run, which filled the runtime's catalog caches: a
            # fresh process makes the demo run's own attempts call the catalog.
            runtime = children["runtime"]
            await asyncio.to_thread(runtime.terminate)
            runtime.start()
            await asyncio.to_thread(runtime.wait_serving, 90.0)
            yield Stack(data_dir, children, collector, sink, demo)
        finally:
            for child in children.values():
                if child.proc is not None and child.proc.poll() is None:
                    await asyncio.to_thread(child.terminate)


def _struct(**values: Any) -> Struct:
    s = Struct()
    s.update(values)
    return s


async def _run(stub: Any, md: Any, run_id: str) -> Any:
    return (
        await stub.GetRun(runtime_v1.GetRunRequest(flow_run_id=run_id), metadata=md, timeout=20)
    ).run


async def _effect_submit_stand_in(
    stack: Stack, run_id: str, tracer: trace.Tracer
) -> tuple[str, str]:
    """What the runtime's EffectSubmit step transaction does (see the module docstring):
    in a span of the run's trace, point the waiting dependency at the handoff key and
    enqueue the ``flow.effect.submit`` message; returns (message id, stand-in span id)."""
    engine = db.create_engine(stack.runtime_db(), pool_size=2)
    try:
        r, d, a = flow_runs.c, flow_dependencies.c, flow_step_attempts.c
        async with db.transaction(engine, readonly=True) as conn:
            run_row = (
                await conn.execute(
                    select(r.trace_context, r.current_step_execution_id).where(
                        r.org_id == stack.demo.org_id, r.flow_run_id == run_id
                    )
                )
            ).one()
            attempt_id = (
                await conn.execute(
                    select(a.attempt_id)
                    .where(a.org_id == stack.demo.org_id, a.step_execution_id == run_row[1])
                    .order_by(a.attempt_number.desc())
                    .limit(1)
                )
            ).scalar_one()
        intent = effect_submit_intent(
            stack.scope(),
            flow_run_id=run_id,
            submit_step_key="await_approval#submit",
            invocation_ordinal=0,
            step_execution_id=str(run_row[1]),
            submission_attempt_id=str(attempt_id),
            effect_owner_kind="email.smtp",
            payload={"to": "approver@example.com", "template": "contact_welcome"},
            deadline=datetime.now(UTC) + timedelta(days=1),
            failure_policy="fault_path",
        )
        with tracer.start_as_current_span(
            "test.effect_submit_stand_in", context=extract_context(run_row[0])
        ) as current:
            async with db.transaction(engine) as conn:
                await conn.execute(
                    update(flow_dependencies)
                    .where(d.org_id == stack.demo.org_id, d.flow_run_id == run_id)
                    .values(producer_kind="effect.completion", producer_key=intent.handoff_key)
                )
            async with db.transaction(engine) as conn:
                await enqueue_effect_submit_txn(conn, intent)
            span_id = trace.format_span_id(current.get_span_context().span_id)
        return intent.message_id, span_id
    finally:
        await engine.dispose()


def _by_id(spans: list[Collected]) -> dict[str, Collected]:
    return {s.span_id: s for s in spans}


def _one(spans: list[Collected], name: str, **attrs: Any) -> Collected:
    found = [
        s
        for s in spans
        if s.name == name and all(s.attributes.get(k) == v for k, v in attrs.items())
    ]
    assert len(found) == 1, (name, attrs, [(s.service, s.name) for s in found])
    return found[0]


def _parent(spans: Mapping[str, Collected], span: Collected) -> Collected:
    assert span.parent_span_id, f"{span.service} {span.name} has no parent"
    assert span.parent_span_id in spans, f"the parent of {span.name} was not collected"
    return spans[span.parent_span_id]


async def test_one_trace_across_the_three_services_for_a_demo_run(stack: Stack) -> None:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "telemetry-e2e"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("tests.e2e")
    md = stack.md()
    channel = grpc.aio.insecure_channel(
        stack.runtime_target,
        interceptors=aio_client_interceptors(tracer_provider=provider),
    )
    scope_proto = common_v1.TrustedRuntimeWorkScope(
        org_id=stack.demo.org_id,
        app_installation_id=stack.demo.app_installation_id,
        runtime_capability_id=stack.demo.runtime_capability_id,
        runtime_work_binding_digest=stack.demo.binding_digest,
    )
    async with channel:
        runs = runtime_v1.FlowRunServiceStub(channel)
        records = runtime_v1.RecordServiceStub(channel)
        with tracer.start_as_current_span("e2e.demo") as root:
            trace_id = trace.format_trace_id(root.get_span_context().trace_id)
            request = uuid.uuid4().hex[:8]
            started = await runs.StartRun(
                runtime_v1.StartRunRequest(
                    request_id=uuid.uuid4().hex,
                    flow=runtime_v1.FlowVersionSelector(flow_api_name="AwaitApproval"),
                    input_variables=_struct(requestId=request, subject="telemetry"),
                ),
                metadata=md,
                timeout=30,
            )
            run_id = started.run.flow_run_id
            created = await records.CreateRecord(
                runtime_v1.CreateRecordRequest(
                    request_id=uuid.uuid4().hex,
                    scope=scope_proto,
                    object_api_name="Contact",
                    fields=_struct(FirstName="Ada", LastName="Lovelace", Email="ada@example.com"),
                ),
                metadata=md,
                timeout=30,
            )
        [welcome_run] = list(created.triggered_flow_run_ids)

        async def waiting() -> bool:
            return bool((await _run(runs, md, run_id)).runtime_state == WAITING)

        await eventually(waiting, what="the demo run to reach its wait")
        message_id, stand_in = await _effect_submit_stand_in(stack, run_id, tracer)

        async def succeeded() -> Any:
            run = await _run(runs, md, run_id)
            assert run.runtime_state not in TERMINAL - {SUCCEEDED}, run
            return run if run.runtime_state == SUCCEEDED else None

        run = await eventually(succeeded, what="the owner's receipt to resume the run")
        await eventually(
            lambda: _run_terminal(runs, md, welcome_run), what="the WelcomeContact run to end"
        )
        support = (
            await runs.GetRunSupport(
                runtime_v1.GetRunSupportRequest(org_id=stack.demo.org_id, flow_run_id=run_id),
                metadata=md,
                timeout=30,
            )
        ).support
    provider.shutdown()
    # The provider call really happened, once (the stand-in's message goes to
    # approver@example.com).
    welcome = [m for m in stack.sink.received if m.rcpt_tos == ("ada@example.com",)]
    assert len(welcome) == 1

    # --- the run and its attempts carry the trace identity (§19) -------------------------
    assert run.trace_id == trace_id
    assert len(support.attempts) >= 3
    assert {a.trace_id for a in support.attempts} == {trace_id}

    # --- every hop, one trace ------------------------------------------------------------
    def collected() -> list[Collected]:
        return [s for s in stack.collector.spans if s.trace_id == trace_id]

    def complete() -> bool:
        names = {(s.service, s.name) for s in collected()}
        return {
            ("nexus-flow-runtime", "flow.wait.resolve"),
            ("nexus-flow-effect-owner", "effect.provider.call"),
            ("nexus-flow-catalog", "/nexus.flow.catalog.v1.CatalogService/GetWorkBinding"),
        } <= names and sum(
            1
            for s in collected()
            if s.name == "flow.step.attempt" and s.attributes.get("nexus.flow.run_id") == run_id
        ) >= len(support.attempts)

    await eventually(complete, what="every service's spans at the collector")
    mine = collected_from_sdk(memory.get_finished_spans(), "telemetry-e2e")
    # The test's own spans of the run (polls outside the root span are traces of their own).
    stand_in_span = _one(mine, "test.effect_submit_stand_in")
    assert (stand_in_span.trace_id, stand_in_span.span_id) == (trace_id, stand_in)
    spans = collected() + [s for s in mine if s.trace_id == trace_id]
    assert {s.service for s in spans} >= {
        "telemetry-e2e",
        "nexus-flow-catalog",
        "nexus-flow-runtime",
        "nexus-flow-effect-owner",
    }
    by_id = _by_id(spans)
    start_client = _one(
        [s for s in spans if s.service == "telemetry-e2e"],
        "/nexus.flow.runtime.v1.FlowRunService/StartRun",
    )
    start_server = _one(
        [s for s in spans if s.service == "nexus-flow-runtime"],
        "/nexus.flow.runtime.v1.FlowRunService/StartRun",
    )
    assert (start_server.kind, _parent(by_id, start_server)) == ("server", start_client)
    accept = _one(spans, "flow.run.accept", **{"nexus.flow.run_id": run_id})
    assert _parent(by_id, accept) == start_server
    attempts = [
        s
        for s in spans
        if s.name == "flow.step.attempt" and s.attributes["nexus.flow.run_id"] == run_id
    ]
    assert {_parent(by_id, s).span_id for s in attempts} == {accept.span_id}
    assert {s.attributes["nexus.flow.attempt_id"] for s in attempts} == {
        a.attempt_id for a in support.attempts
    }
    # The worker's first record write validated against the catalog's view: the catalog
    # answered inside an attempt of this run.
    catalog = [s for s in spans if s.service == "nexus-flow-catalog"]
    assert catalog
    for s in catalog:
        client = _parent(by_id, s)
        assert (s.kind, client.service, client.kind) == ("server", "nexus-flow-runtime", "client")

    # Asynchronous hop 1: outbox → owner acceptance → provider → receipt.
    deliver = _one(spans, "outbox.deliver", **{"nexus.flow.message_id": message_id})
    assert (deliver.service, _parent(by_id, deliver).span_id) == ("nexus-flow-runtime", stand_in)
    owner_accept = _one(
        spans, "effect.handoff.accept", **{"nexus.flow.runtime_outbox_message_id": message_id}
    )
    accept_server = _parent(by_id, owner_accept)
    assert (accept_server.service, accept_server.kind) == ("nexus-flow-effect-owner", "server")
    assert accept_server.name == "/nexus.flow.effect.v1.EffectOwnerService/AcceptHandoff"
    accept_client = _parent(by_id, accept_server)
    assert (accept_client.service, accept_client.kind) == ("nexus-flow-runtime", "client")
    assert _parent(by_id, accept_client) == deliver
    dispatch = [
        s
        for s in spans
        if s.name == "effect.command.dispatch" and s.parent_span_id == owner_accept.span_id
    ]
    assert len(dispatch) >= 1
    provider_call = [
        s
        for s in spans
        if s.name == "effect.provider.call" and s.parent_span_id in {d.span_id for d in dispatch}
    ]
    assert [p.attributes["nexus.flow.provider_outcome"] for p in provider_call] == ["succeeded"]
    # Asynchronous hop 2: the receipt's delivery → SubmitWakeSignal → resolution → resume.
    receipt = [
        s
        for s in spans
        if s.name == "outbox.deliver"
        and s.service == "nexus-flow-effect-owner"
        and s.parent_span_id in {d.span_id for d in dispatch}
    ]
    assert receipt, "the receipt's delivery continues the command's trace"
    submit_server = [
        s
        for s in spans
        if s.name == "/nexus.flow.runtime.v1.WakeSignalService/SubmitWakeSignal"
        and s.service == "nexus-flow-runtime"
        and s.kind == "server"
    ]
    assert len(submit_server) >= 1
    # Every receipt delivery (this run's, and the WelcomeContact run's, whose after-save
    # hop continues the same trace) calls SubmitWakeSignal from the owner's outbox.
    owner_deliveries = {
        s.span_id
        for s in spans
        if s.name == "outbox.deliver" and s.service == "nexus-flow-effect-owner"
    }
    for server in submit_server:
        client = _parent(by_id, server)
        assert (client.service, client.kind) == ("nexus-flow-effect-owner", "client")
        assert _parent(by_id, client).span_id in owner_deliveries
    ours = [
        s
        for s in submit_server
        if _parent(by_id, _parent(by_id, s)).span_id in {x.span_id for x in receipt}
    ]
    assert ours, "this run's receipt reaches SubmitWakeSignal in the command's trace"
    resolve = _one(spans, "flow.wait.resolve", **{"nexus.flow.run_id": run_id})
    assert _parent(by_id, resolve).span_id in {x.span_id for x in ours}
    assert resolve.attributes["nexus.flow.producer_family"] == "effect_completion"

    # The after-save hop: the Contact write's WelcomeContact run continues its trace.
    create_server = _one(
        [s for s in spans if s.service == "nexus-flow-runtime"],
        "/nexus.flow.runtime.v1.RecordService/CreateRecord",
    )
    welcome_accept = _one(spans, "flow.run.accept", **{"nexus.flow.run_id": welcome_run})
    assert _parent(by_id, welcome_accept) == create_server
    welcome_attempts = [
        s
        for s in spans
        if s.name == "flow.step.attempt" and s.attributes["nexus.flow.run_id"] == welcome_run
    ]
    assert len(welcome_attempts) >= 2
    assert {s.parent_span_id for s in welcome_attempts} == {welcome_accept.span_id}

    # No payload, credential or record value in any span attribute.
    for s in spans:
        text = json.dumps(s.attributes, default=str)
        for secret in ("Bearer", "nfw1.", "ada@example.com", "approver@example.com", "Lovelace"):
            assert secret not in text, (s.name, s.attributes)

    await _assert_metrics(stack)


async def _run_terminal(stub: Any, md: Any, run_id: str) -> bool:
    return (await _run(stub, md, run_id)).runtime_state in TERMINAL


async def _assert_metrics(stack: Stack) -> None:
    """Every process serves ``/metrics``; the §19 families are on the runtime's endpoint
    and the ones this run exercised moved, on the runtime and the owner."""
    ports = {}
    for name, child in stack.children.items():
        ports[name] = await eventually(
            lambda c=child: metrics_port_from_log(c.log_path), what=f"{name}'s metrics port"
        )
    runtime_metrics: Scrape = await eventually(
        lambda: _scraped_with(ports["runtime"], "nexus_flow_runs", state="Succeeded"),
        what="the runtime's state scan to count the succeeded run",
    )
    missing = [
        family
        for families in SECTION_19.values()
        for family in families
        if not runtime_metrics.has(family)
    ]
    assert missing == []
    r = runtime_metrics
    assert r.value("nexus_flow_claims_total") >= 3
    assert r.value("nexus_flow_step_duration_seconds_count") >= 3
    # Two effects went through the runtime: the stand-in's and the WelcomeContact run's
    # real EffectSubmit (the Contact write triggered it).
    assert r.value("nexus_flow_effect_submit_latency_seconds_count", owner_kind="email.smtp") == 2
    assert r.value("nexus_flow_effect_completion_latency_seconds_count") >= 1
    assert r.value("nexus_flow_wake_latency_seconds_count", producer="effect_completion") == 2
    assert r.value("nexus_flow_outbox_deliveries_total", family="flow.effect.submit") >= 1
    assert r.value("nexus_flow_dual_ownership_runs") == 0
    assert r.value("nexus_flow_projection_divergent_runs") == 0
    owner = await scrape(ports["effect-owner"])
    # Every e-mail the sink received (the stand-in's and the WelcomeContact run's) is one
    # provider call of one accepted handoff.
    sent = len(stack.sink.received)
    assert sent == 2
    assert (
        owner.value(
            "nexus_flow_effect_provider_calls_total", owner_kind="email.smtp", outcome="succeeded"
        )
        == sent
    )
    assert owner.value("nexus_flow_effect_handoffs_total", decision="accepted") == sent
    assert (
        owner.value("nexus_flow_outbox_deliveries_total", family="effect.completion.receipt") >= 1
    )
    catalog = await scrape(ports["catalog"])
    assert catalog.value("nexus_flow_db_transactions_total", outcome="committed") > 0


async def _scraped_with(port: int, name: str, **labels: str) -> Scrape | None:
    scraped = await scrape(port)
    return scraped if scraped.value(name, **labels) >= 1 else None
