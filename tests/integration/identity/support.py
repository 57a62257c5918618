"""A durable-wait world whose worker reauthorizes every step (§17.2), with a principal
directory, Flows whose action steps declare a reauthorization policy, and readers of
the audit evidence."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.compiler import CompilerInputs, ExecutionPlan, compile_plan
from runtime_svc.identity import PrincipalDirectory, RunIdentity, record_run_identity_txn
from runtime_svc.identity.reauth import Reauthorizer
from runtime_svc.kernel import RunRecord
from runtime_svc.schema import audit_records
from runtime_svc.worker import FixedViews, StepWorker
from services import db
from tests.integration.waits.support import SIGNAL_KINDS, World
from tests.integration.worker.support import record_view
from tests.support.plans import store_plan
from tests.unit.compiler.compiler_corpus import inputs_doc, merge_patch

#: The initiating user of the tests' runs and the permission grants it starts with.
ANN = "user-ann"
GRANTS = ("Task.create", "Task.read")
#: The declared system identity of the system-mode and handoff Flows.
BOT = "svc-task-bot"


def action_flow(
    name: str,
    *,
    wait: bool = True,
    system_identity: str | None = None,
) -> dict[str, Any]:
    """Optionally a one-hour time wait, then ``fmt`` (the ``format_text`` action, whose
    catalog security policy the test chooses) with a fault connector to ``escalate``,
    then ``after`` (a Task ``resumed``); the fault path is the Flow's own explicit fault
    ``ACCESS_REVOKED``."""
    fmt: dict[str, Any] = {
        "api_name": "fmt",
        "type": "ActionCall",
        "action_type": "format_text",
        "inputs": {"text": "'resumed'", "style": "'lower'"},
        "output_variable": "subject",
        "next": "after",
        "fault": "escalate",
    }
    if system_identity is not None:
        fmt["system_identity"] = system_identity
    elements: list[dict[str, Any]] = [
        fmt,
        {
            "api_name": "after",
            "type": "CreateRecord",
            "object": "Task",
            "fields": {"Subject": "subject"},
        },
        {
            "api_name": "escalate",
            "type": "Fault",
            "code": "ACCESS_REVOKED",
            "message": "the initiating principal may no longer act",
        },
    ]
    if wait:
        elements.insert(
            0,
            {
                "api_name": "pause",
                "type": "Wait",
                "wait": {"kind": "time", "duration": "PT1H"},
                "deadline": "PT2H",
                "expiry_policy": "terminal_failure",
                "next": "fmt",
            },
        )
    return {
        "api_name": name,
        "version": 1,
        "description": "identity test Flow",
        "process_type": "autolaunched",
        "variables": [{"name": "subject", "type": "string"}],
        "start": elements[0]["api_name"],
        "elements": elements,
    }


def two_step_flow() -> dict[str, Any]:
    """Two mutation steps: Task ``one``, then Task ``two`` (initiating principal, the
    conservative default policy ``terminal_failure``)."""
    return {
        "api_name": "two_steps",
        "version": 1,
        "description": "identity test Flow",
        "process_type": "autolaunched",
        "variables": [],
        "start": "one",
        "elements": [
            {
                "api_name": "one",
                "type": "CreateRecord",
                "object": "Task",
                "fields": {"Subject": "'one'"},
                "next": "two",
            },
            {
                "api_name": "two",
                "type": "CreateRecord",
                "object": "Task",
                "fields": {"Subject": "'two'"},
            },
        ],
    }


def compile_with_security(
    world: World, source: dict[str, Any], security: dict[str, str] | None
) -> ExecutionPlan:
    """Compile ``source`` for ``world``'s scope; ``security`` replaces ``format_text``'s
    catalog security policy."""
    scope = world.scope
    binding = {
        "org_id": scope.org_id,
        "app_installation_id": scope.app_installation_id,
        "runtime_capability_id": scope.runtime_capability_id,
        "binding_digest": scope.runtime_work_binding_digest,
    }
    doc = merge_patch(
        inputs_doc(),
        {
            "binding": binding,
            "catalog": {"generation": dict(binding)},
            "policy": {"version": 9, "bounded_atomic": {"max_writes": 0}},
            "metadata_view": {
                "wait_producers": [{"kind": k, "reconciliation": "event"} for k in SIGNAL_KINDS]
            },
        },
    )
    doc = copy.deepcopy(doc)
    if security is not None:
        for entry in doc["catalog"]["entries"]:
            if entry["action_type"] == "format_text":
                entry["capabilities"]["security"] = security
    return compile_plan(source, CompilerInputs.from_dict(doc))


@dataclass
class IdentityWorld(World):
    """:class:`World` whose worker reauthorizes (by default reading the directory for
    every step; ``reauth_ttl_s``/``reauth_clock`` select the cache bound)."""

    reauth_ttl_s: float = 0.0
    reauth_clock: Callable[[], float] = time.monotonic
    directory: PrincipalDirectory = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.directory = PrincipalDirectory(self.engine)
        self.worker = StepWorker(
            self.engine,
            self.store,
            FixedViews(record_view()),
            owner="identity-test",
            waits=self.rt.steps,
            changes=self.rt.producer,
            heartbeat=False,
            identity=Reauthorizer(
                self.engine, cache_ttl_s=self.reauth_ttl_s, clock=self.reauth_clock
            ),
        )

    async def seed_with(self, source: dict[str, Any], security: dict[str, str] | None) -> str:
        plan = compile_with_security(self, source, security)
        stored = await store_plan(self.engine, source, plan, label="identity")
        self.plans[plan.flow.api_name] = (stored.plan_id, plan)
        return stored.plan_id

    async def start_as(self, flow: str, principal: str = ANN) -> RunRecord:
        """Start a run and store its §17.1 identity in the creating transaction's stead
        (StartRun does it inside; ``test_identity_start`` proves that path)."""
        run = await self.start(flow)
        _, plan = self.plans[flow]
        async with db.transaction(self.engine) as conn:
            await record_run_identity_txn(conn, self.org, run.flow_run_id, principal, plan)
        return run

    async def identity_of(self, run_id: str) -> RunIdentity:
        from runtime_svc.identity import read_run_identity_txn

        async with db.transaction(self.engine, readonly=True) as conn:
            return await read_run_identity_txn(conn, self.org, run_id)

    async def resume_after_wait(self, run_id: str) -> RunRecord:
        self.clock.advance(hours=1, seconds=1)
        stats = await self.sweep()
        assert stats.resolved == 1
        return await self.drive(run_id)


async def audit_of(engine: AsyncEngine, org: str, run_id: str) -> list[dict[str, Any]]:
    """The run's reauthorization audit rows (action, actor and parsed details); the
    record writes' own audit rows are left out."""
    a = audit_records.c
    async with db.transaction(engine, readonly=True) as conn:
        rows = await conn.execute(
            select(a.action, a.actor_kind, a.actor_id, a.details, a.attempt_id)
            .where(
                a.org_id == org,
                a.flow_run_id == run_id,
                a.action.in_(("flow_run.reauthorization_denied", "flow_run.system_handoff")),
            )
            .order_by(a.occurred_at, a.audit_record_id)
        )
        return [
            {
                "action": r.action,
                "actor_kind": r.actor_kind,
                "actor_id": r.actor_id,
                "attempt_id": r.attempt_id,
                **json.loads(r.details),
            }
            for r in rows
        ]
