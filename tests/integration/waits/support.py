"""Shared support of the durable-wait tests (integration, crash, bench): wait Flows,
their compile into a stored plan for a given work scope, a world of one scope with a
shiftable database clock, the wait runtime, a worker and the sweeps, and small reads."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.compiler import CompilerInputs, ExecutionPlan, compile_plan
from runtime_svc.kernel import (
    CheckpointInput,
    FirstStep,
    FlowRunStateStore,
    RetryPolicy,
    RunRecord,
    StartRunRequest,
)
from runtime_svc.kernel.store_waits import dependency_from_row, signal_from_row
from runtime_svc.kernel.wait_model import DependencyRecord, SignalRecord, WorkScopeKey
from runtime_svc.records import RecordEngine
from runtime_svc.records.model import Actor
from runtime_svc.records.validation import prepare_create, prepare_update
from runtime_svc.schema import (
    business_events,
    flow_dependencies,
    flow_step_executions,
    flow_wake_signals,
    records,
)
from runtime_svc.waits.evidence import SignalSubmission, evidence_digest
from runtime_svc.waits.reconciler import WaitSweeper
from runtime_svc.waits.runtime import WaitRuntime
from runtime_svc.worker import FixedViews, StepWorker, Sweeper
from services import db
from services.auth import (
    TrustedRuntimeWorkScope,
    WorkloadClaims,
    ensure_dev_keys,
    load_signing_key,
    mint_credential,
)
from services.config import ServiceName
from tests.integration.kernel.conftest import ShiftedClock
from tests.integration.worker.support import record_view
from tests.support.plans import store_plan
from tests.unit.compiler.compiler_corpus import inputs_doc, merge_patch

__all__ = [
    "SIGNAL_KINDS",
    "WAIT_POLICY",
    "World",
    "approval",
    "dependencies",
    "events_of",
    "record_flow",
    "signal_flow",
    "signals",
    "timer_flow",
    "until_flow",
    "wait_flow",
]

#: External signal kinds of the test runtime.
SIGNAL_KINDS = ("external.signal", "approval.decision")
#: Minutes-long delays: tests shift the clock past them, never sleep.
WAIT_POLICY = RetryPolicy(
    max_attempts=5,
    base_delay_ms=60_000,
    max_delay_ms=3_600_000,
    jitter_ratio=0.25,
    lease_duration_ms=300_000,
    max_lease_expiries=3,
)


def wait_flow(
    name: str,
    wait: dict[str, Any],
    *,
    deadline: str = "PT2H",
    expiry: str = "terminal_failure",
    variables: list[dict[str, Any]] | None = None,
    fault: bool = False,
) -> dict[str, Any]:
    """An autolaunched Flow: one Wait, then a CreateRecord(Task) as the resumed step; with
    ``fault`` the expiry's fault path creates an ``Escalation`` Task instead."""
    elements: list[dict[str, Any]] = [
        {
            "api_name": "pause",
            "type": "Wait",
            "wait": wait,
            "deadline": deadline,
            "expiry_policy": expiry,
            "next": "after",
            **({"fault": "escalate"} if fault else {}),
        },
        {
            "api_name": "after",
            "type": "CreateRecord",
            "object": "Task",
            "fields": {"Subject": "'resumed'"},
        },
    ]
    if fault:
        elements.append(
            {
                "api_name": "escalate",
                "type": "CreateRecord",
                "object": "Task",
                "fields": {"Subject": "'escalated'"},
            }
        )
    return {
        "api_name": name,
        "version": 1,
        "description": "durable wait test Flow",
        "process_type": "autolaunched",
        "variables": variables or [{"name": "key", "type": "string", "input": True}],
        "start": "pause",
        "elements": elements,
    }


def timer_flow(duration: str = "PT1H", **kw: Any) -> dict[str, Any]:
    return wait_flow("wait_timer", {"kind": "time", "duration": duration}, **kw)


def until_flow(**kw: Any) -> dict[str, Any]:
    return wait_flow("wait_until", {"kind": "time", "until": "key"}, **kw)


def signal_flow(
    kind: str = "external.signal", condition: str | None = "$Event.status == 'approved'", **kw: Any
) -> dict[str, Any]:
    wait: dict[str, Any] = {"kind": "event", "producer_kind": kind, "key": "'approval:' + key"}
    if condition is not None:
        wait["condition"] = condition
    return wait_flow("wait_signal", wait, **kw)


def record_flow(**kw: Any) -> dict[str, Any]:
    wait = {
        "kind": "record",
        "object": "Case",
        "record_id": "key",
        "condition": "$Event.Status == 'Closed'",
    }
    return wait_flow("wait_record", wait, **kw)


def approval(key: str, token: str, status: str = "approved", version: int = 0) -> SignalSubmission:
    """An ``external.signal`` submission for the signal Flow's key ``approval:<key>``."""
    evidence = {"status": status}
    return SignalSubmission(
        producer_kind="external.signal",
        producer_key=f"approval:{key}",
        wake_token=token,
        wake_version=version,
        evidence_digest=evidence_digest(evidence),
        evidence_json=json.dumps(evidence),
    )


def compile_for(
    scope: TrustedRuntimeWorkScope, source: dict[str, Any], *, max_wait: int | None = None
) -> ExecutionPlan:
    """Compile ``source`` against the corpus inputs, bound to ``scope``."""
    binding = {
        "org_id": scope.org_id,
        "app_installation_id": scope.app_installation_id,
        "runtime_capability_id": scope.runtime_capability_id,
        "binding_digest": scope.runtime_work_binding_digest,
    }
    generation = {k: v for k, v in binding.items()}
    policy: dict[str, Any] = {"version": 9, "bounded_atomic": {"max_writes": 0}}
    if max_wait is not None:
        policy["max_wait_seconds"] = max_wait
    doc = merge_patch(
        inputs_doc(),
        {
            "binding": binding,
            "catalog": {"generation": generation},
            "policy": policy,
            "metadata_view": {
                "wait_producers": [{"kind": k, "reconciliation": "event"} for k in SIGNAL_KINDS]
            },
        },
    )
    return compile_plan(source, CompilerInputs.from_dict(doc))


def new_scope(org: str | None = None, installation: str = "inst-crm-1") -> TrustedRuntimeWorkScope:
    org = org or f"org-{uuid.uuid4().hex[:12]}"
    from services.digest import versioned_digest

    return TrustedRuntimeWorkScope(
        org, installation, "cap-flow-runtime", versioned_digest("binding", [org, installation])
    )


def work_scope(scope: TrustedRuntimeWorkScope) -> WorkScopeKey:
    return WorkScopeKey(
        scope.org_id,
        scope.app_installation_id,
        scope.runtime_capability_id,
        scope.runtime_work_binding_digest,
    )


@dataclass
class World:
    """One work scope on a migrated database: store, wait runtime, worker, sweeps."""

    engine: AsyncEngine
    scope: TrustedRuntimeWorkScope
    clock: ShiftedClock = field(default_factory=ShiftedClock)
    store: FlowRunStateStore = field(init=False)
    rt: WaitRuntime = field(init=False)
    worker: StepWorker = field(init=False)
    sweeper: WaitSweeper = field(init=False)
    lease_sweeper: Sweeper = field(init=False)
    plans: dict[str, tuple[str, ExecutionPlan]] = field(default_factory=dict)

    policy: RetryPolicy = WAIT_POLICY

    def __post_init__(self) -> None:
        self.store = FlowRunStateStore(self.engine, policy=self.policy, clock=self.clock)
        self.rt = WaitRuntime.build(
            self.engine, clock=self.clock, signal_kinds=SIGNAL_KINDS, watch_ttl_s=0.0
        )
        self.worker = StepWorker(
            self.engine,
            self.store,
            FixedViews(record_view()),
            owner="waits-test",
            waits=self.rt.steps,
            changes=self.rt.producer,
            heartbeat=False,
        )
        self.sweeper = self.rt.sweeper(batch=50)
        self.lease_sweeper = Sweeper(self.engine, self.store)

    @property
    def org(self) -> str:
        return self.scope.org_id

    @property
    def work(self) -> WorkScopeKey:
        return work_scope(self.scope)

    def other(self, scope: TrustedRuntimeWorkScope) -> World:
        """A world of another scope sharing this one's database and clock."""
        w = World(self.engine, scope, self.clock, policy=self.policy)
        return w

    async def seed(self, source: dict[str, Any], **kw: Any) -> str:
        """Compile and store ``source`` for this scope; returns its plan id."""
        plan = compile_for(self.scope, source, **kw)
        stored = await store_plan(self.engine, source, plan, label="waits")
        self.plans[plan.flow.api_name] = (stored.plan_id, plan)
        return stored.plan_id

    async def start(self, flow: str, **variables: Any) -> RunRecord:
        plan_id, plan = self.plans[flow]
        step = plan.step(plan.start_step)
        queue = step.queue_class.value if step.queue_class else "durable_mutation"
        result = await self.store.create_run(
            self.scope,
            StartRunRequest(
                plan_id=plan_id,
                first_step=FirstStep(step.key, step.kind.value, queue),
                input=CheckpointInput(context={"variables": dict(variables)}),
            ),
        )
        return result.run

    async def run(self, run_id: str) -> RunRecord:
        return await self.store.get_run(self.org, run_id, include_deleted=True)

    async def drive(self, run_id: str, *, rounds: int = 20) -> RunRecord:
        """Bounded worker batches until the run stops moving (waiting or terminal)."""
        run = await self.run(run_id)
        for _ in range(rounds):
            done = await self.worker.run_batch(self.org)
            run = await self.run(run_id)
            if not done:
                break
        return run

    async def sweep(self) -> Any:
        return await self.sweeper.sweep_org(self.org)

    async def dependency(self, run_id: str) -> DependencyRecord:
        deps = await dependencies(self.engine, self.org, run_id)
        assert len(deps) == 1, deps
        return deps[0]

    async def record_engine(self) -> RecordEngine:
        return RecordEngine(self.engine, changes=self.rt.producer)

    async def create_case(self, case_id: str, status: str = "New") -> int:
        engine = await self.record_engine()
        view = record_view()
        result = await engine.mutate(
            self.org,
            view,
            prepare_create(view, "Case", case_id, {"Subject": "help", "Status": status}),
            actor=Actor("user", "tester"),
        )
        return result.record.version

    async def update_case(self, case_id: str, version: int, **fields: Any) -> int:
        engine = await self.record_engine()
        view = record_view()
        result = await engine.mutate(
            self.org,
            view,
            prepare_update(view, "Case", case_id, version, fields),
            actor=Actor("user", "tester"),
        )
        return result.record.version


async def dependencies(engine: AsyncEngine, org: str, run_id: str) -> list[DependencyRecord]:
    d = flow_dependencies.c
    async with db.transaction(engine, readonly=True) as conn:
        rows = (
            await conn.execute(
                select(flow_dependencies).where(d.org_id == org, d.flow_run_id == run_id)
            )
        ).mappings()
        return [dependency_from_row(r) for r in rows]


async def signals(engine: AsyncEngine, org: str) -> list[SignalRecord]:
    w = flow_wake_signals.c
    async with db.transaction(engine, readonly=True) as conn:
        rows = (
            await conn.execute(
                select(flow_wake_signals).where(w.org_id == org).order_by(w.received_at)
            )
        ).mappings()
        return [signal_from_row(r) for r in rows]


async def events_of(engine: AsyncEngine, org: str, run_id: str) -> int:
    """Business events a run's steps wrote (its exactly-once evidence)."""
    e = business_events.c
    async with db.transaction(engine, readonly=True) as conn:
        return int(
            (
                await conn.execute(
                    select(func.count())
                    .select_from(business_events)
                    .where(e.org_id == org, e.flow_run_id == run_id)
                )
            ).scalar_one()
        )


async def task_subjects(engine: AsyncEngine, org: str) -> list[str]:
    r = records.c
    async with db.transaction(engine, readonly=True) as conn:
        rows = (
            await conn.execute(select(r.fields).where(r.org_id == org, r.object_name == "Task"))
        ).scalars()
        out = []
        for raw in rows:
            value = json.loads(raw) if isinstance(raw, str) else raw
            out.append(str(value.get("Subject")))
        return sorted(out)


async def step_states(engine: AsyncEngine, org: str, run_id: str) -> dict[str, str]:
    s = flow_step_executions.c
    async with db.transaction(engine, readonly=True) as conn:
        rows = await conn.execute(
            select(s.plan_step_key, s.state).where(s.org_id == org, s.flow_run_id == run_id)
        )
        return {str(k): str(v) for k, v in rows}


def signal_submitter_token(scope: TrustedRuntimeWorkScope, data_dir: Path, ttl_s: int = 120) -> str:
    """A development workload credential with the ``flow.signals.submit`` role for
    ``scope``, signed with the dev keys under ``data_dir`` (what service processes started
    on that data dir trust): the caller of ``SubmitWakeSignal`` in process tests."""
    keys = ensure_dev_keys(data_dir, env="test")
    claims = WorkloadClaims(
        subject="approvals",
        audiences=(ServiceName.RUNTIME,),
        org_id=scope.org_id,
        app_installation_id=scope.app_installation_id,
        runtime_capability_id=scope.runtime_capability_id,
        runtime_work_binding_digest=scope.runtime_work_binding_digest,
        roles=("flow.signals.submit",),
    )
    return mint_credential(load_signing_key(keys.signing_key), "dev", claims, ttl_s=ttl_s)
